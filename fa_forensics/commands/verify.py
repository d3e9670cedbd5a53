"""`fa-forensics verify`: check a dump's integrity (every step complete, every chunk present and decoding)."""
from __future__ import annotations

import warnings

import typer
from rich.markup import escape
from rich.table import Table

from fa_forensics.commands.common import (
    ALL_RANKS, DebugOpt, DumpArg, JsonOpt, RanksOpt, add_warning, console, err_console, exit_code, parse_ranks,
    ranks_line, run_cli, write_json,
)


def verify(dump: DumpArg, json_out: JsonOpt = None, rank: RanksOpt = None, debug: DebugOpt = False) -> None:
    """Check a dump: complete steps, every chunk present and decoding (zstd checksums), dtype attributes, links leaving
    the store; list what killed writers left beside it. Exit 0 whole, 1 damage or incomplete steps, 2 not a dump."""

    def body() -> int:
        from fa_forensics.dump import open_dump
        from fa_forensics.dump.verify import verify as verify_store

        asked = parse_ranks(rank)
        first = verify_store(dump, rank=None if asked == ALL_RANKS else asked)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its steps are in the report
            store = open_dump(first.path, rank=first.rank)
        several = len(store.ranks) > 1 or store.world_size > 1
        if asked == ALL_RANKS:
            reports = [first if r == first.rank else verify_store(first.path, rank=r) for r in store.ranks]
        else:
            line = ranks_line(store, "--rank all checks every rank")
            if line:
                add_warning(line)
            reports = [first]
        codes = [_show(report, several) for report in reports]
        if asked == ALL_RANKS:
            write_json(json_out, {"path": first.path, "rank": ALL_RANKS, "ranks": store.ranks,
                                  "ok": all(r.ok for r in reports), "per_rank": [r.to_dict() for r in reports]})
        else:
            write_json(json_out, {**first.to_dict(), "ranks": store.ranks})
        return max(codes)

    code = run_cli(debug, body)
    if code:
        exit_code(code)


def _show(report, several: bool) -> int:
    """Print what `verify` found in one rank's tree (naming the rank when the store holds several); its exit code."""
    where = f"{report.path} rank {report.rank}" if several else report.path
    if report.problems:
        table = Table(title=f"damage in {escape(where)}", title_justify="left")
        for col in ("step", "layer", "array", "problem"):
            table.add_column(col)
        for d in report.problems:
            cells = ("-" if v is None else escape(str(v)) for v in (d.step, d.layer, d.array))
            table.add_row(*cells, escape(d.what))
        console.print(table)
    if report.leftovers:
        title = f"left beside {escape(report.path)} by writers that are not running"
        table = Table(title=title, title_justify="left")
        table.add_column("path")
        table.add_column("what")
        for x in report.leftovers:
            table.add_row(escape(x.path), escape(x.what))
        console.print(table)
    console.print(f"{escape(where)}: {len(report.steps)} whole step(s), {report.arrays_checked} arrays and "
                  f"{report.chunks_checked} chunks checked", highlight=False, soft_wrap=True)
    if report.ok:
        return _empty_code(report)
    parts = []
    if report.damaged_steps:
        parts.append(f"{len(report.problems)} problem(s) in step(s) {report.damaged_steps}")
    elif report.problems:
        parts.append(f"{len(report.problems)} problem(s)")
    if report.incomplete_steps:
        parts.append(f"step(s) {report.incomplete_steps} incomplete (cut off while writing)")
    what = escape(f"{where}: {'; '.join(parts)}")
    err_console.print(f"[bold red]damaged:[/] {what}; re-capture those steps "
                      "(the other steps read whole)", highlight=False, soft_wrap=True)
    return 1


def _empty_code(report) -> int:
    """1 (with the line that says so) for a whole but empty dump, else 0."""
    if report.steps or report.incomplete_steps:
        return 0
    from fa_forensics.commands.info import empty_dump_code
    from fa_forensics.dump import open_dump

    return empty_dump_code(open_dump(report.path, rank=report.rank))


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
