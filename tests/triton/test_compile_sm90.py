"""The kernels compile for an H100 (sm_90) without a GPU: triton.compile with a GPUTarget.

Runs fa_forensics.replay.triton.compile_check in a child process with TRITON_INTERPRET unset
(this test session runs the interpreter, whose kernels cannot be compiled).
"""
import os
import subprocess
import sys


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "fa_forensics.replay.triton.compile_check", "--arch", "90"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "sm_90 ok" in line]
    assert len(lines) == 10, proc.stdout
    for kernel in ("attn_fwd", "attn_delta", "attn_bwd_dkdv", "attn_bwd_dq"):
        assert any(line.startswith(kernel) for line in lines), kernel
