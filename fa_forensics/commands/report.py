"""`fa-forensics report DUMP --out DIR`: every analysis with its defaults, assembled into DIR/index.html."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from fa_forensics.commands.progress import ProgressLines, progress_interval
from fa_forensics.commands.common import (
    build_backend, build_recipe, build_workers, console, err_console, run_cli, use_match_cache, write_json,
)
from fa_forensics.commands.options import RECIPE, REQUIRED, SELECTION, signature
from fa_forensics.dump.terminal_text import shown
from fa_forensics.enums import AccumulationOrAuto, Backend
from fa_forensics.errors import UserError

ReportOutOpt = Annotated[Path, typer.Option(  # no default: required, and --help says so
    "--out", help="Directory for index.html, and beside it one folder of figures and JSON per analysis.",
    metavar="DIR", show_default=False)]


def run(dump_path: Path, out: Path, step, layer, head, preset: str, accumulation: AccumulationOrAuto | str,
        backend: Backend | str,
        json_path, workers: int = 1, scheduler: Optional[str] = None) -> None:
    from fa_forensics.dump import open_dump
    from fa_forensics.report.html import findings, write_report
    from fa_forensics.report.output import staged_report
    from fa_forensics.analyses.jsonable import to_jsonable
    from fa_forensics.report.run import ANALYSES, EXIT_CODES, exit_meaning, run_all
    from fa_forensics.report.verdict import build_verdict

    recipe, backend_ = build_recipe(preset, accumulation), build_backend(backend)
    accumulation = getattr(accumulation, "value", accumulation)
    fan_out = build_workers(workers, scheduler)
    dump = open_dump(dump_path)  # fail early, with the dump store's one-line error, on a bad DUMP
    from fa_forensics.layers.selection import select

    select(dump, step, layer, head)  # a step, layer or head the dump lacks: one line, before any analysis runs
    t0 = time.perf_counter()
    done = []
    log = ProgressLines("report", len(ANALYSES), interval=progress_interval())

    def on_start(name: str) -> None:
        if done:
            log.advance(done[-1])
        done.append(name)
        log.now(name)
        if err_console.is_terminal:  # a line per analysis for a person; a log gets `log`'s lines every few seconds
            err_console.print(f"[{len(done)}/{len(ANALYSES)}] {name} …", highlight=False)

    with staged_report(out, ANALYSES) as staged:  # built aside, moved into --out only when complete
        with log if not err_console.is_terminal else contextlib.nullcontext():
            sections = run_all(dump, dump_path, staged, step=step, layer=layer, head=head, recipe=recipe,
                               backend=backend_, on_start=on_start, workers=fan_out, published_as=Path(out))
        seconds = time.perf_counter() - t0
        info = {"steps": len(dump.steps), "layers": len(dump.layers()), "preset": preset, "accumulation": accumulation,
                "backend": backend_.value}
        write_report(staged, str(dump_path), sections, info=info, seconds=seconds)
    index = Path(out) / "index.html"

    table = Table(title=f"report: {shown(dump_path)}")
    for c in ("analysis", "exit code: meaning", "seconds", "figures", "note"):
        table.add_column(c)
    for s in sections:
        table.add_row(s.name, f"{s.exit_code}: {exit_meaning(s)}", f"{s.seconds:.1f}", str(len(s.figures)),
                      "" if s.ok else shown(s.note[:80]))
    table.caption = EXIT_CODES
    console.print(table)
    summary = build_verdict(sections)
    verdict = summary.line()
    # every section's, once
    warnings = list(dict.fromkeys(w for s in sections for w in ((s.data or {}).get("warnings") or [])))
    write_json(json_path, {
        "index": str(index), "seconds": seconds, "preset": preset, "verdict": verdict,
        "summary": to_jsonable(summary), "findings": findings(sections),
        "warnings": warnings,
        "sections": [{"name": s.name, "exit_code": s.exit_code, "ok": s.ok, "note": s.note, "figures": s.figures,
                      "seconds": s.seconds, "json": s.data} for s in sections],
    })
    ok = sum(s.ok for s in sections)
    if not ok:
        first = sections[0]
        raise UserError(f"no analysis of {dump_path} could run ({first.name}: {' '.join(first.note.split())[:200]}); "
                        f"run `fa-forensics verify {dump_path}` and fix the first problem")
    console.print(f"{ok} of {len(sections)} analyses reported; wrote {shown(index)}", highlight=False)
    console.print(f"[bold]verdict:[/] {shown(verdict.removeprefix('VERDICT: '))}", highlight=False)


def register(app: typer.Typer) -> None:
    def report(**options: Any) -> None:
        debug = options.pop("debug")

        def body():
            use_match_cache(options.pop("match_cache"))
            return run(options.pop("dump"), **options)

        run_cli(debug, body)

    report.__signature__ = signature(["dump", ("out", ReportOutOpt, REQUIRED), *SELECTION[1:],
                                      *(n for n in RECIPE if n != "out")])
    app.command("report",
                help="Run every analysis with its defaults and write one HTML page (index.html) with figures.")(report)
