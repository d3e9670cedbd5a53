"""The training-speed kernels compile for an H100/H200 (sm_90) without a GPU: the table's tiles fit its shared
memory without spilling registers, and the TMA levers build. Runs fast_compile_check in a child process with
TRITON_INTERPRET unset (this session's kernels are interpreted and cannot be compiled). Every variant, the
autotune set and D 64 included: `python -m fa_forensics.replay.triton.fast_compile_check`."""
import os
import re
import subprocess
import sys


def test_fast_kernels_compile_for_sm90_fit_its_shared_memory_and_do_not_spill():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "fa_forensics.replay.triton.fast_compile_check", "--quick"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "sm_90 ok" in line]
    for kernel in ("fast_attn_fwd", "fast_attn_bwd", "fast_attn_delta", "monitor_rows"):
        assert any(line.startswith(kernel) for line in lines), (kernel, proc.stdout)
    assert not any("EXCEEDS" in line for line in lines)
    table = [line for line in lines if line.startswith(("fast_attn_fwd", "fast_attn_bwd")) and "lever" not in line]
    assert len(table) == 5 and all(" 0 B stack" in line for line in table), table
    assert any("lever tma " in line for line in lines) and any("lever tma+top2 " in line for line in lines)
    cost = [line for line in proc.stdout.splitlines() if line.startswith("fix cost")]
    assert len(cost) == 1 and re.search(r"\(\+\d+, \+\d+\.\d %\)", cost[0]), proc.stdout[-1500:]
