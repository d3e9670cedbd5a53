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
                         "needs_fix", "recommended_S", "recommended_order", "recommendation", "band"}
    assert sink["band"] == "needs-fix" and sink["lost_mass_ci"][0] > payload["fix_floor"]
    assert plain["band"] == "no-fix"
    assert (tmp_path / "figs" / "pcast_heads.png").stat().st_size > 10_000


def _write_dump(path, q, k, v):
    """A one-step, one-layer bf16 dump of q, k, v (B, H, T, D) with O = V (pcast reads Q, K, V only)."""
    from fa_forensics.dump import DumpWriter

    B, H, T, D = q.shape
    attrs = {"module": "test.attn", "n_heads": H, "head_dim": D, "scale": 1 / math.sqrt(D), "causal": True,
             "dtype": "bfloat16"}
    w = DumpWriter(path, {"model": {"name": "pcast-test"}})
    for name, t in (("q", q), ("k", k), ("v", v), ("o", v), ("do", v)):
        w.write_array(0, 0, name, t.to(torch.bfloat16), layer_attrs=attrs)
    w.complete_step(0, loss=1.0)
    w.close()
    return path


def test_a_borderline_head_and_a_one_hot_head_get_their_own_bands_and_exit_0(tmp_path):
    """Head 0: a sink that loses about 0.5 % of the mass (borderline); head 1: all mass on key 0 (one-hot: every
    setting's O is V of key 0 exactly, so the best MSE is 0)."""
    g = torch.Generator().manual_seed(0)
    Tb = 128
    q, k, v = (torch.randn(2, 2, Tb, D, generator=g) for _ in range(3))
    q[:, :, :, 0] = math.sqrt(D)
    k[:, :, :, 0] = 0.0
    k[:, 0, :4, 0] = 8.0
    k[:, 1, 0, 0] = 200.0
    dump = _write_dump(tmp_path / "edge.zarr", q, k, v)
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["pcast", str(dump), "--scales", "1,256", "--json", str(out)])
    assert r.exit_code == 0, r.output
    p = json.loads(out.read_text())
    border, one_hot = p["heads"]
    assert border["band"] == "borderline" and not border["needs_fix"]
    lo, hi = border["lost_mass_ci"]
    assert lo < p["fix_floor"] == 0.005 < hi and lo <= border["lost_mass"] <= hi
    assert border["zeroed_share"] > 0.9 and len(border["zeroed_share_ci"]) == 2
    assert one_hot["band"] == "one-hot" and one_hot["lost_mass"] == 0.0
    assert all(s["mse"] == 0.0 for s in one_hot["settings"])
    assert p["confidence"] == 0.95
    assert p["band_counts"] == {"needs-fix": 0, "borderline": 1, "no-fix": 0, "one-hot": 1, "empty": 0}
    assert "1 borderline" in p["verdict"] and "1 one-hot" in p["verdict"]
    assert "one-hot" in r.output and "×n/a" not in r.output and "Traceback" not in r.output
    s = border["settings"][0]
    assert set(s) >= {"frac_zeroed_ci", "mass_zeroed_ci"}
    assert set(border) >= {"band", "lost_mass", "lost_mass_ci", "zeroed_share", "zeroed_share_ci", "units",
                           "unit_rows"}


def test_a_dump_too_short_for_non_sink_keys_gives_empty_heads_and_exit_0(tmp_path):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, D, generator=g) for _ in range(3))
    dump = _write_dump(tmp_path / "short.zarr", q, k, v)
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["pcast", str(dump), "--json", str(out)])
    assert r.exit_code == 0, r.output
    p = json.loads(out.read_text())
    assert [h["band"] for h in p["heads"]] == ["empty", "empty"]
    assert p["band_counts"]["empty"] == 2 and "2 empty" in p["verdict"]
    assert all(h["zeroed_share"] is None and not h["needs_fix"] for h in p["heads"])


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
