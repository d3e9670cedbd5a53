"""Shared pieces of the CLI: option types, error handling, JSON output, console.

Every command wraps its body in `run_cli(debug, fn)`: a `UserError` becomes one red line on
stderr and exit code 2 (a traceback only with --debug); an unexpected exception also exits 2
with one line naming it and asking for --debug, because a user should never see a traceback
they did not ask for.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import sys
import warnings
from pathlib import Path
from contextlib import contextmanager
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console

from fa_forensics.errors import NotAvailableYet, UserError

console = Console()
err_console = Console(stderr=True)

# Shared option types (huggingface_hub style): one definition, used by every command.
DumpArg = Annotated[Path, typer.Argument(help="Path of a dump store (a .zarr directory).", show_default=False)]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Write the result as JSON to FILE (keys documented in the README).", metavar="FILE")]
OutOpt = Annotated[Optional[Path], typer.Option("--out", help="Directory for figures (PNG) and other files.", metavar="DIR")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")]
StepOpt = Annotated[Optional[int], typer.Option("--step", help="Training step to analyse (default: every complete step).")]
LayerOpt = Annotated[Optional[int], typer.Option("--layer", help="Layer to analyse (default: every layer).")]
HeadOpt = Annotated[Optional[int], typer.Option("--head", help="Head to analyse (default: every head).")]
AccumulationOpt = Annotated[str, typer.Option("--accumulation", help="Accumulation model of every matrix product: ieee | tensor-core.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="Replay backend: emulate (CPU reference) | triton (GPU kernels).")]
PresetOpt = Annotated[str, typer.Option(
    "--preset", metavar="NAME",
    help="Low-precision reading replayed against fp32: bf16 (default) | bf16-autocast (the paper's reference code) | "
         "bf16-hw (hardware kernels, fp32 accumulator) | stabilized | stochastic | fp32 | fp8-s1 | fp8-s256 | fp8-s448. "
         "--accumulation still applies.")]


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Show library warnings (e.g. incomplete steps in a dump) as one yellow line, not two."""
    err_console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


def run_cli(debug: bool, fn: Callable[[], Any]) -> Any:
    """Run a command body; map errors to one line and exit code 2, warnings to one line."""
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.showwarning = _one_line_warning
            return fn()
    except typer.Exit:
        raise
    except UserError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]")
        raise typer.Exit(code=130)
    except Exception as exc:  # a bug, or an environment problem we did not anticipate
        if debug:
            raise
        err_console.print(
            f"[bold red]error:[/] unexpected {type(exc).__name__}: {exc} (run again with --debug for the traceback)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=2)


def to_jsonable(obj: Any) -> Any:
    """Convert dataclasses, enums, numpy/torch scalars and arrays, and paths into JSON types.

    Non-finite floats become None (JSON has no NaN), so files stay valid for every reader.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (bool, int, str)) or obj is None:
        return obj
    # numpy and torch without importing them eagerly
    if hasattr(obj, "tolist"):
        return to_jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return to_jsonable(obj.item())
    return str(obj)


def write_json(path: Optional[Path], payload: Any) -> None:
    """Write `payload` as JSON to `path` (if given), creating parent folders."""
    if path is None:
        return
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(to_jsonable(payload), indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write JSON to {path}: {exc.strerror or exc}; choose a writable path for --json")


def ensure_out_dir(out: Optional[Path]) -> Optional[Path]:
    """Create the --out directory if given; a clear error if it cannot be made."""
    if out is None:
        return None
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output directory {out}: {exc.strerror or exc}; choose a writable --out")
    return Path(out)


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[..., None]]:
    """A rich progress bar on stderr; yields `advance(msg="")`, which moves it on by one.

    Drawn only when stderr is a terminal: piped or captured output gets no bar and no stray lines,
    so an error raised mid-way is still exactly one line.
    """
    if not err_console.is_terminal:
        yield lambda msg="": None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda msg="": progress.update(task, advance=1, description=f"{description} {msg}".rstrip())


def register_selection_command(app: typer.Typer, name: str, help_text: str, run: Callable[..., Any]) -> None:
    """Add an analysis command that takes exactly the common options (DUMP, the selection, preset,
    accumulation, backend, --out, --json, --debug) and calls
    run(dump, step, layer, head, accumulation, backend, out, json_path, preset)."""

    def command(
        dump: DumpArg,
        step: StepOpt = None,
        layer: LayerOpt = None,
        head: HeadOpt = None,
        preset: PresetOpt = "bf16",
        accumulation: AccumulationOpt = "ieee",
        backend: BackendOpt = "emulate",
        out: OutOpt = None,
        json_path: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        run_cli(debug, lambda: run(dump, step, layer, head, accumulation, backend, out, json_path, preset))

    app.command(name, help=help_text)(command)


def register_not_available(app: typer.Typer, name: str, help_text: str, issue: str) -> None:
    """Add a command that exists in --help but says plainly it is not available yet (exit 2)."""

    def _not_available(
        ctx: typer.Context,
        debug: DebugOpt = False,
    ) -> None:
        run_cli(debug, lambda: (_ for _ in ()).throw(NotAvailableYet(f"'{name}' is not available yet ({issue}); nothing was done")))

    app.command(
        name,
        help=f"{help_text} [not available yet]",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(_not_available)


def fail(message: str) -> None:
    """Raise a UserError from CLI argument reconciliation code."""
    raise UserError(message)


def exit_code(code: int) -> None:
    """Exit with a code after output has been written (e.g. fix-check's verdict)."""
    sys.stdout.flush()
    raise typer.Exit(code=code)
