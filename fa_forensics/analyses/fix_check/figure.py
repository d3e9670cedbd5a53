"""Figure of fix-check: the O bias and Σδ error of the baseline, the fix and the alternatives."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fa_forensics.analyses.wording import finite, number
from fa_forensics.analyses.style import COLORS, new_figure, save_figure, styled


@styled
def plot_fix_check(result, path: Path) -> Path:
    """Bar panels with ±2 se error bars: mean O error in the target cell, and Σ_T(δ − δ_hp) in its head when the
    dump has dO to measure it."""
    variants = [result.baseline, result.fixed, *result.alternatives]
    names = [v.name for v in variants]
    colors = [COLORS["lowp"], COLORS["fix"]] + [COLORS["alt"]] * len(result.alternatives)
    x = np.arange(len(variants))
    d = np.array([np.nan if v.delta_err_sum is None else v.delta_err_sum for v in variants])
    dse = np.array([np.nan if v.delta_err_se is None else v.delta_err_se for v in variants])
    has_delta = bool(np.isfinite(d).any())
    fig, axes = new_figure(1, 2 if has_delta else 1, width=10.0 if has_delta else 6.4, height=4.0, squeeze=False)
    ax_o = axes[0, 0]
    o = np.array([v.o_bias for v in variants])
    ose = np.array([v.o_bias_se for v in variants])
    ax_o.bar(x, o, yerr=2 * ose, color=colors, capsize=3)
    ax_o.axhline(0, color=COLORS["neutral"], lw=0.8)
    ax_o.set_xticks(x, names, rotation=20, ha="right", rotation_mode="anchor")
    tg = result.target
    ax_o.set_title(f"O bias, layer {tg['layer']} head {tg['head']} feature {tg['feature']} (bars: mean ± 2 se)")
    ax_o.set_xlabel("replay variant")
    ax_o.set_ylabel("mean (O − O_fp32) (value)")
    if has_delta:
        ax_d = axes[0, 1]
        ax_d.bar(x, np.nan_to_num(d), yerr=2 * np.nan_to_num(dse), color=colors, capsize=3)
        ax_d.axhline(0, color=COLORS["neutral"], lw=0.8)
        ax_d.set_xticks(x, names, rotation=20, ha="right", rotation_mode="anchor")
        ax_d.set_title(f"Σ_T (δ − δ_fp32), head {tg['head']} (bars: sum ± 2 se)")
        ax_d.set_xlabel("replay variant")
        ax_d.set_ylabel("Σ_T (δ − δ_hp) (value)")
    fig.suptitle(suptitle(result))
    return save_figure(fig, path, "Paper §4 / App. C: the stabilized softmax (Algorithm 3) against the baseline and "
                                  "the alternatives (fixed offset, stochastic rounding, fp32 P̄V); cf. Fig. 5(a) for "
                                  "Σδ" + ("." if has_delta else " (not drawn: the dump has no dO)."))


def suptitle(result) -> str:
    """The verdict in figure words: reduction (or what failed) and max P̄ where a maximum repeats."""
    c = result.collapse or {}
    if c.get("rows") and c.get("applies"):
        limit = number(c.get("threshold"), ".4g")
        head = f"fix-check: the fix collapses O in {c['rows']} row(s) (repeated maximum > {limit})"
    elif result.nan_count:
        head = f"fix-check: the fix produced {result.nan_count} NaN"
    elif finite(result.bias_reduction):
        head = f"fix-check: bias reduction {result.bias_reduction:.1f}x"
    else:
        head = "fix-check: the fixed bias is exactly 0"
    if finite(result.max_p_bar):
        return f"{head}, max P̄ in repeated-max rows {result.max_p_bar:.4g}"
    return f"{head}; no row with a repeated maximum"


def draw(result, out: Path) -> list[Path]:
    """The fix-check figure into the folder `out`."""
    return [plot_fix_check(result, out / "fix_check.png")]
