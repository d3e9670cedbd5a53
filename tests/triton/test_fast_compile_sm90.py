"""The training-speed kernels compile for an H100 (sm_90) without a GPU, and their largest autotune
configs fit its shared memory. Runs fast_compile_check in a child process with TRITON_INTERPRET
unset (this session's kernels are interpreted and cannot be compiled). The full set of configs:
`python -m fa_forensics.replay.triton.fast_compile_check` (about 25 variants)."""
import os
import subprocess
import sys


def test_fast_kernels_compile_for_sm90_and_fit_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "fa_forensics.replay.triton.fast_compile_check", "--quick"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "sm_90 ok" in line]
    for kernel in ("fast_attn_fwd", "fast_attn_bwd", "fast_attn_delta", "monitor_rows"):
        assert any(line.startswith(kernel) for line in lines), (kernel, proc.stdout)
    assert not any("EXCEEDS" in line for line in lines)
