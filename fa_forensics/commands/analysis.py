"""The analysis commands (isolate, delta-bias, rank1-sim, pv-trace, bitdiff, fix-check, pcast, timeline),
generated from the registry (fa_forensics.analyses.registry): one command per registered analysis, with
its help and options in the registered order.

A replaying analysis gets the shared selection and recipe options around its own and one body for all:
check the options, open the dump, run the compute under a progress bar, print tables, draw figures,
write --json. bitdiff, pcast and timeline have modes of their own; their bodies are `run(**options)` in
commands/bitdiff.py, commands/pcast.py and commands/timeline.py.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Annotated, Any

import typer

from fa_forensics.analyses.registry import ANALYSES, Analysis, Option
from fa_forensics.commands.common import (
    AnalysisArgs, exit_code, progress_bar, register_analysis_command, show_result,
)
from fa_forensics.commands.options import SHARED, accumulation_option, signature
from fa_forensics.errors import InvalidSetting, OutOfRange, UserError


def preset_flags(analysis: Analysis) -> tuple[str, ...]:
    """The command's options that take a replay preset: its own (metavar PRESET, as bitdiff's --a and --b), else
    the shared --preset."""
    own = tuple(o.flag for o in analysis.options if o.metavar == "PRESET")
    return own or ("--preset",)


def annotation(option: Option, analysis: Analysis) -> Any:
    """The typer parameter type of a registered option of `analysis`."""
    if option.shared and option.name == "accumulation":
        return accumulation_option(preset_flags(analysis))
    if option.shared:
        return SHARED[option.name].type
    if option.argument:
        return Annotated[option.type, typer.Argument(help=option.help, show_default=False)]
    settings: dict[str, Any] = {"help": option.help}
    if option.metavar is not None:
        settings["metavar"] = option.metavar
    if option.min is not None:
        settings["min"] = option.min
    return Annotated[option.type, typer.Option(option.flag, **settings)]


def default(option: Option) -> Any:
    """The command-line default of a registered option: a shared one's is the table's (commands/options.py)."""
    return SHARED[option.name].default if option.shared else option.default


def replay_body(analysis: Analysis) -> Callable[..., Any]:
    """The body of a replaying analysis's command: `run(AnalysisArgs, **its own options)`."""

    def run(args: AnalysisArgs, **values: Any) -> Any:
        from fa_forensics.layers.fanout import n_items

        for option in analysis.options:
            problem = option.problem(values[option.name])
            if problem:
                raise UserError(problem)
        keywords = {o.compute_keyword: values[o.name] for o in analysis.options}
        dump, sels, plan = args.open()  # the facts read and the recipe resolved once for every layer-step
        total = len(sels) if analysis.per_layer_step else n_items(sels)
        try:
            with progress_bar(analysis.progress.format(recipe=plan.label), total) as advance:
                r = analysis.compute(dump, sels, plan, args.backend, progress=advance, workers=args.workers,
                                     **keywords)
        except OutOfRange as exc:
            if exc.what not in values:
                raise
            raise UserError(f"--{exc.what} {exc.value} is out of range at {exc.where}: "
                            f"{exc.what}s are 0..{exc.limit}") from None
        except InvalidSetting as exc:
            if not analysis.hint:
                raise
            raise UserError(f"{exc.reason}; {analysis.hint}") from None
        style = ("bold green" if r.exit_code == 0 else "bold red") if analysis.pass_fail else "bold"
        show_result(args, r, analysis.payload(r), analysis.tables(r), analysis.draw, verdict_style=style)
        return r.exit_code if analysis.pass_fail else None

    return run


def own_command(analysis: Analysis) -> Callable[..., None]:
    """A command whose options are all registered: its signature is theirs, its body the command module's `run`."""

    def command(**values: Any) -> None:
        code = importlib.import_module(f"fa_forensics.commands.{analysis.room}").run(**values)
        if isinstance(code, int):
            exit_code(code)

    command.__signature__ = signature([(o.name, annotation(o, analysis), default(o)) for o in analysis.options])
    command.__name__ = analysis.room
    return command


def register(app: typer.Typer) -> None:
    """Add every registered analysis's command to the app, in the registry's order."""
    for analysis in ANALYSES:
        if analysis.replays:
            extra = [(o.name, annotation(o, analysis), default(o)) for o in analysis.options]
            register_analysis_command(app, analysis.name, analysis.help, replay_body(analysis), extra=extra)
        else:
            app.command(analysis.name, help=analysis.help)(own_command(analysis))
