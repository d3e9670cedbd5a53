"""Tables of a timeline result."""
from __future__ import annotations

import numpy as np
from rich.table import Table

from fa_forensics.analyses.timeline.compute import TimelineResult


def tables(result: TimelineResult, where: str) -> list[Table]:
    """Per layer and head: the last step's max logit, repeated-max rows and extra P̄ = 1, and ‖W_Q‖₂ first → last."""
    table = Table(title=f"timeline of {where}: {len(result.steps)} monitored steps "
                        f"({int(result.steps[0])}..{int(result.steps[-1])}), "
                        f"{result.n_layers} layers × {result.n_heads} heads")
    for col in ("layer", "head", "max logit (last)", "repeated-max rows (last)", "extra P̄=1 (last)",
                "‖W_Q‖₂ first → last"):
        table.add_column(col, justify="right")
    s = result.series
    for layer in range(result.n_layers):
        for head in range(result.n_heads):
            def last(m):
                return f"{s[m][-1, layer, head]:.4g}" if m in s and np.isfinite(s[m][-1, layer, head]) else "–"  # noqa: B023 - called in this iteration
            wq = s.get("wq_sigma")
            wq_txt = (f"{wq[0, layer, head]:.3f} → {wq[-1, layer, head]:.3f}"
                      if wq is not None and np.isfinite(wq[-1, layer, head]) else "–")
            table.add_row(str(layer), str(head), last("max_logit"), last("near_max_ties"), last("p_one_extra"), wq_txt)
    return [table]
