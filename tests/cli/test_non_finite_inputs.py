"""NaN, Inf or overflowing values in a dump (a diverged run): the heads that hold them are left out and
named (step, layer, head, array, count); what is finite is analysed; nothing finite is exit 2, one line."""
from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import DumpWriter


def _dump(path, poison):
    """One step, one layer, 3 heads of N(0, 1) bf16; poison(tensors) edits them before writing."""
    from fa_forensics.planted import bf16_reference

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 3, 32, 8, generator=g).to(torch.bfloat16) for _ in range(4))  # (B, H, T, D)
    x = torch.randn(1, 32, 24, generator=g).to(torch.bfloat16)  # (B, T, C)
    o, _ = bf16_reference(q, k, v, causal=True, scale=1 / math.sqrt(8))
    tensors = {"q": q, "k": k, "v": v, "o": o, "do": do, "x": x}
    poison(tensors)
    with DumpWriter(path, {}) as w:
        for name, t in tensors.items():
            w.write_array(0, 0, name, t)
        w.complete_step(0, loss=1.0)
    return path


def _nan_in_q_head_1(t):
    t["q"][0, 1, 3, 2] = float("nan")
    t["q"][0, 1, 5, 0] = float("inf")


def _huge_v_head_2(t):
    t["v"][0, 2] = 1e30
    t["x"][0, 0, 0] = float("nan")


def _all_nan(t):
    t["do"][:] = float("nan")


@pytest.mark.parametrize("command", ["isolate", "delta-bias", "pv-trace", "rank1-sim"])
def test_poisoned_heads_are_left_out_and_named(command, tmp_path):
    path = _dump(tmp_path / "d.zarr", _nan_in_q_head_1)
    r = CliRunner().invoke(app, [command, str(path), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    payload = json.loads((tmp_path / "r.json").read_text())
    named = [w for w in payload["warnings"] if "head 1" in w]
    assert named == ["step 0 layer 0 head 1: q holds 1 NaN and 1 Inf of 256 values; head left out of the analysis"]
    assert "head 1: q holds 1 NaN" in r.stderr


def test_overflowing_values_and_a_non_finite_x_are_named(tmp_path):
    path = _dump(tmp_path / "d.zarr", _huge_v_head_2)
    r = CliRunner().invoke(app, ["rank1-sim", str(path), "--json", str(tmp_path / "r.json")])
    warnings = json.loads((tmp_path / "r.json").read_text())["warnings"]
    overflow = "step 0 layer 0 head 2: v holds values up to 1e+30, which overflow fp32"
    assert any(w.startswith(overflow) for w in warnings), warnings
    assert r.exit_code == 0, r.output
    assert any("x holds 1 NaN of 768 values; x is left out" in w for w in warnings), warnings


@pytest.mark.parametrize("command", ["isolate", "fix-check", "pcast", "bitdiff"])
def test_nothing_finite_is_one_line_and_exit_2(command, tmp_path):
    path = _dump(tmp_path / "d.zarr", _all_nan)
    r = CliRunner().invoke(app, [command, str(path)])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "no selected head has finite inputs (step 0 layer 0 head 0: do holds 256 NaN of 256 values" in lines[0]
