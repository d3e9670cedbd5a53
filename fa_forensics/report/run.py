"""Run every analysis command on one dump for the report, in-process, and collect what each wrote.

The report talks to the analyses through the same contract a user does: each command is invoked
with its defaults plus `--out DIR/<name> --json DIR/<name>/<name>.json`, and the report reads the
documented JSON keys back. A command that is missing or fails (exit code 2) becomes a note in the
report instead of stopping it; fix-check's exit code 1 ("the fix does not remove the bias") is a
result, not a failure.

The report's --preset (default "bf16") is passed to every command that replays a low-precision
reading against fp32 (isolate, delta-bias, rank1-sim, pv-trace, fix-check) and becomes bitdiff's
side A (`--a PRESET --b fp32`); pcast keeps its own fp8 settings.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

# (name, extra arguments after DUMP); order = order in the report
ANALYSES: list[tuple[str, list[str]]] = [
    ("isolate", []),
    ("delta-bias", []),
    ("rank1-sim", []),
    ("pv-trace", []),
    ("bitdiff", ["--a", "bf16", "--b", "fp32"]),
    ("fix-check", []),
    ("pcast", []),
]


@dataclass(frozen=True)
class SectionResult:
    """What one analysis command produced."""

    name: str
    args: list[str]
    exit_code: int
    ok: bool  # produced its JSON
    note: str  # '' or why there is nothing to show
    data: Optional[dict]  # the command's --json payload
    figures: list[str]  # paths relative to the report directory
    text: str  # what the command printed (tables, verdict)
    seconds: float
    meta: dict = field(default_factory=dict)


REPORT_TEXT_WIDTH = 160  # columns of the command output embedded in the page


def _invoke(args: list[str]) -> tuple[int, str, str]:
    """Run `fa-forensics ARGS` in-process; returns (exit code, stdout text, stderr text)."""
    import typer

    from fa_forensics.cli import app
    from fa_forensics.commands.common import console, err_console

    command = typer.main.get_command(app)
    # Tables are captured for the page, not a terminal: render them wide enough not to truncate cells.
    saved_widths = [c._width for c in (console, err_console)]
    console.width = err_console.width = REPORT_TEXT_WIDTH
    try:
        with console.capture() as out, err_console.capture() as err:
            try:
                code = command.main(args=args, prog_name="fa-forensics", standalone_mode=False)
            except SystemExit as exc:  # pragma: no cover - click may still raise in odd cases
                code = exc.code
            except Exception as exc:  # a usage error (click.UsageError) or a bug in one command
                err_console.print(f"error: {type(exc).__name__}: {exc}")
                code = 2
    finally:
        console._width, err_console._width = saved_widths
    return int(code or 0), out.get(), err.get()


def run_section(name: str, extra: list[str], dump: Path, out_dir: Path, common: list[str]) -> SectionResult:
    """Run one analysis command into out_dir/<name>/ and read back its JSON and figures."""
    sec_dir = out_dir / name
    sec_dir.mkdir(parents=True, exist_ok=True)
    json_path = sec_dir / f"{name}.json"
    if json_path.exists():
        json_path.unlink()
    args = [name, str(dump), *extra, *common, "--out", str(sec_dir), "--json", str(json_path)]
    t0 = time.perf_counter()
    code, text, err = _invoke(args)
    seconds = time.perf_counter() - t0
    data = None
    if json_path.is_file():
        try:
            data = json.loads(json_path.read_text())
        except json.JSONDecodeError:
            data = None
    figures = sorted(str(p.relative_to(out_dir)) for p in sec_dir.glob("*.png"))
    note = ""
    if data is None:
        lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
        note = lines[-1] if lines else f"exit code {code}, no JSON written"
        if note.lower().startswith("error:"):
            note = note[6:].strip()
    return SectionResult(name=name, args=args, exit_code=code, ok=data is not None, note=note, data=data,
                         figures=figures, text=text, seconds=seconds)


def run_all(dump: Path, out_dir: Path, *, step=None, layer=None, head=None, accumulation: str = "ieee",
            backend: str = "emulate", preset: str = "bf16", analyses=ANALYSES,
            on_start: Optional[Callable[[str], None]] = None) -> list[SectionResult]:
    """Every analysis on `dump` (restricted by step / layer / head when given), lp = `preset`."""
    common = ["--accumulation", accumulation, "--backend", backend]
    for flag, value in (("--step", step), ("--layer", layer), ("--head", head)):
        if value is not None:
            common += [flag, str(value)]
    results = []
    for name, extra in analyses:
        if on_start is not None:
            on_start(name)
        # pcast has its own options (no selection, no accumulation model): run it with its defaults
        results.append(run_section(name, _with_preset(name, extra, preset), dump, out_dir, [] if name == "pcast" else common))
    return results


def _with_preset(name: str, extra: list[str], preset: str) -> list[str]:
    """The command's extra arguments with the low-precision preset: bitdiff's side A, --preset elsewhere."""
    if name == "pcast":
        return list(extra)
    if name == "bitdiff":
        out = list(extra)
        if "--a" in out:
            out[out.index("--a") + 1] = preset
        return out
    return [*extra, "--preset", preset]
