"""fix-check on a dump whose repeated maxima sit above ln(1e10)/(β−1) ≈ 23: under the paper's reference
code (block row sums clamped at 1e-10) the stabilized softmax collapses O there, and fix-check says so."""
from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from fa_forensics.cli import app

runner = CliRunner()
T, D = 32, 8


def write_high_tie_dump(path, high: float = 30.0, low: float = 15.0, near: bool = False):
    """Head 0: every row from 1 on attains its maximum `high` twice (keys 0 and 1 identical); head 1:
    the same pair at `low`. The other keys score 0 to 9 below. Scale 1, causal, stored O = the bf16
    reference. near: key 1 scores 2⁻¹¹ above key 0 instead (a tie within ε = 1e-3, not an exact one)."""
    from fa_forensics.dump import DumpWriter
    from fa_forensics.planted import bf16_reference

    g = torch.Generator().manual_seed(0)
    k = torch.zeros(1, 2, T, D)
    k[..., 2:, 0] = 3 * torch.rand(1, 2, T - 2, generator=g)  # first coordinate in [0, 3)
    k[..., 2:, 1:] = 0.1 * torch.randn(1, 2, T - 2, D - 1, generator=g)
    k[..., :2, 0] = 6.0  # keys 0 and 1: the tied pair
    q = torch.zeros(1, 2, T, D)
    q[:, 0, :, 0], q[:, 1, :, 0] = high / 6.0, low / 6.0  # q·k of the pair = high (head 0) or low (head 1)
    q[..., 1:] = 0.1 * torch.randn(1, 2, T, D - 1, generator=g)
    if near:
        k[..., 1, 1], q[..., 1] = 2.0**-7, 2.0**-4  # key 1: + 2⁻¹¹ (exact in fp32 and bf16)
    v, do = torch.randn(1, 2, T, D, generator=g), torch.randn(1, 2, T, D, generator=g)
    q, k, v, do = (t.bfloat16() for t in (q, k, v, do))
    o, _ = bf16_reference(q, k, v, causal=True, scale=1.0)
    w = DumpWriter(path, {"model": {"name": "test"}, "capture": {"source": "tests"}, "amp_dtype": "bfloat16"})
    x = torch.randn(1, T, 2 * D, generator=g).bfloat16()
    for name, t in {"q": q, "k": k, "v": v, "o": o, "do": do, "x": x}.items():
        w.write_array(0, 0, name, t, layer_attrs={"module": "blocks.0.attn", "causal": True, "scale": 1.0})
    w.complete_step(0, loss=1.0)
    w.close()
    return path


@pytest.fixture(scope="module")
def high_tie_dump(tmp_path_factory):
    return write_high_tie_dump(tmp_path_factory.mktemp("collapse") / "ties30.zarr")


def test_fix_check_reports_the_collapse_under_the_reference_codes_floor(high_tie_dump, tmp_path):
    js = tmp_path / "fc.json"
    r = runner.invoke(app, ["fix-check", str(high_tie_dump), "--preset", "bf16-autocast-train", "--json", str(js)])
    d = json.loads(js.read_text())
    c = d["collapse"]
    assert r.exit_code == 1 and not d["removed"], r.output
    assert c["applies"] and c["rows"] == T - 1  # head 0, rows 1..31 (row 0 sees key 0 alone)
    assert c["max_score"] == 30.0 and c["threshold"] == pytest.approx(math.log(1e10), rel=1e-12)  # β = 2
    assert 0.0015 < c["min_ratio"] < 0.0025  # 2·e^-30 / 1e-10 = 0.0019
    assert d["verdict"].startswith("FIX FAILS: it collapses O in 31 row(s)")
    text = " ".join(r.output.split())
    assert "up to 30" in text and "23" in text and "|O|/|O_fp32| drops to 0.0019" in text


def test_without_a_floor_the_collapse_is_a_warning_not_a_failure(high_tie_dump, tmp_path):
    js = tmp_path / "fc.json"
    r = runner.invoke(app, ["fix-check", str(high_tie_dump), "--preset", "bf16", "--json", str(js)])
    d = json.loads(js.read_text())
    assert r.exit_code in (0, 1) and not d["collapse"]["applies"] and d["collapse"]["rows"] == T - 1, r.output
    assert "collapses O" not in d["verdict"]
    assert any("reference code" in w and "would collapse O" in w for w in d["warnings"]), d["warnings"]
    # ties within ε in 62 rows: max P̄ is a number there, beside the rows where the fix fired
    assert "no max P̄" not in r.output and "nan" not in r.output.replace("nan_count", "")


def test_the_report_verdict_names_the_collapse(high_tie_dump, tmp_path):
    from fa_forensics.report.run import SectionResult
    from fa_forensics.report.verdict import report_verdict

    js = tmp_path / "fc.json"
    runner.invoke(app, ["fix-check", str(high_tie_dump), "--preset", "bf16-autocast-train", "--json", str(js)])
    section = SectionResult("fix-check", [], 1, True, "", json.loads(js.read_text()), [], "", 0.0)
    verdict = report_verdict([section])
    assert "the stabilized softmax collapses O in 31 row(s) (repeated maximum up to 30 > 23.03" in verdict, verdict
    assert "removes it" not in verdict
