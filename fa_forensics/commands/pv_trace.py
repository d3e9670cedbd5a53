"""`fa-forensics pv-trace`: trace the error of one P̄V dot product down to the bits (paper Fig. 6)."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from fa_forensics.commands.common import AnalysisArgs, progress_bar, register_analysis_command, show_result
from fa_forensics.errors import InvalidSetting, OutOfRange, UserError

RowOpt = Annotated[Optional[int], typer.Option("--row", help="Query row T to trace (default: the row with the largest error in the chosen feature).")]
FeatureOpt = Annotated[Optional[int], typer.Option("--feature", help="Feature i of V / O to trace (default: the feature with the largest mean O bias).")]


def run(args: AnalysisArgs, row: Optional[int], feature: Optional[int]) -> None:
    from fa_forensics.analyses.pv_trace import compute as pv_trace
    from fa_forensics.analyses.pv_trace.figure import draw
    from fa_forensics.analyses.pv_trace.table import tables

    dump, sels = args.open()
    try:
        with progress_bar(f"replaying ({args.recipe.label} vs fp32)", len(sels)) as advance:
            r = pv_trace.run(dump, sels, args.recipe, args.backend, row=row, feature=feature, progress=advance,
                             workers=args.workers)
    except OutOfRange as exc:
        raise UserError(f"--{exc.what} {exc.value} is out of range at {exc.where}: {exc.what}s are 0..{exc.limit}") from None
    except InvalidSetting as exc:
        raise UserError(f"{exc.reason}; use --preset fp8-s1, or `fa-forensics pcast` for the scale study") from None
    show_result(args, r, pv_trace.payload(r), tables(r), draw)


def register(app: typer.Typer) -> None:
    register_analysis_command(app, "pv-trace", "Trace the error of one P̄V dot product down to the bits (paper Eq. 4-5, Fig. 6).", run,
                              extra=[("row", RowOpt, None), ("feature", FeatureOpt, None)])
