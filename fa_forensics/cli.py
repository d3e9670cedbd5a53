"""The `fa-forensics` command line: assembles one command module per concern.

No analysis logic lives here: each module in fa_forensics/commands/ registers its command(s)
on the app, parses options, calls one library function and renders the result; the analysis
commands are generated from the registry of analyses (commands/analysis.py).
"""
from __future__ import annotations

import typer

from fa_forensics import __version__
from fa_forensics.commands.common import OneLineErrorsGroup
from fa_forensics.commands import analysis, capture, dump_io, info, match, report, synth, verify

app = typer.Typer(
    name="fa-forensics",
    help="Forensics of low-precision attention: capture Q, K, V, O, dO, X from training, replay them "
    "through attention kernels in different precisions, find where the error starts and whether a fix removes it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    cls=OneLineErrorsGroup,
)

# Order here is the order in --help; `analysis` adds every registered analysis (fa_forensics.analyses.registry).
for _module in (capture, info, verify, synth, dump_io, match, analysis, report):
    _module.register(app)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"fa-forensics {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Forensics of low-precision attention."""


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
