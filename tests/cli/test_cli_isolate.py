"""`fa-forensics isolate` on the sample dumps (restricted to one step and head to stay fast)."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fa_forensics.analyses.payloads import IsolatePayload
from fa_forensics.analyses.registry import BY_NAME
from fa_forensics.cli import app
from fa_forensics.dump import open_dump

pytestmark = pytest.mark.slow  # its module fixture runs isolate on the planted dump (about 10 s of CPU)

DEMO = Path(__file__).resolve().parents[2] / "sample_dumps" / "demo.zarr"
runner = CliRunner()


@pytest.fixture(scope="module")
def planted_result(tmp_path_factory):
    """isolate on one step and head of a planted dump with enough independent units in a step (4 batch rows) for
    its Σδ to be significant: the bundled planted dump's 2 batch rows give about 40 units a step, too few."""
    from fa_forensics.planted import SynthSpec, synth

    out = tmp_path_factory.mktemp("isolate")
    dump = out / "planted.zarr"
    synth(dump, SynthSpec(seq=256, heads=4, head_dim=64, batch=4, steps=3, planted_heads=(1,), sink_strength=8.0,
                          seed=0))
    head = open_dump(dump).ground_truth["planted_heads"][0]
    res = runner.invoke(app, ["isolate", str(dump), "--step", "1", "--head", str(head),
                              "--json", str(out / "r.json"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "r.json").read_text()), out, head


def test_isolate_json_keys_and_claim1_culprits(planted_result):
    r, out, head = planted_result
    assert list(r) == [*IsolatePayload.__annotations__, "figures"] == list(BY_NAME["isolate"].json_keys)
    for v in r["variants"]:
        assert {"name", "o_bias", "o_bias_se", "o_rmse", "delta_err_sum", "dq_err", "dwq_err"} <= v.keys()
    assert {h["head"] for h in r["heads"]} == {head} and r["heads"][0]["delta_err_sum"] > 0
    by = {v["name"]: v for v in r["variants"]}
    assert by["baseline"]["delta_err_sum"] > 3 * by["baseline"]["delta_err_se"]
    # Claim 1: δ computed from a high-precision O (or without O) removes the error; tiling does not
    assert {"o-fp32", "delta-o-recomputed", "delta-dp-p"} <= set(r["culprits"])
    assert "no-tiling" not in r["culprits"]
    assert (out / "isolate_variants.png").stat().st_size > 10_000 and (out / "isolate_heads.png").is_file()


def test_isolate_names_pv_precision_or_stabilized_softmax(planted_result):
    r, _, _ = planted_result
    assert {"pv-fp32", "stabilized"} & set(r["culprits"])


def test_isolate_bad_options_are_one_line_errors(planted_dump):
    res = runner.invoke(app, ["isolate", str(planted_dump), "--accumulation", "fma"])
    assert res.exit_code == 2 and "--accumulation" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["isolate", str(planted_dump), "--step", "999"])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_isolate_runs_on_demo_dump(tmp_path):
    d = open_dump(DEMO)
    assert d.steps, "sample_dumps/demo.zarr has no complete step"
    res = runner.invoke(app, ["isolate", str(DEMO), "--step", str(d.steps[0]), "--layer", str(d.layers(d.steps[0])[0]),
                              "--head", "0", "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    # auto replays the demo's training recipe, bf16-autocast-train: bf16 scores and statistics, so two more repairs
    assert r["replay_fidelity"]["preset"] == "bf16-autocast-train" and r["replay_fidelity"]["o_bits_equal"] == 1.0
    assert [v["name"] for v in r["variants"]] == ["baseline", "no-tiling", "o-fp32", "delta-o-recomputed", "delta-dp-p",
                                                 "pv-fp32", "stats-fp32", "scores-fp32", "stabilized", "stochastic"]
    by = {v["name"]: v for v in r["variants"]}
    assert by["o-fp32"]["o_rmse"] < by["baseline"]["o_rmse"]  # an fp32 O path is closer to the fp32 replay
    assert all(v["o_rmse"] >= abs(v["o_bias"]) for v in r["variants"])  # RMS ≥ |mean|


def test_isolate_under_the_autocast_preset_keeps_its_tiles_and_reports_it(planted_result, planted_dump, tmp_path):
    _, out, head = planted_result  # the planted dump with 4 batch rows, its three steps pooled
    res = runner.invoke(app, ["isolate", str(out / "planted.zarr"), "--head", str(head), "--preset",
                              "bf16-autocast",
                              "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["preset"] == "bf16-autocast" and r["baseline_tiles"] == [512, 512]
    by = {v["name"]: v for v in r["variants"]}
    assert {"stats-fp32", "scores-fp32"} <= by.keys() and "preset bf16-autocast" in by["baseline"]["description"]
    assert r["bias"]["found"] and by["baseline"]["delta_err_sum"] > 3 * by["baseline"]["delta_err_se"]
    # the O path and δ repairs remove most of the bias, not all: bf16 ℓ stays (measured 78-80%)
    for name in ("o-fp32", "delta-o-recomputed", "delta-dp-p"):
        assert by[name]["reduction"] > 0.6, name
    res = runner.invoke(app, ["isolate", str(planted_dump), "--preset", "nope"])
    assert res.exit_code == 2 and "--preset 'nope'" in res.output
