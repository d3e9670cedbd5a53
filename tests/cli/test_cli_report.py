"""report on the planted sample dump (one step, the planted head): index.html with findings and figures."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app

ROOT = Path(__file__).resolve().parents[2]
PLANTED = ROOT / "sample_dumps" / "planted.zarr"


@pytest.mark.slow
def test_report_on_planted(tmp_path):
    from fa_forensics.dump import open_dump

    head = open_dump(PLANTED).ground_truth["planted_heads"][0]
    out = tmp_path / "rep"
    res = CliRunner().invoke(app, ["report", str(PLANTED), "--out", str(out), "--step", "1", "--head", str(head),
                                   "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    page = (out / "index.html").read_text()
    d = json.loads((tmp_path / "r.json").read_text())
    names = [s["name"] for s in d["sections"]]
    assert names[:6] == ["isolate", "delta-bias", "rank1-sim", "pv-trace", "bitdiff", "fix-check"]
    ok = {s["name"] for s in d["sections"] if s["ok"]}
    assert {"pv-trace", "bitdiff", "fix-check"} <= ok
    assert any("pv-trace:" in f for f in d["findings"]) and "<img src=" in page
    assert d["warnings"] == []  # planted's O is the bf16 recipe's: fidelity 100 %, nothing to warn about
    assert "replay fidelity: recipe bf16 / ieee reproduces 100.0 % of the stored O bits" in d["verdict"]
    for s in d["sections"]:
        for fig in s["figures"]:
            assert (out / fig).is_file()
        if s["ok"]:  # the keys every analysis's JSON carries
            assert s["json"]["warnings"] == [] and "replay_fidelity" in s["json"], s["name"]


def test_report_needs_out_and_its_help_says_so():
    res = CliRunner().invoke(app, ["report", str(PLANTED)])
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res.output
    assert res.stderr.startswith("error: missing option --out DIR: Directory for index.html")
    import typer.main

    out = next(p for p in typer.main.get_command(app).commands["report"].params if "--out" in p.opts)
    assert out.required
    shown = CliRunner().invoke(app, ["report", "--help"], terminal_width=200).output
    row = next(line for line in shown.splitlines() if "--out" in line)
    assert row.lstrip("│ ").startswith("*") and "[required]" in shown.split("--out", 1)[1].split("--step", 1)[0]


def test_report_unknown_preset_is_exit_2_before_any_analysis(tmp_path):
    res = CliRunner().invoke(app, ["report", str(PLANTED), "--out", str(tmp_path / "rep"), "--preset", "bf15"])
    assert res.exit_code == 2 and "--preset 'bf15'" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "rep").exists()  # refused before the output directory was made
