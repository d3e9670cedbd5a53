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
    build_backend, build_recipe, build_workers, console, err_console, open_rank, parse_ranks, run_cli, use_match_cache,
    write_json,
)
from fa_forensics.commands.options import ALL_RANKS, RECIPE, REQUIRED, RanksOpt, shared, signature
from fa_forensics.dump.schema import rank_key
from fa_forensics.dump.terminal_text import shown
from fa_forensics.enums import AccumulationOrAuto, Backend
from fa_forensics.layers.cluster_wait import WORKER_WAIT_SECONDS
from fa_forensics.errors import UserError

ReportOutOpt = Annotated[Path, typer.Option(  # no default: required, and --help says so
    "--out", help="Directory for index.html, and beside it one folder of figures and JSON per analysis.",
    metavar="DIR", show_default=False)]


def run(dump_path: Path, out: Path, step, layer, head, preset: str, accumulation: AccumulationOrAuto | str,
        backend: Backend | str,
        json_path, workers: int = 1, scheduler: Optional[str] = None, rank: Optional[str] = None,
        worker_wait: float = WORKER_WAIT_SECONDS) -> None:
    from fa_forensics.dump import open_dump
    from fa_forensics.layers.fanout import connected
    from fa_forensics.report.output import staged_report
    from fa_forensics.report.ranks import write_ranks_index

    recipe, backend_ = build_recipe(preset, accumulation), build_backend(backend)
    accumulation = getattr(accumulation, "value", accumulation)
    fan_out = build_workers(workers, scheduler, worker_wait)
    asked = parse_ranks(rank)
    if asked != ALL_RANKS:
        # fail early, with the dump store's one-line error, on a bad DUMP
        dump = open_rank(dump_path, asked, "--rank R reports another, --rank all every rank")
        payload = _report_rank(dump, dump_path, Path(out), step, layer, head, preset, accumulation, recipe,
                               backend_, fan_out)
        write_json(json_path, payload)
        return
    store = open_dump(dump_path)
    store.layers()  # a dump that cannot be read: its one line, before any analysis runs
    t0 = time.perf_counter()
    # OUT is one report (built aside, published whole) holding a report per rank in rank_<r>/ and their index
    with contextlib.ExitStack() as stack, staged_report(out, [rank_key(r) for r in store.ranks]) as staged:
        if not fan_out.in_process:
            stack.enter_context(connected(fan_out))  # one cluster for every rank
        payloads = [_report_rank(open_dump(store.path, rank=r), dump_path, staged / rank_key(r), step, layer,
                                 head, preset, accumulation, recipe, backend_, fan_out, several=True,
                                 published_as=Path(out) / rank_key(r))
                    for r in store.ranks]
        write_ranks_index(staged, str(dump_path), payloads)
    index = Path(out) / "index.html"
    warnings = list(dict.fromkeys(w for p in payloads for w in p["warnings"]))
    write_json(json_path, {"index": str(index), "seconds": time.perf_counter() - t0, "preset": preset,
                           "verdict": "; ".join(p["verdict"] for p in payloads), "rank": ALL_RANKS,
                           "ranks": store.ranks, "per_rank": payloads, "warnings": warnings})
    console.print(f"wrote {shown(index)} (one report per rank)", highlight=False)


def _report_rank(dump, dump_path: Path, out: Path, step, layer, head, preset: str, accumulation: str, recipe,
                 backend_: Backend, fan_out, several: Optional[bool] = None, published_as: Optional[Path] = None
                 ) -> dict:
    """Every analysis on one rank's tree into `out` (to be found at `published_as`, default `out`): the page, the
    table, the verdict line; returns the JSON payload. A rank r > 0 is named by the path that opens it
    (`run.zarr/rank_r`) in the page and its commands."""
    from fa_forensics.report.html import findings, write_report
    from fa_forensics.report.output import staged_report
    from fa_forensics.analyses.jsonable import to_jsonable
    from fa_forensics.report.run import ANALYSES, EXIT_CODES, check_selection, exit_meaning, run_all, sections_of
    from fa_forensics.report.verdict import build_verdict

    several = len(dump.ranks) > 1 or dump.world_size > 1 if several is None else several
    final = Path(published_as or out)
    who = f"rank {dump.rank}: " if several else ""
    label = Path(dump.path) / rank_key(dump.rank) if dump.rank != 0 else Path(dump_path)
    if dump.steps or dump.timeline is None or (step, layer, head) != (None, None, None):
        check_selection(dump, step, layer, head)  # a step, layer or head the dump lacks: one line, before any analysis
    t0 = time.perf_counter()
    done = []
    total = len(sections_of(dump))  # the analyses that run on this dump
    log = ProgressLines(f"{who}report".strip(), total, interval=progress_interval())

    def on_start(name: str) -> None:
        if done:
            log.advance(done[-1])
        done.append(name)
        log.now(name)
        if err_console.is_terminal:  # a line per analysis for a person; a log gets `log`'s lines every few seconds
            err_console.print(f"{who}[{len(done)}/{total}] {name} …", highlight=False)

    with staged_report(out, ANALYSES) as staged:  # built aside, moved into --out only when complete
        with log if not err_console.is_terminal else contextlib.nullcontext():
            sections = run_all(dump, label, staged, step=step, layer=layer, head=head, recipe=recipe,
                               backend=backend_, on_start=on_start, workers=fan_out, published_as=final)
        seconds = time.perf_counter() - t0
        info = {"steps": len(dump.steps), "layers": len(dump.layers()), "preset": preset,
                "accumulation": accumulation, "backend": backend_.value}
        if several:
            info["rank"] = f"{dump.rank} of the store's ranks {', '.join(map(str, dump.ranks))}"
        write_report(staged, str(label), sections, info=info, seconds=seconds)
    index = final / "index.html"

    table = Table(title=f"{who}report: {shown(str(label))}")
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
    warnings = list(dict.fromkeys(who + w for s in sections for w in ((s.data or {}).get("warnings") or [])))
    payload = {
        "index": str(index), "seconds": seconds, "preset": preset, "verdict": who + verdict,
        "summary": to_jsonable(summary), "findings": findings(sections), "warnings": warnings, "rank": dump.rank,
        "ranks": dump.ranks,
        "sections": [{"name": s.name, "exit_code": s.exit_code, "ok": s.ok, "note": s.note, "figures": s.figures,
                      "seconds": s.seconds, "json": s.data} for s in sections],
    }
    ok = sum(s.ok for s in sections)
    if not ok:
        first = sections[0]
        raise UserError(f"no analysis of {label} could run ({first.name}: {' '.join(first.note.split())[:200]}); "
                        f"run `fa-forensics verify {label}` and fix the first problem")
    console.print(f"{who}{ok} of {len(sections)} analyses reported; wrote {shown(index)}", highlight=False)
    console.print(f"[bold]verdict:[/] {shown(who + verdict.removeprefix('VERDICT: '))}", highlight=False)
    return payload


def register(app: typer.Typer) -> None:
    def report(**options: Any) -> None:
        debug = options.pop("debug")

        def body():
            use_match_cache(options.pop("match_cache"))
            return run(options.pop("dump"), **options)

        run_cli(debug, body)

    report.__signature__ = signature(["dump", ("out", ReportOutOpt, REQUIRED), "step", "layer", "head",
                                      shared("rank", RanksOpt), *(n for n in RECIPE if n != "out")])
    app.command("report",
                help="Run every analysis with its defaults and write one HTML page (index.html) with figures.")(report)
