"""The analyses tell one story: on each sample dump they agree on whether and where a bias exists
(same (layer, head), one sign per quantity), and the report opens with that one verdict."""
from pathlib import Path

import pytest

from fa_forensics.dump import open_dump
from fa_forensics.report.run import SECTIONS, run_all
from fa_forensics.report.verdict import agreement, claims, report_verdict

ROOT = Path(__file__).resolve().parents[2]
CLAIMING = [s for s in SECTIONS if s.name in ("isolate", "delta-bias", "bitdiff", "fix-check", "pv-trace")]


def _sections(path, tmp_path, **selection):
    dump = open_dump(path)
    return run_all(dump, path, tmp_path, sections=CLAIMING, **selection)


@pytest.mark.slow
def test_planted_dump_one_story(tmp_path):
    path = ROOT / "sample_dumps" / "planted.zarr"
    truth = open_dump(path).ground_truth
    secs = _sections(path, tmp_path, step=1)
    by = claims(secs)
    assert set(by) == {s.name for s in CLAIMING}, [s.note for s in secs]
    agree, place = agreement(by)
    assert agree and place == (0, truth["planted_heads"][0])
    assert all(c["found"] for c in by.values())
    assert {c["sign"] for c in by.values() if c["quantity"] == "O"} == {-1}  # rounded up in magnitude, V negative
    assert {c["sign"] for c in by.values() if c["quantity"] == "delta"} == {1}
    assert {c["feature"] for c in by.values() if c["feature"] is not None} == {truth["planted_feature"]}
    verdict = report_verdict(secs)
    assert verdict.startswith("VERDICT: biased rounding at layer 0 head 1, step 1, feature 44")
    assert "stabilized softmax removes it" in verdict and "P̄ = 1 rounding mechanism carries" in verdict


@pytest.mark.slow
def test_demo_dump_one_story(tmp_path):
    path = ROOT / "sample_dumps" / "demo.zarr"
    d = open_dump(path)
    secs = _sections(path, tmp_path, step=d.steps[-1], layer=d.layers()[0])
    by = claims(secs)
    assert set(by) == {s.name for s in CLAIMING}, [s.note for s in secs]
    agree, place = agreement(by)
    assert agree, by
    verdict = report_verdict(secs)
    if place is None:
        assert verdict.startswith("VERDICT: no significant bias")
    else:
        assert verdict.startswith(f"VERDICT: biased rounding at layer {place[0]} head {place[1]}")
