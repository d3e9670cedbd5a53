"""The `fa-forensics` command line: assembles one command module per concern.

No analysis logic lives here: each module in fa_forensics/commands/ registers its command(s)
on the app, parses options, calls one library function and renders the result; the analysis
commands are generated from the registry of analyses (commands/analysis.py).

Importing this module is cheap: the app (typer, rich and the command modules, which import torch, scipy
and zarr only inside the bodies that compute) is built on first use of `app` or in `main`, after `main`
has installed the Ctrl-C handler. So Ctrl-C at any moment, also while those import, ends in one
line "interrupted" and exit code 130, never a traceback; the first Ctrl-C unwinds the command (its
staging folders and temporary files are removed on the way out), and a second one cannot cut that
cleanup short.
"""
from __future__ import annotations

import inspect
import signal
import sys

from fa_forensics import commands  # noqa: F401 - the room the app is built from; its modules load in build_app

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C

_APP = None


def _on_interrupt(signum, frame) -> None:
    """The first Ctrl-C: let the cleanup that follows run to its end, then unwind the command."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def install_interrupt_handler() -> None:
    """Handle Ctrl-C as `_on_interrupt` (only from the main thread of a process that did not ignore it)."""
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, _on_interrupt)
    except ValueError:  # not the main thread: the host program handles signals
        pass


def _said_interrupted() -> bool:
    """Whether the command already printed its "interrupted" line (commands/common.py, if it was imported)."""
    common = sys.modules.get("fa_forensics.commands.common")
    return bool(getattr(common, "interrupt_said", False))


def _run(prog_name: str | None) -> int:
    """Build the app and run the command line; its exit code."""
    from fa_forensics.commands.common import keep_stdout_for_json

    keep_stdout_for_json(sys.argv[1:])
    try:
        __getattr__("app")(prog_name=prog_name)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        sys.stderr.write(f"{exc.code}\n")
        return 1
    return 0


def build_app():
    """The typer app with every command registered (imports every command module)."""
    import typer

    from fa_forensics import __version__
    from fa_forensics.commands import analysis, capture, dump_io, info, match, report, synth, verify
    from fa_forensics.commands.common import OneLineErrorsGroup

    app = typer.Typer(
        name="fa-forensics",
        help="Forensics of low-precision attention: capture Q, K, V, O, dO, X from training, replay them "
        "through attention kernels in different precisions, find where the error starts and whether a fix removes "
        "it.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        cls=OneLineErrorsGroup,
    )

    # Order here is the order in --help; `analysis` adds every registered analysis (fa_forensics.analyses.registry).
    for module in (capture, info, verify, synth, dump_io, match, analysis, report):
        module.register(app)
    for command in app.registered_commands:  # one paragraph each: rich help keeps a docstring's line breaks
        text = command.help if command.help is not None else inspect.getdoc(command.callback)
        command.help = " ".join(text.split()) if text else text

    def version_callback(value: bool) -> None:
        if value:
            typer.echo(f"fa-forensics {__version__}")
            raise typer.Exit()

    @app.callback()
    def _root(
        version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                     help="Print the version and exit."),
    ) -> None:
        """Forensics of low-precision attention."""

    return app


def __getattr__(name: str):
    """`fa_forensics.cli.app`, built once on first use."""
    global _APP
    if name == "app":
        if _APP is None:
            _APP = build_app()
        return _APP
    raise AttributeError(f"module 'fa_forensics.cli' has no attribute {name!r}")


def main(prog_name: str | None = None) -> None:
    """Console-script entry point: the Ctrl-C handler first, then the heavy imports, then the command.

    The handler raises KeyboardInterrupt at most once (it then ignores Ctrl-C), and every statement until
    Ctrl-C is ignored for good stands inside this try: an interrupt at any moment ends in exit code 130."""
    install_interrupt_handler()
    try:
        code = _run(prog_name)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command is over: a late Ctrl-C changes nothing
    except KeyboardInterrupt:
        code = INTERRUPTED
    if code == INTERRUPTED and not _said_interrupted():
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        sys.stderr.write("interrupted\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
