"""`fa-forensics pcast`: the CLI in simulation mode and on a dump with a planted sink head."""
from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from fa_forensics.cli import app

runner = CliRunner()

SINK_DELTA = 8.0
T, D = 256, 32


def _sink_head(g: torch.Generator, delta: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (T, D) whose scaled scores are ≈ N(0, 1), the first 4 keys `delta` higher (coordinate 0)."""
    q = torch.randn(T, D, generator=g)
    k = torch.randn(T, D, generator=g)
    if delta is not None:
        q[:, 0] = math.sqrt(D)
        k[:, 0] = 0.0
        k[:4, 0] = delta  # score = (1/√D)·√D·Δ = Δ above the noise of the other D−1 coordinates
    return q, k


@pytest.fixture(scope="module")
def sink_dump(tmp_path_factory):
    from fa_forensics.dump import DumpWriter, open_dump

    path = tmp_path_factory.mktemp("pcast") / "sinks.zarr"
    g = torch.Generator().manual_seed(0)
    (q0, k0), (q1, k1) = _sink_head(g, SINK_DELTA), _sink_head(g, None)
    q = torch.stack([q0, q1])[None].to(torch.bfloat16)  # (1, 2, T, D): head 0 sinks, head 1 plain
    k = torch.stack([k0, k1])[None].to(torch.bfloat16)
    v = torch.randn(1, 2, T, D, generator=g).to(torch.bfloat16)
    attrs = {"module": "test.attn", "n_heads": 2, "head_dim": D, "scale": 1 / math.sqrt(D), "causal": True,
             "dtype": "bfloat16"}
    w = DumpWriter(path, {"model": {"name": "pcast-test"}})
    for name, t in (("q", q), ("k", k), ("v", v), ("o", v), ("do", v)):
        w.write_array(5, 0, name, t, layer_attrs=attrs)
    w.complete_step(5, loss=1.0)
    w.close()
    assert open_dump(path).steps == [5]
    return path


def test_dump_mode_measures_the_planted_sink_and_recommends_s256(sink_dump, tmp_path):
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["pcast", str(sink_dump), "--json", str(out), "--out", str(tmp_path / "figs")])
    assert r.exit_code == 0, r.output
    payload = json.loads(out.read_text())
    assert payload["mode"] == "dump"
    heads = {h["head"]: h for h in payload["heads"]}
    sink, plain = heads[0], heads[1]
    assert abs(sink["sink_strength"] - SINK_DELTA) < 0.6
    assert abs(plain["sink_strength"]) < 1.5
    fwd1 = next(s for s in sink["settings"] if s["S"] == 1 and s["order"] == "forward")
    fwd256 = next(s for s in sink["settings"] if s["S"] == 256 and s["order"] == "forward")
    assert fwd1["frac_zeroed"] > 0.8 and fwd256["frac_zeroed"] < 0.02
    assert fwd1["closed_form"] == pytest.approx(fwd1["frac_zeroed"], abs=0.1)
    assert sink["needs_fix"] and sink["recommended_S"] == 256.0
    assert not plain["needs_fix"]
    assert "S=256" in sink["recommendation"]
    assert set(sink) >= {"step", "layer", "head", "sink_gap", "sink_gap_se", "sink_strength", "settings",
                         "needs_fix", "recommended_S", "recommended_order", "recommendation"}
    assert (tmp_path / "figs" / "pcast_heads.png").stat().st_size > 10_000


@pytest.mark.slow  # about 3 s of CPU or more
def test_simulation_mode_json_keys_and_figures(tmp_path):
    out = tmp_path / "sim.json"
    r = runner.invoke(app, ["pcast", "--seq", "256,512", "--sink-strength", "6,7", "--seeds", "3", "--queries", "4",
                            "--head-dim", "16", "--json", str(out), "--out", str(tmp_path / "figs")])
    assert r.exit_code == 0, r.output
    p = json.loads(out.read_text())
    assert p["mode"] == "simulation" and p["n_main"] == 512
    assert p["delta_k"] == pytest.approx(1.0294, abs=1e-4)
    row = p["rows"][0]
    assert set(row) >= {"delta", "S", "order", "seq", "frac_zeroed", "closed_form", "info_loss", "mse", "mse_se"}
    cells = {(x["delta"], x["S"], x["order"], x["seq"]) for x in p["rows"]}
    assert (7.0, 1.0, "forward", 256) in cells and (6.0, 256.0, "reverse", 512) in cells
    assert (6.0, 1.0, "forward", 256) not in cells  # the N sweep runs at Δ = 7 only
    dp = {x["S"]: x["dp"] for x in p["dp"]}
    assert dp[256.0] == 2.0 ** -4 and round(dp[448.0], 4) == 0.0714
    assert p["ratio"]["numerator"] == "forward S=1" and p["ratio"]["se"] > 0
    assert {t["delta"] for t in p["ttest"]["tests"]} == {6.0, 7.0}
    assert set(p["ttest"]["tests"][0]) >= {"t", "p_value", "mean_diff", "se_diff", "verdict", "n"}
    for name in ("pcast_dp_sawtooth.png", "pcast_mse_vs_delta.png", "pcast_mse_vs_seq.png"):
        assert (tmp_path / "figs" / name).stat().st_size > 10_000


@pytest.mark.parametrize("args, needle", [
    (["--scales", "1,abc"], "--scales"),
    (["--order", "sideways"], "--order"),
    (["--seq", "2"], "sequence length"),
    (["/nonexistent/run.zarr"], "run.zarr"),
    (["--sink-strength", "7,inf"], "--sink-strength values must be finite"),
    (["--scales", "nan"], "--scales values must be finite"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = runner.invoke(app, ["pcast", *args])
    assert r.exit_code == 2
    assert needle in r.output and "Traceback" not in r.output
