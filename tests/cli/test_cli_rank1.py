"""`fa-forensics rank1-sim` on the sample dumps: the planted stand-out input features."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import open_dump

DEMO = Path(__file__).resolve().parents[2] / "sample_dumps" / "demo.zarr"
runner = CliRunner()


def test_rank1_finds_planted_standout_features(planted_dump, tmp_path):
    d = open_dump(planted_dump)
    truth = d.ground_truth
    head = truth["planted_heads"][0]
    res = runner.invoke(app, ["rank1-sim", str(planted_dump), "--head", str(head), "--json", str(tmp_path / "r.json"),
                              "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    for key in ("cosine_offdiag_mean", "top_columns", "effective_rank", "top_sv_ratio", "cross_step_alignment",
                "accumulation_exponent"):
        assert key in r
    n = len(truth["standout_x_features"])
    assert {c["feature"] for c in r["top_columns"][:n]} == set(truth["standout_x_features"])
    # stand-out features make the X side of the rank-1 matrices alike (random rows of 256 features: |cos| ~ 0.06)
    assert r["x_cosine_offdiag_mean"] > 0.5
    assert r["cosine_offdiag_mean"] == pytest.approx(
        sum(r["cosine"][i][j] for i in range(len(r["cosine"])) for j in range(len(r["cosine"])) if i != j)
        / (len(r["cosine"]) * (len(r["cosine"]) - 1)))
    assert r["steps"] == d.steps and r["accumulation_exponent"] is not None
    assert list(tmp_path.glob("rank1_sim_*.png"))


def test_rank1_without_x_says_so(make_dump, tmp_path):
    path = make_dump(names=("q", "k", "v", "o", "do"))
    res = runner.invoke(app, ["rank1-sim", str(path), "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["has_x"] is False and r["top_columns"] == [] and r["effective_rank"] is None
    assert "no X" in r["verdict"]


def test_rank1_on_the_demo_dump_is_consistent_with_its_own_numbers(tmp_path):
    d = open_dump(DEMO)
    assert d.steps, "sample_dumps/demo.zarr has no complete step"
    res = runner.invoke(app, ["rank1-sim", str(DEMO), "--layer", str(d.layers()[0]), "--head", "0", "--json",
                              str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    n = len(r["tokens"])
    assert r["steps"] == d.steps and n == 4 * len(d.steps)  # --tokens 4 per step
    assert len(r["cosine"]) == n and all(r["cosine"][i][i] == pytest.approx(1.0) for i in range(n))
    sv = r["singular_values"]
    assert sv == sorted(sv, reverse=True) and sv[0] > 0 and 1.0 <= r["effective_rank"] <= len(sv)
    norms = r["cumulative_norms"]
    assert len(norms) == len(d.steps) and norms[0] == pytest.approx(r["step_norms"][0])
    assert sum(c["weight"] for c in r["top_columns"]) <= 1.0 + 1e-9  # shares of the squared norm


def test_rank1_preset_changes_the_error_and_is_reported(make_dump, tmp_path):
    path = make_dump(seq=32, head_dim=16)
    norms = {}
    for preset in ("bf16", "bf16-autocast"):
        res = runner.invoke(app, ["rank1-sim", str(path), "--preset", preset, "--json",
                                  str(tmp_path / f"{preset}.json")])
        assert res.exit_code == 0, res.output
        r = json.loads((tmp_path / f"{preset}.json").read_text())
        assert r["preset"] == preset
        norms[preset] = r["step_norms"]
    assert norms["bf16"] != norms["bf16-autocast"] and all(n > 0 for n in norms["bf16-autocast"])
