"""The replay plan: a layer-step's facts read once and its recipe resolved once per run, then only read."""
from __future__ import annotations

import collections
import json
import pickle
import sys

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.errors import ConfigError
from fa_forensics.fidelity import run_facts
from fa_forensics.fidelity.auto import choose
from fa_forensics.fidelity.planner import plan_for
from fa_forensics.fidelity.recipe import Recipe, hp_config, lp_config_for
from fa_forensics.layers.selection import select

_WATCHED = {run_facts.facts_at.__code__: "facts_at", run_facts.read_facts.__code__: "read_facts",
            choose.__code__: "choose"}


def _calls(argv: list[str], json_path) -> tuple[collections.Counter, dict]:
    """(calls of the facts' readers and of `auto.choose` over one in-process CLI run, its --json payload)."""
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in _WATCHED:
            calls[_WATCHED[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        result = CliRunner().invoke(app, [*argv, "--json", str(json_path)])
    finally:
        sys.setprofile(None)
    assert result.exit_code == 0, result.output
    return calls, json.loads(json_path.read_text())


@pytest.mark.parametrize("sides", [[], ["--a", "bf16", "--b", "fp32"]], ids=["auto-vs-fp32", "two-presets"])
def test_a_bitdiff_run_reads_each_layer_steps_facts_once(make_dump, sides, tmp_path):
    dump = make_dump(steps=(0, 1), layers=(0, 1))  # small: the calls are counted over every Python call
    layer_steps = {(sel.step, sel.layer) for sel in select(open_dump(dump))}
    assert len(layer_steps) == 4
    calls, payload = _calls(["bitdiff", str(dump), *sides], tmp_path / "bitdiff.json")
    assert calls["facts_at"] == len(layer_steps) and calls["read_facts"] == len(layer_steps)
    assert calls["choose"] == (len(layer_steps) if not sides else 0)  # auto is resolved once per layer-step
    assert payload["replay_fidelity"]["per_layer"]  # the run did replay and compare every layer-step


def test_the_plan_holds_what_every_reader_replays(planted_dump):
    dump = open_dump(planted_dump)
    sels = select(dump)
    plan = plan_for(dump, sels, Recipe())
    assert plan_for(dump, sels, plan) is plan  # a plan that covers the selections is used as it is
    assert pickle.loads(pickle.dumps(plan)) == plan  # work items on other processes carry it
    for sel in sels:
        planned = plan.at(sel.step, sel.layer)
        assert planned.facts == run_facts.read_facts(dump, sel.step, sel.layer)
        assert planned.lp == lp_config_for(dump, sel.step, sel.layer, plan.recipe) and planned.hp == hp_config()
        assert planned.preset == plan.recipe.choice_at(sel.step, sel.layer).preset
    with pytest.raises(ConfigError, match="no step 99 layer 0"):
        plan.at(99, 0)
    wider = plan_for(dump, [*sels[:1]], Recipe("bf16"), known=plan)
    assert wider.at(sels[0].step, sels[0].layer).facts is plan.at(sels[0].step, sels[0].layer).facts
