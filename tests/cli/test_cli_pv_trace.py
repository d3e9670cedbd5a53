"""pv-trace on the planted sample dump: the error of the traced dot product enters at P̄ = 1 terms."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app

ROOT = Path(__file__).resolve().parents[2]
PLANTED = ROOT / "sample_dumps" / "planted.zarr"
DEMO = ROOT / "sample_dumps" / "demo.zarr"


def _truth():
    from fa_forensics.dump import open_dump

    return open_dump(PLANTED).ground_truth


def test_planted_error_enters_at_p_one(tmp_path):
    truth = _truth()
    head = truth["planted_heads"][0]
    out = tmp_path / "json"
    res = CliRunner().invoke(app, ["pv-trace", str(PLANTED), "--step", "1", "--head", str(head),
                                   "--out", str(tmp_path), "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["feature"] == truth["planted_feature"]
    assert d["row_choice"] == "repeated-max" and len(d["p_one_positions"]) >= 2
    assert d["final_error"] < 0 and d["o_bias"]["mean"] < 0 and d["o_bias"]["p_value"] < 0.01
    assert d["frac_error_from_p_one"] > 0.5 and d["attribution"]["class"] == "tie"
    # over every row of the head: the tie class carries the O bias, and nudging P̄ = 1 below 1 removes it
    shares = d["class_shares"]
    assert d["rows_attributed"] == 2 * 256 and shares["tie"]["share"] - 3 * shares["tie"]["se"] > 0.5
    cf = d["counterfactual"]
    assert cf["agrees"] and abs(cf["nudged_o_bias"]) < 3 * cf["nudged_se"] < abs(cf["o_bias"])
    assert {j["t"] for j in d["jumps"]} >= {max(d["jumps"], key=lambda j: abs(j["error_step"]))["t"]}
    big = max(d["jumps"], key=lambda j: abs(j["error_step"]))
    assert big["t"] in d["p_one_positions"] and big["p_bar"] == 1.0
    # the bias lives in the rows with a repeated maximum
    split = d["bias_split"]
    assert split["repeated_max"]["mean"] < 0 and split["repeated_max"]["p_value"] < 0.01
    assert list(tmp_path.glob("pv_trace_*.png"))


def test_bad_row_is_one_line_exit_2():
    res = CliRunner().invoke(app, ["pv-trace", str(PLANTED), "--step", "1", "--head", "0", "--row", "99999"])
    assert res.exit_code == 2 and "--row 99999" in res.output and "Traceback" not in res.output


def test_demo_dump_runs(tmp_path):
    from fa_forensics.dump import open_dump

    dump = open_dump(DEMO)
    assert dump.steps, "sample_dumps/demo.zarr has no complete step"
    step, layer = dump.steps[0], dump.layers()[0]
    out = tmp_path / "d.json"
    res = CliRunner().invoke(app, ["pv-trace", str(DEMO), "--step", str(step), "--layer", str(layer), "--head", "0",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert {"row", "feature", "final_error", "p_one_positions", "jumps", "frac_error_from_p_one"} <= set(d)
    assert sum(j["error_step"] for j in d["jumps"]) == pytest.approx(d["final_error"], abs=1e-9)  # the jumps telescope


def test_planted_trace_under_the_autocast_preset(tmp_path):
    truth = _truth()
    out = tmp_path / "json"
    res = CliRunner().invoke(app, ["pv-trace", str(PLANTED), "--head", str(truth["planted_heads"][0]),
                                   "--preset", "bf16-autocast", "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["preset"] == "bf16-autocast" and d["pv_format"] == "bf16"
    assert d["feature"] == truth["planted_feature"] and d["row_choice"] == "repeated-max"
    assert len(d["p_one_positions"]) >= 2 and d["final_error"] < 0 and d["frac_error_from_p_one"] > 0.5


def test_p_scale_preset_is_refused_in_one_line():
    res = CliRunner().invoke(app, ["pv-trace", str(PLANTED), "--step", "1", "--preset", "fp8-s256"])
    assert res.exit_code == 2 and "fp8-s1" in res.output and "Traceback" not in res.output


@pytest.mark.slow  # about 3 s of CPU or more
def test_error_after_the_progress_bar_started_is_still_one_line():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "fa_forensics.cli", "pv-trace", str(PLANTED), "--step", "0", "--head",
                          "1",
                          "--row", "9999"], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and res.stderr.startswith("error:") and "--row 9999" in res.stderr
