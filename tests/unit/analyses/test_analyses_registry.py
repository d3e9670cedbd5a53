"""The registry of analyses is the one place an analysis is declared: the CLI's commands and the report's
sections are generated from it, and its --json keys are what the analyses really write."""
import typing

import pytest
import typer.main

from fa_forensics.analyses.payloads import PcastSimulationPayload, TimelinePayload, keys_of

from fa_forensics.enums import Backend
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.analyses.registry import ANALYSES, BY_NAME, REPORTED
from fa_forensics.layers.fanout import Workers
from fa_forensics.layers.selection import select
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.report.run import SECTIONS, command_line

SHARED_BEFORE = ["dump", "step", "layer", "head", "rank"]
SHARED_AFTER = ["preset", "accumulation", "backend", "match_cache", "workers", "scheduler", "worker_wait", "out",
                "json_path", "debug"]


def _commands():
    return typer.main.get_command(app).commands


def test_every_registered_analysis_is_a_command_with_its_help_and_options_in_order():
    commands = _commands()
    for analysis in ANALYSES:
        command = commands[analysis.name]
        assert command.help == " ".join(analysis.help.split())  # the registered help, as one paragraph
        names = [p.name for p in command.params]
        own = [o.name for o in analysis.options]
        assert names == (SHARED_BEFORE + own + SHARED_AFTER if analysis.replays else own), analysis.name
        flags = {p.name: p.opts for p in command.params}
        for option in analysis.options:
            if option.flag is not None and not option.shared:
                assert flags[option.name] == [option.flag]


def test_report_sections_are_the_registered_ones_in_order_with_generated_command_lines():
    assert [s.name for s in SECTIONS] == [a.name for a in REPORTED]
    assert SECTIONS[0].name == "timeline"  # what happened in training first, then why (the step analyses)
    others = [a.name for a in ANALYSES if a.section is not None and a.name != "timeline"]
    assert [s.name for s in SECTIONS[1:]] == others
    recipe = Recipe("bf16")
    assert command_line("bitdiff", "d.zarr", {"layer": 0}, recipe, Backend.EMULATE) == [
        "bitdiff", "d.zarr", "--layer", "0", "--a", "bf16", "--b", "fp32", "--accumulation", "ieee", "--backend",
        "emulate"]
    assert command_line("pcast", "d.zarr", {"layer": 0}, recipe, Backend.EMULATE) == ["pcast", "d.zarr"]
    assert command_line("rank1-sim", "d.zarr", {"step": 1}, recipe, Backend.TRITON)[:5] == [
        "rank1-sim", "d.zarr", "--step", "1", "--preset"]


def test_an_option_check_refuses_in_one_line_naming_the_flag():
    beta = next(o for o in BY_NAME["fix-check"].options if o.name == "beta")
    assert beta.problem(2.0) is None
    assert beta.problem(0.5) == "--beta 0.5 must be > 1 (the paper uses 2 to 8)"


@pytest.mark.parametrize("name", [a.name for a in REPORTED if a.name not in ("isolate", "timeline")])
def test_registered_json_keys_are_the_payload_keys_of_a_real_run(planted_dump, name):
    """Every reported analysis, run as the report runs it on the planted dump: its payload has exactly the keys of
    its payload type (analyses/payloads.py), in order, and the registry's key list is that type's plus `figures`.
    isolate's written JSON is checked where the planted head is isolated once (tests/cli/test_cli_isolate.py), and
    timeline (it needs a monitored run, which the planted dump is not) on a monitored capture
    (tests/cli/test_cli_timeline.py)."""
    analysis = BY_NAME[name]
    dump = open_dump(planted_dump)
    result = analysis.report_run(dump, select(dump, 1, 0, 1), Recipe("bf16"), Backend.EMULATE, Workers())
    payload = analysis.payload(result)
    payload_type = typing.get_type_hints(analysis.module("compute").payload)["return"]
    assert typing.is_typeddict(payload_type)
    assert list(payload) == list(payload_type.__annotations__)
    assert list(analysis.json_keys) == [*payload, "figures"]


def test_json_keys_follow_the_payload_type():
    """The registry's key lists are derived from the payload types: a key added to a type is a key of the list."""
    class Probe(typing.TypedDict):
        first: int
        second: str

    assert keys_of(Probe) == ("first", "second")
    assert keys_of(Probe, then=("figures",)) == ("first", "second", "figures")
    assert BY_NAME["timeline"].json_keys == keys_of(TimelinePayload, then=("figures",))
    assert BY_NAME["pcast"].other_json_keys["simulation"][:-2] == keys_of(PcastSimulationPayload)


def test_registered_json_keys_of_the_other_modes_are_what_they_write(tmp_path):
    import json

    from typer.testing import CliRunner

    runner = CliRunner()
    add = tmp_path / "add.json"
    r = runner.invoke(app, ["bitdiff", "--add", "-2.4071154594421387", "-2.296875", "--json", str(add)])
    assert r.exit_code == 0, r.output
    assert list(json.loads(add.read_text())) == list(BY_NAME["bitdiff"].other_json_keys["add"])
    sim = tmp_path / "sim.json"
    r = runner.invoke(app, ["pcast", "--seq", "256", "--sink-strength", "7", "--seeds", "2", "--queries", "2",
                            "--head-dim", "16", "--json", str(sim)])
    assert r.exit_code == 0, r.output
    assert list(json.loads(sim.read_text())) == list(BY_NAME["pcast"].other_json_keys["simulation"])
