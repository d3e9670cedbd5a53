"""Table of a fix-check result."""
from __future__ import annotations

import math

from rich.table import Table

from fa_forensics.analyses.fix_check.compute import FixCheckResult, collapse_text


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
    table = Table(title=f"fix-check of preset {r.preset} at layer {tg['layer']} head {tg['head']} feature "
                        f"{tg['feature']} (vs fp32 replay)")
    for c in ("variant", "what", "O bias ± se (sign p)", "Σδ error ± se (sign p)", "max |O − O_fp32|", "P̄=1",
              "fired rows", "underflow", "NaN", "still biased"):
        table.add_column(c, justify="right" if c not in ("variant", "what") else "left")
    for v in (r.baseline, r.fixed, *r.alternatives):
        table.add_row(v.name, v.what, _fmt(v.o_bias, v.o_bias_se, v.o_bias_p),
                      _fmt(v.delta_err_sum, v.delta_err_se, v.delta_p),
                      f"{v.max_abs_err:.2e}", str(v.p_one_count), str(v.triggered_rows), str(v.underflow),
                      str(v.nan_count), "yes" if v.still_biased else "no")
    return [table, p_bar_line(r), *collapse_lines(r)]


def p_bar_line(r: FixCheckResult) -> str:
    """Max P̄ over the rows whose maximum repeats (within ε), beside the rows where the fix fired."""
    eps = r.settings.get("eps")
    within = f" (within ε = {eps:g})" if eps is not None else ""
    fired = f"the fix fired in {r.triggered_rows} row(s)"
    if r.fixed.repeated_rows == 0 or not math.isfinite(r.max_p_bar):
        return (f"no row's maximum repeats over the whole row{within}, so there is no max P̄ to show; {fired}"
                + (" on a repeated maximum of one KV block" if r.triggered_rows else ""))
    return (f"max P̄ in the {r.fixed.repeated_rows} row(s) whose maximum repeats{within}: "
            f"baseline {r.baseline.max_p_bar:.6g}, fixed {r.max_p_bar:.6g}; {fired}")


def collapse_lines(r: FixCheckResult) -> list[str]:
    """One line when the fix's row sum falls below the preset's row-sum floor in some rows (nothing otherwise)."""
    c = r.collapse
    if not c.get("rows") or not c.get("applies"):
        return []  # without the preset's own floor it is a warning (the reference code would collapse there)
    return [f"[bold red]the fix collapses O[/] in {collapse_text(c)}"]


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    return f"fix-check: {d.get('verdict', 'n/a')}"
