"""Tables of the pcast study on a dump (the simulation's tables stay with its command)."""
from __future__ import annotations

from rich.table import Table

from fa_forensics.analyses.pcast import PcastDumpResult


def tables(res: PcastDumpResult) -> list:
    """Per head: sink strength, zeroed share and MSE ratio per (order, S), the recommendation."""
    t = Table(title=f"P-cast per head of {res.path} (k = {res.n_sinks} sink keys, B = {res.block}); "
                    f"cells: non-sink P̄ zeroed, MSE / best MSE")
    for c in ("step", "L", "H", "sink Δ̂"):
        t.add_column(c, justify="right")
    for order in res.orders:
        for S in res.scales:
            t.add_column(f"{'fwd' if order == 'forward' else 'rev'} {S:g}", justify="right")
    t.add_column("needs")
    for h in res.heads:
        best = min(s.mse for s in h.settings)
        cells = [f"{s.frac_zeroed:.0%} ×{s.mse / best:.2f}" for order in res.orders for S in res.scales
                 for s in [h.setting(S, order)]]
        t.add_row(str(h.step), str(h.layer), str(h.head), f"{h.sink_strength:.1f}±{h.sink_gap_se:.1f}", *cells,
                  f"{h.recommended_order.value} S={h.recommended_S:g}" if h.needs_fix else "-")
    return [t, *(f"  step {h.step} layer {h.layer} head {h.head}: {h.recommendation}" for h in res.heads)]
