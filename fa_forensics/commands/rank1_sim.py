"""`fa-forensics rank1-sim`: similar rank-1 matrices behind the biased W_Q update (paper §3.3.1, Eq. 2-3, Fig. 4)."""
from __future__ import annotations

from typing import Annotated

import typer

from fa_forensics.commands.common import AnalysisArgs, progress_bar, register_analysis_command, show_result

TokensOpt = Annotated[int, typer.Option("--tokens", min=1, help="Tokens per step whose rank-1 matrices are compared (largest |δ error| first).")]


def run(args: AnalysisArgs, tokens: int) -> None:
    from fa_forensics.analyses.rank1_sim import compute as rank1_sim
    from fa_forensics.analyses.rank1_sim.figure import draw
    from fa_forensics.analyses.rank1_sim.table import tables

    from fa_forensics.analyses.fanout import n_items

    dump, sels = args.open()
    with progress_bar("rank1-sim", n_items(sels)) as advance:
        r = rank1_sim.run(dump, sels, args.recipe, args.backend, tokens_per_step=tokens, progress=advance, workers=args.workers)
    show_result(args, r, rank1_sim.payload(r), tables(r), draw)


def register(app: typer.Typer) -> None:
    register_analysis_command(app, "rank1-sim", "Similar rank-1 matrices (PK)[T]ᵀX[T] and the accumulation of the W_Q gradient error "
                              "(paper §3.3.1, Fig. 4).", run, extra=[("tokens", TokensOpt, 4)])
