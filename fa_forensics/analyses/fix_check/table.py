"""Table of a fix-check result."""
from __future__ import annotations

import math

from rich.table import Table

from fa_forensics.analyses.fix_check.compute import FixCheckResult, collapse_text, reverses
from fa_forensics.analyses.wording import number, p_value, percent, place, pm, text, yes_no


def _estimate_text(v, se=None, p=None) -> str:
    """An estimate with its standard error and p-value, as the table shows it."""
    if v is None:
        return "—"
    s = f"{v:+.3e}"
    if se is not None and math.isfinite(se):
        s += f" ± {se:.1e}"
    if p is not None:
        s += f" (p={p:.2g})"
    return s


def _count(n) -> str:
    return "—" if n is None else str(n)


def _still(v, baseline) -> str:
    """The 'still biased' cell: yes, 'yes, reversed' (a significant bias of the opposite sign), no, — (baseline)."""
    if v.role == "baseline":
        return "—"
    return ("yes, reversed" if reverses(v, baseline) else "yes") if v.still_biased else "no"


def tables(r: FixCheckResult) -> list:
    """Every variant in the target cell, then one line on max P̄ and the rows where the fix fired."""
    tg = r.target
    table = Table(title=f"fix-check of preset {r.preset} at layer {tg['layer']} head {tg['head']} feature "
                        f"{tg['feature']}, {r.claim.subset if r.claim else 'all rows'} (vs fp32 replay; Holm p over "
                        f"one family, the baseline's tests and the {1 + len(r.alternatives)} variants': "
                        f"{r.family.describe()}; a variant is still biased only where the baseline has a bias)")
    for c in ("variant", "what", "O bias ± se (t-test p)", "Holm p", "bias removed",
              f"Σδ error, head {tg['head']} ± se (t p)", "max |O − O_fp32|", "P̄=1", "fired rows", "underflow", "NaN",
              "still biased"):
        table.add_column(c, justify="right" if c not in ("variant", "what") else "left")
    for v in (r.baseline, r.fixed, *r.alternatives):
        removed = "—" if v.role == "baseline" else (f"{v.removed_share:.0%}" if math.isfinite(v.removed_share)
                                                    else "n/a")
        table.add_row(v.name + (" (the fix)" if v is r.fixed else ""), v.what,
                      _estimate_text(v.o_bias, v.o_bias_se, v.o_bias_p), number(v.o_bias_adjusted_p, ".2g"), removed,
                      _estimate_text(v.delta_err_sum, v.delta_err_se, v.delta_p),
                      f"{v.max_abs_err:.2e}", _count(v.p_one_count), _count(v.triggered_rows), _count(v.underflow),
                      str(v.nan_count), _still(v, r.baseline))
    table.caption = ("bias removed: 1 − |O bias| / |baseline's O bias|; a fix removes the bias when ≥ 90 % of it is "
                     "gone, or ≥ 50 % with nothing significant left; — : not counted by stable_attention's kernels")
    return [table, p_bar_line(r), *collapse_lines(r)]


def p_bar_line(r: FixCheckResult) -> str:
    """Max P̄ over the rows whose maximum repeats (within ε), beside the rows where the fix fired."""
    eps = r.settings.get("eps")
    within = f" (within ε = {eps:g})" if eps is not None else ""
    fired = (f"the fix fired in {r.triggered_rows} row(s)" if r.triggered_rows is not None
             else "stable_attention's kernels do not count the rows where the fix fired")
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


def key_numbers(d: dict) -> list[tuple[str, str]]:
    """Labelled numbers of the payload for the report (units in the labels; keys read defensively)."""
    tg = d.get("target") if isinstance(d.get("target"), dict) else {}
    b = d.get("baseline") if isinstance(d.get("baseline"), dict) else {}
    f = d.get("fixed") if isinstance(d.get("fixed"), dict) else {}
    dep = d.get("deployment") if isinstance(d.get("deployment"), dict) else {}
    removed = percent(f.get("removed_share")) if d.get("has_bias") else "n/a (no bias to remove)"
    return [
        ("cell checked", place(tg, "layer", "head", "feature")),
        ("baseline O bias ± se (output units)", pm(b.get("o_bias"), b.get("o_bias_se"), "+.3e", ".1e")),
        ("baseline p / Holm p", f"{p_value(b.get('o_bias_p'))} / {p_value(b.get('o_bias_adjusted_p'))}"),
        ("a bias to remove", yes_no(d.get("has_bias"))),
        (f"O bias under the fix ({text(f.get('name'))}) ± se", pm(f.get("o_bias"), f.get("o_bias_se"), "+.3e", ".1e")),
        ("share of the bias the fix removes", removed),
        ("stable_attention as deployed removes", percent(dep.get("removed_share")) if dep and d.get("has_bias")
         else "n/a"),
        ("its kernels without the fix remove", percent(dep.get("control_removed_share")) if dep and d.get("has_bias")
         else "n/a"),
        ("β, ε of the fix", f"{number(d.get('beta'), 'g')}, {number(d.get('eps'), 'g')}"),
    ]
