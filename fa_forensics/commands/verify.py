"""`fa-forensics verify`: check a dump's integrity (every step complete, every chunk present and decoding)."""
from __future__ import annotations

import warnings

import typer
from rich.table import Table

from fa_forensics.commands.common import (
    add_warning, console, err_console, exit_code, parse_ranks, ranks_line, run_cli, write_json,
)
from fa_forensics.commands.options import ALL_RANKS, DebugOpt, DumpArg, JsonOpt, RanksOpt
from fa_forensics.dump.terminal_text import shown


def verify(dump: DumpArg, rank: RanksOpt = None, json_out: JsonOpt = None, debug: DebugOpt = False) -> None:
    """Check a dump: complete steps, every chunk present and decoding (zstd checksums), dtype attributes, links leaving
    the store; list what killed writers left beside it. Exit 0 whole, 1 damage or incomplete steps, 2 not a dump."""

    def body() -> int:
        from fa_forensics.dump import open_dump
        from fa_forensics.dump.verify import verify as verify_store

        asked = parse_ranks(rank)
        first = _with_stored_match(verify_store(dump, rank=None if asked == ALL_RANKS else asked))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its steps are in the report
            store = open_dump(first.path, rank=first.rank)
        several = len(store.ranks) > 1 or store.world_size > 1
        if asked == ALL_RANKS:
            reports = [first if r == first.rank else _with_stored_match(verify_store(first.path, rank=r))
                       for r in store.ranks]
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
        table = Table(title=f"damage in {shown(where)}", title_justify="left")
        for col in ("step", "layer", "array", "file", "problem"):
            table.add_column(col)
        for d in report.problems:
            cells = ("-" if v is None else shown(str(v)) for v in (d.step, d.layer, d.array, d.file))
            table.add_row(*cells, shown(d.what))
        console.print(table)
    if report.leftovers:
        title = f"left beside {shown(report.path)} by writers that are not running"
        table = Table(title=title, title_justify="left")
        table.add_column("path")
        table.add_column("what")
        for x in report.leftovers:
            table.add_row(shown(x.path), shown(x.what))
        console.print(table)
    console.print(f"{shown(where)}: {len(report.steps)} whole step(s), {report.arrays_checked} arrays and "
                  f"{report.chunks_checked} chunks checked", highlight=False, soft_wrap=True)
    _show_drops(report)
    if report.ok:
        return _empty_code(report)
    in_steps = [d for d in report.problems if d.step is not None]
    parts, redo = [], []
    if in_steps:
        steps = sorted({d.step for d in in_steps})
        parts.append(f"{_count(len(in_steps), 'problem')} in {_steps(steps)}")
        redo.append("those steps")
    outside = [d for d in report.problems if d.step is None]
    timeline = [d for d in outside if (d.array or "").startswith("timeline")]
    if timeline:
        parts.append(f"{_count(len(timeline), 'problem')} in the timeline")
        redo.append("the timeline")
    if len(outside) > len(timeline):
        where_else = sorted({d.file or "the store's folder" for d in outside if d not in timeline})
        parts.append(f"{_count(len(outside) - len(timeline), 'problem')} in {', '.join(where_else[:3])}"
                     + (", ..." if len(where_else) > 3 else ""))
        redo.append("the run")
    if report.incomplete_steps:
        parts.append(f"{_steps(report.incomplete_steps)} incomplete (cut off while writing)")
        if not in_steps:
            redo.insert(0, "those steps")
    what = shown(f"{where}: {'; '.join(parts)}")
    whole = " (the other steps read whole)" if report.steps else ""
    err_console.print(f"[bold red]damaged:[/] {what}; re-capture {' and '.join(redo)}{whole}",
                      highlight=False, soft_wrap=True)
    return 1


def _count(n: int, noun: str) -> str:
    """'1 problem', '3 problems'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _steps(steps) -> str:
    """'step 4', 'steps 0, 2 and 7'."""
    steps = [str(s) for s in steps]
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {', '.join(steps[:-1])} and {steps[-1]}"


def _show_drops(report) -> None:
    """Steps an alarm announced that the capture dropped (written in the store, not damage): one line."""
    from fa_forensics.dump import open_dump
    from fa_forensics.monitor.drops import dropped_steps, dropped_text

    try:
        drops = dropped_steps(open_dump(report.path, rank=report.rank).attrs)
    except Exception:  # an unreadable store is reported above
        return
    if drops:
        console.print(f"[yellow]not in the store, dropped by the capture after alarms:[/] "
                      f"{shown(dropped_text(drops))}", highlight=False, soft_wrap=True)


def _with_stored_match(report):
    """The report with every `replay_match` attribute the stored bits contradict (or that is malformed) as a problem."""
    import dataclasses

    from fa_forensics.dump import open_dump
    from fa_forensics.fidelity.match_cache import in_dump_attrs

    dump = open_dump(report.path, rank=report.rank)
    if not any(in_dump_attrs(dump, step, layer) for step in report.steps for layer in dump.layers(step)):
        return report  # no match kept: nothing to replay (and the replay's libraries are not imported)
    from fa_forensics.fidelity.stored_match import check_stored_match

    found = check_stored_match(dump, report.steps)
    return dataclasses.replace(report, problems=[*report.problems, *found]) if found else report


def _empty_code(report) -> int:
    """1 (with the line that says so) for a whole but empty dump, else 0."""
    if report.steps or report.incomplete_steps:
        return 0
    from fa_forensics.commands.info import empty_dump_code
    from fa_forensics.dump import open_dump

    return empty_dump_code(open_dump(report.path, rank=report.rank))


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
