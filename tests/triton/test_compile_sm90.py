"""The kernels compile for an H100 (sm_90) without a GPU: triton.compile with a GPUTarget.

Runs fa_forensics.replay.triton.compile_check in a child process with TRITON_INTERPRET unset
(this test session runs the interpreter, whose kernels cannot be compiled). 16 variants: the
forward's hardware, paper, stabilized, fp8 and autocast (bf16 S, m, ℓ, rescale) settings, δ from
each source (and with bf16 S), both backward kernels with fp32 and bf16 recomputed S.
"""
import os
import re
import subprocess
import sys


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "fa_forensics.replay.triton.compile_check", "--arch", "90"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "sm_90 ok" in line]
    assert len(lines) == 16, proc.stdout
    for kernel in ("attn_fwd", "attn_delta", "attn_bwd_dkdv", "attn_bwd_dq"):
        assert any(line.startswith(kernel) for line in lines), kernel
    # the autocast cast points x.to(bf16).to(fp32) survive compilation: more fp32 → bf16 roundings
    # than the same kernel without them (the paper setting differs from autocast only in S, m, ℓ, rescale)
    roundings = {" ".join(line.split(":")[0].split()): int(re.search(r"(\d+) bf16 roundings",
                                                                     line).group(1)) for line in lines}
    assert roundings["attn_fwd bf16-autocast (S, m, ℓ, rescale bf16)"] > roundings["attn_fwd bf16 paper (pv bf16, "
                                                                                   "exact ℓ)"]
    assert roundings["attn_bwd_dq fp32 dS (ieee dot), bf16 S"] > roundings["attn_bwd_dq fp32 dS (ieee dot), fp32 S"]
