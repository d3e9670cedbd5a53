"""fix-check on the planted sample dump: exit 0, bias reduced ≥ 10x, the fixed offset still biased."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app

ROOT = Path(__file__).resolve().parents[2]
PLANTED = ROOT / "sample_dumps" / "planted.zarr"


def test_planted_fix_removes_bias_and_offset_does_not(tmp_path):
    from fa_forensics.dump import open_dump

    truth = open_dump(PLANTED).ground_truth
    head = truth["planted_heads"][0]
    out = tmp_path / "fc.json"
    # every step of the sample: one step alone leaves too few tied rows to resolve a 10x reduction
    res = CliRunner().invoke(app, ["fix-check", str(PLANTED), "--head", str(head),
                                   "--out", str(tmp_path), "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["target"]["feature"] == truth["planted_feature"]
    assert res.exit_code == 0, res.output
    assert d["bias_reduction"] is None or d["bias_reduction"] >= 10  # None: the fixed bias is exactly 0
    assert d["baseline"]["o_bias"] < 0 and d["baseline"]["o_bias_p"] < 0.01
    assert d["baseline"]["delta_err_sum"] > 0
    assert d["max_p_bar"] < 1 and d["triggered_rows"] > 0 and d["nan_count"] == 0
    alt = {a["name"]: a for a in d["alternatives"]}
    assert alt["fixed-offset"]["still_biased"]
    assert "REMOVES" in d["verdict"] and (tmp_path / "fix_check.png").exists()


def test_bad_beta_is_exit_2():
    res = CliRunner().invoke(app, ["fix-check", str(PLANTED), "--beta", "0.5"])
    assert res.exit_code == 2 and "--beta" in res.output and "Traceback" not in res.output


def test_fix_removes_the_planted_bias_under_the_papers_autocast_preset(tmp_path):
    from fa_forensics.dump import open_dump

    truth = open_dump(PLANTED).ground_truth
    out = tmp_path / "fc.json"
    res = CliRunner().invoke(app, ["fix-check", str(PLANTED), "--head", str(truth["planted_heads"][0]),
                                   "--preset", "bf16-autocast", "--json", str(out)])
    d = json.loads(out.read_text())
    assert res.exit_code == 0, res.output
    assert d["preset"] == "bf16-autocast" and "bf16-autocast" in res.output
    assert d["target"]["feature"] == truth["planted_feature"]
    assert d["baseline"]["o_bias"] < 0 and d["baseline"]["o_bias_p"] < 0.01
    assert d["fixed"]["o_bias_p"] >= 0.01 or d["bias_reduction"] is None or d["bias_reduction"] >= 10
    assert d["triggered_rows"] > 0 and d["nan_count"] == 0
    # the fixed offset leaves the bias (5 % removed); in the one family of the baseline's tests its residual is not
    # significant at this preset (Holm p 0.018), so it is not claimed "still biased", and not called a removal
    offset = {a["name"]: a for a in d["alternatives"]}["fixed-offset"]
    assert offset["removed_share"] < 0.5 and offset["outcome"] != "removed"


def test_unknown_preset_is_exit_2():
    res = CliRunner().invoke(app, ["fix-check", str(PLANTED), "--preset", "fp64"])
    assert res.exit_code == 2 and "--preset 'fp64'" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("offset", ["inf", "nan", "0", "-1"])
def test_bad_offset_is_exit_2(offset):
    res = CliRunner().invoke(app, ["fix-check", str(PLANTED), "--offset", offset])
    assert res.exit_code == 2 and "--offset" in res.output and "Traceback" not in res.output


def test_alternatives_that_produce_nan_are_named_in_the_verdict(tmp_path):
    # a finite but huge offset underflows every P̄ of the fixed-offset alternative: ℓ = 0, O = NaN
    out = tmp_path / "fc.json"
    res = CliRunner().invoke(app, ["fix-check", str(PLANTED), "--step", "0", "--head", "1", "--offset", "1e30",
                                   "--json", str(out)])
    d = json.loads(out.read_text())
    alt = {a["name"]: a for a in d["alternatives"]}
    assert alt["fixed-offset"]["nan_count"] > 0, res.output
    assert "produced NaN: fixed-offset" in d["verdict"]
