"""Every command that takes a DUMP answers bad input with one line on stderr and exit code 2.

Commands whose implementation has not landed print "not available yet" (also exit 2, one line);
as they land, this test checks them for real. A command that needs more than DUMP to run gets
its extra arguments from EXTRA_ARGS.
"""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app

DUMP_COMMANDS = ["info", "export", "match", "isolate", "delta-bias", "rank1-sim", "pv-trace", "bitdiff", "fix-check",
                 "pcast", "timeline", "report"]
EXTRA_ARGS = {"export": lambda tmp: ["--to", str(tmp / "out.safetensors")]}


def _missing(tmp, make_dump):
    return [str(tmp / "no_such.zarr")]


def _file(tmp, make_dump):
    (tmp / "notes.txt").write_text("not a dump\n")
    return [str(tmp / "notes.txt")]


def _empty(tmp, make_dump):
    (tmp / "empty.zarr").mkdir()
    return [str(tmp / "empty.zarr")]


def _format99(tmp, make_dump):
    path = make_dump("v99.zarr")
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["fa_forensics"]["format_version"] = 99
    (path / "zarr.json").write_text(json.dumps(meta))
    return [str(path)]


def _missing_array(tmp, make_dump):
    path = make_dump("holed.zarr", steps=(0,))
    shutil.rmtree(path / "step_000000000" / "layer_000" / "q")
    return [str(path)]


def _no_step(tmp, make_dump):
    return [str(make_dump("ok.zarr")), "--step", "12345"]


def _no_layer(tmp, make_dump):
    return [str(make_dump("ok.zarr")), "--layer", "99"]


CASES = {
    "missing-path": _missing,
    "not-a-dump-file": _file,
    "empty-folder": _empty,
    "format-version-99": _format99,
    "missing-array": _missing_array,
    "missing-step": _no_step,
    "missing-layer": _no_layer,
}


def _options(command: str) -> set[str]:
    """The option strings a command accepts (placeholders accept anything)."""
    import typer

    cmd = typer.main.get_command(app).commands[command]
    if cmd.context_settings.get("ignore_unknown_options"):
        return {"--step", "--layer"}
    return {o for p in cmd.params for o in getattr(p, "opts", [])}


NEEDS = {"missing-step": "--step", "missing-layer": "--layer"}  # cases that need an option of the command
PAIRS = [(command, case) for command in DUMP_COMMANDS for case in CASES
         if case not in NEEDS or NEEDS[case] in _options(command)]


def test_every_command_but_timeline_takes_the_selection_options():
    assert {command for command in DUMP_COMMANDS if "--step" not in _options(command)} == {"timeline"}


@pytest.mark.parametrize("command,case", PAIRS)
def test_bad_input_gives_one_line_and_exit_2(command, case, tmp_path, make_dump):
    args = CASES[case](tmp_path, make_dump)
    extra = EXTRA_ARGS.get(command, lambda tmp: [])(tmp_path)
    result = CliRunner().invoke(app, [command, *args, *extra])
    out = result.stdout + result.stderr
    assert result.exit_code == 2, f"{command} {case}: exit {result.exit_code}\n{out}"
    assert "Traceback" not in out
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"{command} {case}: expected one line on stderr, got:\n{result.stderr}"
    assert not (tmp_path / "out.safetensors").exists()


def test_backend_and_accumulation_are_typed_by_the_enums_in_every_command(planted_dump):
    """--backend and --accumulation take exactly the enums' values (the parser checks them, --help lists them),
    and a bad value is one line naming the option and its choices."""
    import enum

    import typer.main

    from fa_forensics.enums import ACCUMULATIONS, AUTO, BACKENDS

    expected = {"--backend": list(BACKENDS), "--accumulation": [*ACCUMULATIONS, AUTO]}
    group = typer.main.get_command(app)
    seen = set()
    for name, command in group.commands.items():
        for param in command.params:
            flag = next((o for o in param.opts if o in expected), None)
            if flag is None:
                continue
            seen.add((name, flag))
            typed = param.type_descriptor.annotation
            assert isinstance(typed, type) and issubclass(typed, enum.Enum), (name, flag, typed)
            assert [m.value for m in typed] == expected[flag], (name, flag)
    assert {("report", "--backend"), ("match", "--backend"), ("isolate", "--accumulation")} <= seen
    assert len(seen) >= 15  # every replaying analysis (both options), match and report
    for flag in expected:
        r = CliRunner().invoke(app, ["isolate", str(planted_dump), flag, "nope"])
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert f"'{flag}': 'nope' is not one of " + ", ".join(f"'{v}'" for v in expected[flag]) in r.output
        assert "Value error" not in r.output and "Traceback" not in r.output


def test_every_accumulation_help_names_only_options_of_its_own_command():
    """The shared --accumulation says where its default comes from in the words of each command: --preset where
    the command has one, bitdiff's --a and --b (which take its presets) there."""
    import re

    import typer.main

    group = typer.main.get_command(app)
    helps = {}
    for name, command in group.commands.items():
        own = {o for p in command.params for o in getattr(p, "opts", [])}
        for param in command.params:
            if "--accumulation" in getattr(param, "opts", []):
                named = set(re.findall(r"--[a-z][a-z-]*", param.help)) - {"--accumulation"}
                assert named and named <= own, (name, named - own, param.help)
                helps[name] = param.help
    assert "--a and --b" in helps["bitdiff"] and "--preset" not in helps["bitdiff"]
    assert "--preset auto" in helps["isolate"] and "--preset auto" in helps["report"]


@pytest.mark.parametrize("debug", [False, True])
def test_debug_adds_the_traceback_and_keeps_exit_2(debug, tmp_path):
    res = CliRunner().invoke(app, ["info", str(tmp_path / "no_such.zarr"), *(["--debug"] if debug else [])])
    assert res.exit_code == 2, res.output
    assert ("Traceback" in res.stderr) is debug
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "no_such.zarr" in lines[-1]
    assert debug or len(lines) == 1


@pytest.mark.parametrize("debug", [False, True])
def test_an_unexpected_error_exits_2_with_or_without_debug(debug, planted_dump, monkeypatch):
    import fa_forensics.dump

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the reader")

    monkeypatch.setattr(fa_forensics.dump, "open_dump", broken)
    res = CliRunner().invoke(app, ["info", str(planted_dump), *(["--debug"] if debug else [])])
    assert res.exit_code == 2, res.output
    assert ("Traceback" in res.stderr) is debug and "RuntimeError: a bug in the reader" in res.stderr
    assert ("run again with --debug" in res.stderr) is not debug


def test_every_command_ends_its_options_with_out_json_debug():
    """The options that say where results go come last, in one order, in every command's --help: --out (where a
    command has one), --json, --debug."""
    import typer.main

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        flags = [p.opts[0] for p in command.params if getattr(p, "opts", [""])[0].startswith("--")]
        assert flags[-2:] == ["--json", "--debug"], (name, flags)
        if "--out" in flags and name not in ("capture", "synth", "report"):  # there --out is the required target
            assert flags[-3:] == ["--out", "--json", "--debug"], (name, flags)


def test_every_command_help_is_one_paragraph():
    """A command's help is one paragraph whatever its docstring's line breaks (rich help would keep them, breaking
    the summary mid-sentence in `fa-forensics --help`)."""
    import typer.main

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        assert command.help and "\n" not in command.help, (name, command.help)
    r = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "250"})
    assert "dtype attributes, links leaving the store; list what" in r.output, r.output
