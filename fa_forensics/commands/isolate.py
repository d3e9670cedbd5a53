"""`fa-forensics isolate`: replay under single repairs to localize the failing operation (paper §3.2)."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import AnalysisArgs, progress_bar, register_analysis_command, show_result


def run(args: AnalysisArgs) -> None:
    from fa_forensics.analyses.isolate import compute as isolate
    from fa_forensics.analyses.fanout import n_items
    from fa_forensics.analyses.isolate.figure import draw
    from fa_forensics.analyses.isolate.table import tables

    dump, sels = args.open()
    with progress_bar("isolate", n_items(sels)) as advance:
        r = isolate.run(dump, sels, args.recipe, args.backend, progress=advance, workers=args.workers)
    show_result(args, r, isolate.payload(r), tables(r), draw)


def register(app: typer.Typer) -> None:
    register_analysis_command(app, "isolate", "Replay under single repairs to localize the failing operation (paper §3.2, Claim 1).", run)
