"""Table of a fix-check result."""
from __future__ import annotations

import math

from rich.table import Table

from fa_forensics.analyses.fix_check import FixCheckResult


def _fmt(v, se=None, p=None) -> str:
    if v is None:
        return "—"
    s = f"{v:+.3e}"
    if se is not None and math.isfinite(se):
        s += f" ± {se:.1e}"
    if p is not None:
        s += f" (p={p:.2g})"
    return s


def tables(r: FixCheckResult) -> list:
    """Every variant in the target cell, then one line on max P̄ and the rows where the fix fired."""
    tg = r.target
    table = Table(title=f"fix-check of preset {r.preset} at layer {tg['layer']} head {tg['head']} feature {tg['feature']} (vs fp32 replay)")
    for c in ("variant", "what", "O bias ± se (sign p)", "Σδ error ± se (sign p)", "max |O − O_fp32|", "P̄=1", "fired rows", "underflow", "NaN", "still biased"):
        table.add_column(c, justify="right" if c not in ("variant", "what") else "left")
    for v in (r.baseline, r.fixed, *r.alternatives):
        table.add_row(v.name, v.what, _fmt(v.o_bias, v.o_bias_se, v.o_bias_p), _fmt(v.delta_err_sum, v.delta_err_se, v.delta_p),
                      f"{v.max_abs_err:.2e}", str(v.p_one_count), str(v.triggered_rows), str(v.underflow), str(v.nan_count),
                      "yes" if v.still_biased else "no")
    return [table, f"max P̄ in rows with a repeated maximum: baseline {r.baseline.max_p_bar:.6g}, fixed {r.max_p_bar:.6g}; "
                   f"rows where the fix fired: {r.triggered_rows}"]
