"""`fa-forensics delta-bias`: the sign and origin of Σ_T(δ_lp − δ_hp) (paper §3.3.1-3.3.2, Fig. 5)."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import AnalysisArgs, progress_bar, register_analysis_command, show_result


def run(args: AnalysisArgs) -> None:
    from fa_forensics.analyses.delta_bias import compute as delta_bias
    from fa_forensics.analyses.fanout import n_items
    from fa_forensics.analyses.delta_bias.figure import draw
    from fa_forensics.analyses.delta_bias.table import tables

    dump, sels = args.open()
    with progress_bar("delta-bias", n_items(sels)) as advance:
        r = delta_bias.run(dump, sels, args.recipe, args.backend, progress=advance, workers=args.workers)
    show_result(args, r, delta_bias.payload(r), tables(r), draw)


def register(app: typer.Typer) -> None:
    register_analysis_command(app, "delta-bias", "Sign and origin of Σ_T(δ_lp − δ_hp): per step/layer/head, cumulative, per feature (paper §3.3, Fig. 5).", run)
