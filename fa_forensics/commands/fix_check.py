"""`fa-forensics fix-check`: does the stabilized softmax remove the bias (paper §4, App. C)? Exit 0 yes, 1 no."""
from __future__ import annotations

import math
from typing import Annotated

import typer

from fa_forensics.commands.common import AnalysisArgs, progress_bar, register_analysis_command, show_result
from fa_forensics.errors import UserError

BetaOpt = Annotated[float, typer.Option("--beta", help="β of the stabilized softmax (m = β·r_m for a repeated positive maximum; paper: 2 to 8).")]
EpsOpt = Annotated[float, typer.Option("--eps", help="ε: scores within ε of the row maximum count as repeated maxima.")]
OffsetOpt = Annotated[float, typer.Option("--offset", help="Offset of App. C's fixed-offset alternative: m = rowmax + offset.")]


def run(args: AnalysisArgs, beta: float, eps: float, offset: float) -> int:
    from fa_forensics.analyses.fix_check import compute as fix_check
    from fa_forensics.analyses.fix_check.figure import draw
    from fa_forensics.analyses.fix_check.table import tables

    if not beta > 1:
        raise UserError(f"--beta {beta} must be > 1 (the paper uses 2 to 8)")
    if not eps >= 0:
        raise UserError(f"--eps {eps} must be >= 0")
    if not (math.isfinite(offset) and offset > 0):
        raise UserError(f"--offset {offset} must be a finite number > 0 (the fixed shift m = rowmax + offset of App. C)")
    from fa_forensics.analyses.fanout import n_items

    dump, sels = args.open()
    with progress_bar("replaying variants", n_items(sels)) as advance:
        r = fix_check.run(dump, sels, args.recipe, args.backend, beta=beta, eps=eps, offset=offset, progress=advance,
                          workers=args.workers)
    show_result(args, r, fix_check.payload(r), tables(r), draw, verdict_style="bold green" if r.removed else "bold red")
    return r.exit_code


def register(app: typer.Typer) -> None:
    register_analysis_command(app, "fix-check", "Check that the stabilized softmax removes the bias and the alternatives do not "
                              "(paper §4, App. C). Exit code 0: removed; 1: not removed; 2: bad input.", run,
                              extra=[("beta", BetaOpt, 2.0), ("eps", EpsOpt, 1e-3), ("offset", OffsetOpt, 1.0)])
