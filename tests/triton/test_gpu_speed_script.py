"""benchmarks/gpu_speed.py runs end to end on the CPU with --smoke (tiny sizes, interpreted Triton
kernels, the forward's levers, real training steps, the monitor's statistics and capture), writes its JSON
and markdown summary, and refuses plainly without a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_speed.py"


def test_smoke_run_prints_one_json_with_every_ratio(tmp_path):
    out, md = tmp_path / "speed.json", tmp_path / "speed.md"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=900, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result == json.loads(out.read_text())
    assert [(r["T"], r["D"], r["causal"]) for r in result["attention"]] == [(64, 16, True), (64, 32, False)]
    for row in result["attention"]:
        assert set(row["ms"]) == {"sdpa", "stable", "plain"} and set(row["fix_cost"]) == {"fwd", "bwd"}
        for impl in ("stable", "plain"):  # the interpreted kernels agree with SDPA (fp32 here)
            assert max(row["rel_err_vs_sdpa"][impl].values()) < 1e-5, row["rel_err_vs_sdpa"]
    step = result["training_step"]
    assert step["ms"]["plain"] > 0 and step["ratio"]["monitored"] > 0
    assert "monitor_every_1_ms" in step["capture"] and len(step["capture"]["session_steps_ms"]) == 3
    assert {"stable_fwd_vs_sdpa_min", "fix_cost_bwd_max", "monitored_step_ratio"} <= set(result["summary"])
    # every lever of the stabilized forward runs (interpreted) and computes the default's bits
    levers = result["levers"]
    assert [(r["T"], r["D"]) for r in levers] == [(64, 16), (64, 32)]
    for row in levers:
        assert set(row["levers"]) == {"top2", "tma", "tma+top2", "warp_specialize", "row_max", "plain+tma"}
        for name in ("top2", "tma", "tma+top2", "warp_specialize", "row_max"):
            assert row["levers"][name]["same_bits_as_default"] is True, (name, row["levers"][name])
    assert all(result["summary"][f"lever_{n}_same_bits"]
               for n in ("top2", "tma", "tma+top2", "warp_specialize", "row_max"))
    monitor = step["monitor_statistics"]
    assert set(monitor["ratio_to_plain"]) == {"every_row", "sampled", "sampled_side_stream",
                                              "max_top1_every_row+sampled_side_stream"}
    assert "skipped" in result["autotune"] and "skipped" in step["capture"]["compiled"]
    text = md.read_text()
    headings = ("## Attention", "## Levers of the stabilized forward", "## Training step", "## Against the targets")
    assert all(heading in text for heading in headings)


def test_without_a_gpu_it_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA GPU" in proc.stderr
