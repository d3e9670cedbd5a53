"""Shared pieces of the CLI: option types, error handling, JSON output, console.

Every command wraps its body in `run_cli(debug, fn)`: a `UserError` becomes one red line on
stderr and exit code 2; an unexpected exception also exits 2 with one line naming it and asking
for --debug, because a user should never see a traceback they did not ask for. --debug prints
the traceback above that line and changes nothing else: the exit code is the same, so a script
that tells bad input (2) from a finding (1) keeps working when it is debugged.
"""
from __future__ import annotations

import contextvars
import json
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

try:  # typer >= 0.26 carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

from fa_forensics.commands.options import (
    ALL_RANKS, INPUT_ARGUMENTS, OUTPUT_OPTIONS, RECIPE, REPLACED_OUTPUTS, SELECTION, OutOpt, signature,
)
from fa_forensics.layers.cluster_wait import WORKER_WAIT_SECONDS
from fa_forensics.commands.progress import ProgressLines, progress_interval
from fa_forensics.dump.terminal_text import shown
from fa_forensics.enums import AUTO, BACKENDS, Accumulation, AccumulationOrAuto, Backend
from fa_forensics.errors import UserError

if TYPE_CHECKING:
    from fa_forensics.fidelity.recipe import Recipe

REDIRECTED_WIDTH = 200  # columns of tables written to a file or pipe: whole numbers, never cells cut to 80 columns


class SafeConsole(Console):
    """A rich console that never writes a control character it did not make: every segment's text goes through
    `terminal_text.escape_controls` (rich's own newlines and cursor controls pass), and no hyperlink is drawn.
    Text from a dump that reaches a table or a line without `terminal_text.shown` is still escaped here."""

    def _render_buffer(self, buffer) -> str:
        from rich.segment import Segment

        from fa_forensics.dump.terminal_text import escape_controls

        def safe(segment: Segment) -> Segment:
            text, style, control = segment
            if control:
                return segment
            if style is not None and style.link:
                style = style.update_link(None)
            return Segment(escape_controls(text, keep="\n"), style, control)

        return super()._render_buffer(safe(segment) for segment in buffer)


def _console(stderr: bool = False) -> Console:
    """A console that sizes to the terminal, or is REDIRECTED_WIDTH wide when the stream is redirected."""
    stream = sys.stderr if stderr else sys.stdout
    return SafeConsole(stderr=stderr, width=None if stream.isatty() else REDIRECTED_WIDTH, emoji=False)


console = _console()
err_console = _console(stderr=True)

def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Show library warnings (e.g. incomplete steps in a dump) as one yellow line, not two."""
    err_console.print(f"[yellow]warning:[/] {shown(message)}", highlight=False, soft_wrap=True)


class Diagnostics:
    """The one collector of a command's warnings: every line printed on stderr is in its --json
    `warnings` too, whichever way it came (a library `warnings.warn`, an analysis's result)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._printed: set[str] = set()

    def add(self, message: str) -> None:
        if message not in self.messages:
            self.messages.append(message)

    def show(self, message: str) -> None:
        """Add `message` and print it now (once)."""
        self.add(message)
        if message not in self._printed:
            self._printed.add(message)
            _one_line_warning(message, None, None, None)

    def flush(self) -> None:
        """Print what was collected and not yet shown."""
        for message in list(self.messages):
            self.show(message)


# The diagnostics of the running command (one per run_cli call).
_DIAGNOSTICS: contextvars.ContextVar[Optional[Diagnostics]] = contextvars.ContextVar("diagnostics", default=None)


def run_cli(debug: bool, fn: Callable[[], Any]) -> Any:
    """Run a command body; map errors to one line and exit code 2, warnings to one line each.

    Library warnings are collected (`Diagnostics`) and shown when the body ends (as they come, with
    --debug); a body that fails with a UserError shows only its error line, which names what must be
    fixed first.
    """
    diagnostics = Diagnostics()
    token = _DIAGNOSTICS.set(diagnostics)
    try:
        with warnings.catch_warnings():
            collect = diagnostics.show if debug else diagnostics.add
            warnings.showwarning = lambda message, *args, **kwargs: collect(str(message))
            result = fn()
        diagnostics.flush()
        return result
    except typer.Exit:
        diagnostics.flush()
        raise
    except UserError as exc:
        if debug:
            traceback.print_exc(file=sys.stderr)
        from fa_forensics.commands.errors import cli_line

        err_console.print(f"[bold red]error:[/] {shown(cli_line(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    except KeyboardInterrupt:
        say_interrupted()
        raise typer.Exit(code=130) from None
    except Exception as exc:  # the machine refused (memory, disk), or a bug
        from fa_forensics.commands.errors import environment_line

        if debug:
            traceback.print_exc(file=sys.stderr)
        line = environment_line(exc) or (f"unexpected {type(exc).__name__}: {exc}"
                                         + ("" if debug else " (run again with --debug for the traceback)"))
        err_console.print(f"[bold red]error:[/] {shown(line)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    finally:
        _DIAGNOSTICS.reset(token)
        use_match_cache(None)  # --match-cache holds for one command only


STREAMS = ("-", "/dev/stdout", "/dev/stderr")  # --json names that mean a standard stream
interrupt_said = False  # whether "interrupted" was printed (cli.main prints it otherwise)


def say_interrupted() -> None:
    """The one line a command ended by Ctrl-C prints (exit code 130)."""
    global interrupt_said
    if not interrupt_said:
        interrupt_said = True
        err_console.print("[bold red]interrupted[/]")


def json_goes_to_stdout(argv: Sequence[str]) -> bool:
    """True when the command line sends its --json to the standard output (`--json -`, `--json=-`,
    `/dev/stdout`); a training command after `--` (capture's) is not read."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return False
        if arg == "--json" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--json="):
            value = arg.partition("=")[2]
        else:
            continue
        if value in ("-", "/dev/stdout"):
            return True
    return False


def keep_stdout_for_json(argv: Sequence[str]) -> None:
    """With --json on the standard output, every other line the command prints goes to stderr, so that the
    standard output is the one JSON object a pipe (`| jq`) reads."""
    if json_goes_to_stdout(argv):
        console.file = sys.stderr


def write_json(path: Optional[Path], payload: Any) -> None:
    """Write `payload` as JSON to `path` (if given), creating parent folders; `-` (or /dev/stdout, /dev/stderr)
    writes the stream. Anything else is a regular file: a device, FIFO or socket there is refused, so is a link,
    another user's file or a folder on the way that is a link planted in a shared place (dump/safe_files.py).

    `warnings` is the payload's own (if any) followed by every other warning the command has raised so
    far (the lines it prints on stderr), so that every command's JSON carries all of them.
    """
    if path is None:
        return
    from fa_forensics.analyses.jsonable import to_jsonable

    data = to_jsonable(payload)
    diagnostics = _DIAGNOSTICS.get()
    if isinstance(data, dict):
        own = list(data.get("warnings") or [])
        data["warnings"] = list(dict.fromkeys(own + (diagnostics.messages if diagnostics is not None else [])))
    text = json.dumps(data, indent=2) + "\n"
    if str(path) in STREAMS:  # the standard streams: written as streams, never replaced by a file
        stream = sys.stderr if str(path) == "/dev/stderr" else sys.stdout
        stream.write(text)
        stream.flush()
        return
    from fa_forensics.dump.safe_files import atomic_write

    atomic_write(Path(path), text, "json")  # never through a planted link


def ensure_out_dir(out: Optional[Path]) -> Optional[Path]:
    """Create the --out directory if given; a clear error if it cannot be made."""
    if out is None:
        return None
    from fa_forensics.dump.safe_files import refuse_link

    refuse_link(out, "out")  # figures are never written into a folder a planted link names
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output directory {out}: {exc.strerror or exc}; "
                        "choose a writable --out") from exc
    return Path(out)


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[..., None]]:
    """Progress on stderr; yields `advance(msg="")`, which moves it on by one work item.

    A terminal gets a rich progress bar; a log or a pipe gets a plain line every few seconds while the
    work runs (commands/progress.py), none for work that ends sooner, so an error found early is still
    exactly one line.
    """
    if not err_console.is_terminal:
        with ProgressLines(description, total, interval=progress_interval()) as lines:
            yield lines.advance
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda msg="": progress.update(task, advance=1, description=f"{description} {msg}".rstrip())


@contextmanager
def phase(description: str) -> Iterator[None]:
    """A step of uncounted work (a simulation, one analysis of the report): a spinner on a terminal, a plain
    line every few seconds in a log while it runs."""
    if err_console.is_terminal:
        with err_console.status(description):
            yield
        return
    with ProgressLines(description, interval=progress_interval()):
        yield


def parse_ranks(value: Optional[str]) -> Optional[int] | str:
    """--rank R|all: None (not given), a rank, or ALL_RANKS; one line for anything else."""
    if value is None or str(value).strip().lower() == ALL_RANKS:
        return None if value is None else ALL_RANKS
    try:
        rank = int(str(value).strip())
    except ValueError:
        rank = -1
    if rank < 0:
        raise UserError(f"--rank {value!r} is not a rank; give a rank number (0, 1, ...) or all")
    return rank


def ranks_line(dump, hint: str = "--rank R reads another") -> Optional[str]:
    """The line every command that reads a multi-rank store says: which ranks it holds and which one this reads
    (None for a store of one rank)."""
    ranks = list(dump.ranks)
    world = max(int(dump.world_size), len(ranks))
    if world < 2:
        return None
    held = ", ".join(map(str, ranks))
    return (f"{dump.path} holds rank{'s' if len(ranks) > 1 else ''} {held} of a {world}-rank run: this reads rank "
            f"{dump.rank} only" + (f"; {hint}" if hint else ""))


def add_warning(message: str) -> None:
    """A warning of the running command: printed on stderr when the command ends and in its --json `warnings`."""
    diagnostics = _DIAGNOSTICS.get()
    if diagnostics is not None:
        diagnostics.add(message)
    else:
        _one_line_warning(message, None, None, None)


def open_rank(path, rank: Optional[int], hint: str = "--rank R reads another"):
    """open_dump(path, rank) for a command: a store of several ranks is said in a warning (`ranks_line`)."""
    from fa_forensics.dump import open_dump

    dump = open_dump(path, rank=rank)
    line = ranks_line(dump, hint)
    if line:
        add_warning(line)
    return dump


@dataclass(frozen=True)
class AnalysisArgs:
    """The options every analysis command shares, parsed once: the dump, the selection, the recipe."""

    dump_path: Path
    step: Optional[int]
    layer: Optional[int]
    head: Optional[int]
    recipe: Recipe
    backend: Backend
    out: Optional[Path]
    json_path: Optional[Path]
    workers: Any = None  # fanout.Workers of --workers / --scheduler (None: in-process)
    rank: Optional[int] = None  # --rank (None: rank 0)

    def open(self):
        """(dump, selections, plan): open the store (the rank's tree), select what to analyse (one-line errors)
        and build the plan of the recipe once for every selected layer-step (`fidelity.planner.plan_for`: the facts
        read, `auto` resolved). Every analysis of the command replays the returned plan."""
        from fa_forensics.layers.selection import select  # lazy, as every heavy import here: the CLI starts fast

        dump = open_rank(self.dump_path, self.rank)
        selections = select(dump, self.step, self.layer, self.head)
        return dump, selections, build_plan(dump, selections, self.recipe)


def build_plan(dump, selections, recipe: Recipe):
    """`fidelity.planner.plan_for`, with a progress line where `auto` is matched (matching a dump the first time
    replays its forward under every candidate recipe; later runs read the result from the match cache)."""
    from fa_forensics.fidelity.planner import plan_for

    if not recipe.is_auto:
        return plan_for(dump, selections, recipe)
    with progress_bar("preset auto: matching the stored O", len({(s.step, s.layer) for s in selections})) as advance:
        return plan_for(dump, selections, recipe, advance=advance)


def build_accumulation(accumulation: AccumulationOrAuto | str) -> Optional[Accumulation]:
    """The Accumulation of --accumulation (None for auto). The CLI's parser has checked the value; a caller's
    bad string is one line naming the option."""
    value = getattr(accumulation, "value", accumulation)
    if value == AUTO:
        return None
    try:
        return Accumulation(value)
    except ValueError:
        raise UserError(f"--accumulation {value!r} is not one of: "
                        f"{', '.join(a.value for a in AccumulationOrAuto)}") from None


def build_recipe(preset: str, accumulation: AccumulationOrAuto | str) -> Recipe:
    """The recipe of --preset and --accumulation; a bad value is one line naming the option."""
    from fa_forensics.fidelity.recipe import Recipe, UnknownPreset

    acc = build_accumulation(accumulation)
    try:
        return Recipe(preset, acc)
    except UnknownPreset as exc:
        raise UserError(f"--preset {exc}") from None


def use_match_cache(value: Optional[str]) -> None:
    """Apply --match-cache for the running command (None: the environment's or the default directory)."""
    from fa_forensics.fidelity.match_cache import set_cache_dir

    set_cache_dir(value)


def build_workers(workers: int, scheduler: Optional[str], wait: float = WORKER_WAIT_SECONDS):
    """The fan-out of --workers / --scheduler / --worker-wait (one-line errors for bad values and for --workers N
    with --scheduler)."""
    from fa_forensics.layers.fanout import Workers

    return Workers(n=workers, scheduler=scheduler, wait=wait)


def build_backend(backend: Backend | str) -> Backend:
    """The Backend of --backend. The CLI's parser has checked the value; a caller's bad string is one line
    naming the option."""
    try:
        return Backend(getattr(backend, "value", backend))
    except ValueError:
        raise UserError(f"--backend {backend!r} is not one of: {', '.join(BACKENDS)}") from None


def register_analysis_command(app: typer.Typer, name: str, help_text: str, run: Callable[..., Any],
                              extra: Sequence[tuple[str, Any, Any]] = (), out_opt: Any = OutOpt) -> None:
    """Add an analysis command with the shared options (DUMP, --step/--layer/--head, --rank, --preset,
    --accumulation, --backend, --out, --json, --debug) and the command's own `extra` options
    ((name, Annotated type, default), shown after the selection). The body is
    `run(AnalysisArgs, **extra values)`; its return value, when an int, is the exit code."""

    def command(**kwargs: Any) -> None:
        debug = kwargs.pop("debug")

        def body():
            use_match_cache(kwargs.pop("match_cache"))
            args = AnalysisArgs(
                dump_path=kwargs.pop("dump"), step=kwargs.pop("step"), layer=kwargs.pop("layer"),
                head=kwargs.pop("head"), recipe=build_recipe(kwargs.pop("preset"), kwargs.pop("accumulation")),
                backend=build_backend(kwargs.pop("backend")), out=ensure_out_dir(kwargs.pop("out")),
                json_path=kwargs.pop("json_path"),
                workers=build_workers(kwargs.pop("workers"), kwargs.pop("scheduler"), kwargs.pop("worker_wait")),
                rank=kwargs.pop("rank"),
            )
            return run(args, **kwargs)

        code = run_cli(debug, body)
        if isinstance(code, int):
            exit_code(code)

    command.__signature__ = signature([*SELECTION, *extra,
                                       *(("out", out_opt, None) if n == "out" else n for n in RECIPE)])
    command.__name__ = name.replace("-", "_")
    app.command(name, help=help_text)(command)


def show_result(args: AnalysisArgs, result: Any, payload: dict, tables: Sequence[Any],
                draw: Callable[[Any, Path], Sequence[Path]], verdict_style: str = "bold") -> dict:
    """Print the tables, draw the figures into --out, write --json (payload + figures), print each
    warning as one yellow line and the verdict last. Returns the JSON payload."""
    for table in tables:
        console.print(table)
    figures = [str(p) for p in draw(result, args.out)] if args.out is not None else []
    payload = {**payload, "figures": figures}
    write_json(args.json_path, payload)
    print_warnings(payload.get("warnings", result.warnings))
    console.print(f"[{verdict_style}]verdict:[/] {payload['verdict']}", highlight=False, soft_wrap=True)
    return payload


def print_warnings(warnings_: Sequence[str]) -> None:
    """Each warning of a result as one yellow line on stderr (once per command)."""
    diagnostics = _DIAGNOSTICS.get()
    for w in warnings_:
        if diagnostics is not None:
            diagnostics.show(w)
        else:
            _one_line_warning(w, None, None, None)


def exit_code(code: int) -> None:
    """Exit with a code after output has been written (e.g. fix-check's verdict)."""
    sys.stdout.flush()
    raise typer.Exit(code=code)


def missing_line(exc: Exception) -> Optional[str]:
    """A required argument or option left out, worded with its own help ("missing option --out DIR: Directory
    for ..."); None for any other usage error."""
    param = getattr(exc, "param", None)
    if not isinstance(exc, click_exceptions.MissingParameter) or param is None or not getattr(param, "help", None):
        return None
    if param.param_type_name == "option":
        name = " ".join(filter(None, [param.opts[0], param.metavar]))
    else:
        name = (param.name or "").upper()
    return f"missing {param.param_type_name} {name}: {' '.join(param.help.split()).rstrip('.')}"


def command_paths(command: Any, values: dict[str, Any]) -> tuple[list[tuple[str, Path]], list[tuple[str, Path, bool]]]:
    """(inputs, outputs) of a parsed command line: inputs as (argument, path), outputs as (option, path, replaced
    whole). The match cache a command with --match-cache writes is an output even when it comes from the
    environment."""
    inputs: list[tuple[str, Path]] = []
    outputs: list[tuple[str, Path, bool]] = []
    for param in command.params:
        value = values.get(param.name)
        flag = param.opts[0] if param.opts else param.name
        if param.param_type_name == "argument" and param.name in INPUT_ARGUMENTS and value is not None:
            from fa_forensics.dump.ranks import rank_tree_of

            tree = rank_tree_of(value)  # one rank's folder of a store: the store is what is read
            inputs.append((param.name.upper(), tree[0] if tree is not None else Path(value)))
        elif param.param_type_name == "option" and flag in OUTPUT_OPTIONS:
            if flag == "--match-cache":
                from fa_forensics.fidelity.match_cache import OFF, cache_dir

                if value is not None and str(value).strip().lower() in (OFF, ""):
                    continue
                where = Path(str(value)).expanduser() if value is not None else cache_dir()
                if where is not None:
                    outputs.append((flag, where, False))
            elif value is not None and str(value) not in STREAMS:
                outputs.append((flag, Path(value), (command.name, flag) in REPLACED_OUTPUTS))
    return inputs, outputs


def refuse_outputs_in_inputs(command: Any, values: dict[str, Any]) -> None:
    """UserError when a path the command would write is one of its inputs, lies inside one or is another name of
    one of its files, or when an output lies inside another output the command replaces whole (dump/output_overlap.py).
    Checked before the command runs: nothing is read or written first."""
    from fa_forensics.dump.output_overlap import overlap

    inputs, outputs = command_paths(command, values)
    whole = [(flag, path) for flag, path, replaced in outputs if replaced]
    for flag, path, replaced in outputs:
        for name, source in inputs:
            why = overlap(path, source, replaced=replaced)
            if why is not None:
                raise UserError(f"cannot write {path} ({flag}): {why}; {source} is the {name} this command reads, "
                                f"and an output never goes into an input; choose a {flag} outside it")
        for other_flag, other in whole:
            if other_flag != flag and overlap(path, other) is not None:
                raise UserError(f"cannot write {path} ({flag}): it lies inside {other}, which {other_flag} replaces "
                                f"whole; choose a {flag} outside it")


def guard_outputs(command: Any) -> Any:
    """`command` (a click command) checking its outputs against its inputs before it runs (one line, exit 2)."""
    if getattr(command, "_outputs_guarded", False) or not hasattr(command, "params"):
        return command
    invoke = command.invoke

    def guarded(ctx):
        run_cli(bool(ctx.params.get("debug")), lambda: refuse_outputs_in_inputs(command, ctx.params))
        return invoke(ctx)

    command.invoke = guarded
    command._outputs_guarded = True
    return command


class OneLineErrorsGroup(TyperGroup):
    """The app's command group: a usage error (unknown option, `--step abc`) is one line on stderr
    and exit code 2, like every other error, instead of click's usage text and box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as exc:
            print(exc.ctx.get_help() if exc.ctx else str(exc))
            sys.exit(0)
        except click_exceptions.ClickException as exc:
            where = f" (see `{exc.ctx.command_path} --help`)" if getattr(exc, "ctx", None) is not None else ""
            message = missing_line(exc) or " ".join(exc.format_message().split()).replace(": Value error, ", ": ")
            err_console.print(f"[bold red]error:[/] {shown(message)}{shown(where)}", highlight=False, soft_wrap=True)
            sys.exit(exc.exit_code)
        sys.exit(code if isinstance(code, int) else 0)

    def resolve_command(self, ctx, args):
        """The command named first on the command line, its outputs checked against its inputs when it runs."""
        name, command, rest = super().resolve_command(ctx, args)
        return name, (guard_outputs(command) if command is not None else None), rest

    def invoke(self, ctx):
        """Run the command; Ctrl-C outside a command's body is "interrupted" and exit 130 as inside it."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            say_interrupted()
            raise typer.Exit(code=130) from None
