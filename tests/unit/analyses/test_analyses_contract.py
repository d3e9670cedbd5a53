"""The analyses' shared contract on the planted sample dump: one recipe, warnings from the layer
checks, and the keys every JSON carries."""
import json

import pytest
from typer.testing import CliRunner

from fa_forensics.layers import checks, selection
from fa_forensics.analyses.delta_bias import compute as delta_bias
from fa_forensics.enums import Backend
from fa_forensics.analyses.jsonable import to_jsonable
from fa_forensics.fidelity.match import LayerFidelity
from fa_forensics.fidelity.recipe import Recipe, lp_config_for
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.enums import Accumulation
from fa_forensics.replay.config import ReplayConfig


@pytest.fixture
def odd_head_check():
    """A layer check that warns when head 1 is selected (removed again after the test)."""

    def check(t, dump, info):
        if 1 in t.heads:
            yield f"{t.where}: head 1 selected"

    checks.layer_check(check)
    yield check
    checks.LAYER_CHECKS.remove(check)


def test_recipe_resolves_once_per_layer_with_the_accumulation_applied(planted_dump):
    dump = open_dump(planted_dump)
    recipe = Recipe("bf16-hw", Accumulation.IEEE)
    cfg = lp_config_for(dump, 1, 0, recipe)
    assert cfg == ReplayConfig.preset("bf16-hw").with_(accumulation=Accumulation.IEEE)
    own = Recipe("mine", "tensor-core", config=ReplayConfig(block_m=64, block_n=64))
    assert lp_config_for(None, 0, 0, own) == ReplayConfig(block_m=64, block_n=64, accumulation=Accumulation.TENSOR_CORE)


def test_layer_check_warnings_reach_the_result_and_its_json(planted_dump, odd_head_check):
    dump = open_dump(planted_dump)
    sels = selection.select(dump, step=1, head=1)
    t = selection.load(dump, sels[0])
    assert t.warnings == ("step 1 layer 0: head 1 selected",) and t.source is dump
    r = delta_bias.run(dump, sels, Recipe(), Backend.EMULATE)
    d = delta_bias.payload(r)
    assert d["warnings"] == ["step 1 layer 0: head 1 selected"]
    fid = d["replay_fidelity"]  # the planted O is the bf16 replay: auto finds it, reproduced in full
    assert fid.preset == "bf16" and fid.o_bits_equal == 1.0 and fid.per_layer == (
        LayerFidelity(step=1, layer=0, preset="bf16", accumulation="ieee", o_bits_equal=1.0),)
    assert to_jsonable(fid)["per_layer"] == [  # the JSON keeps its keys
        {"step": 1, "layer": 0, "preset": "bf16", "accumulation": "ieee", "o_bits_equal": 1.0}]
    assert (d["preset"], d["accumulation"], d["backend"]) == ("auto", "auto", "emulate")
    assert d["per_step"][0].head == 1 and d["total"]["delta_err_sum"] > 0  # the planted head's positive bias
    quiet = delta_bias.run(dump, selection.select(dump, step=1, head=0))
    assert quiet.warnings == ()


def test_cli_prints_each_warning_as_one_line_and_writes_it(planted_dump, odd_head_check, tmp_path):
    res = CliRunner().invoke(app, ["delta-bias", str(planted_dump), "--step", "1", "--head", "1", "--json",
                                   str(tmp_path / "d.json")])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("warning:")]
    assert lines == ["warning: step 1 layer 0: head 1 selected"]
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["warnings"] == ["step 1 layer 0: head 1 selected"] and "replay_fidelity" in d
