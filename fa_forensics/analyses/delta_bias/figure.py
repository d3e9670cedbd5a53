"""Figures of `delta-bias`: paper Fig. 5a (cumulative Σδ error) and Fig. 5b/c (dO and O error per feature)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fa_forensics.analyses.style import COLORS, integer_ticks, legend_outside, new_figure, save_figure, styled


def total_title(result) -> str:
    """What the figure may claim: a one-signed δ error only where the statistics policy finds one; the number is the
    focus head's Σδ over its steps (the series drawn), as the table quotes it."""
    c, head = result.claim, result.focus_total
    where = f"layer {result.focus_layer} head {result.focus_head}"
    steps = f"{head.n_items} step{'s' if head.n_items != 1 else ''}"
    tested = f"{head.value:+.3g} ± {head.se:.2g} over {steps}"
    if c.found:
        return f"{'Positively' if c.sign > 0 else 'Negatively'}-biased δ error at {where}: {tested}"
    return f"No significant δ bias (most significant head: {where}, {tested})"


@styled
def plot_cumulative(result, path: Path) -> Path:
    """Fig. 5a: the focus head's cumulative Σ_T(δ_lp − δ_hp) across steps, per step ± se (or across tokens when the
    dump has one step)."""
    fig, ax = new_figure(width=8.4, height=3.6)
    items = result.focus_items
    if len(items) > 1:
        steps = [i.step for i in items]
        sums = [i.delta_err_sum for i in items]
        width = 0.8 * float(np.diff(np.sort(steps)).min())  # steps far apart keep visible bars
        ax.bar(steps, sums, width=width, color=COLORS["highp"], alpha=0.5,
               yerr=[i.delta_err_se for i in items], capsize=3, label="per step Σ_T (δ_lp − δ_hp) ± se")
        ax.plot(steps, np.cumsum(sums), "o-", color=COLORS["lowp"], label="cumulative over steps")
        ax.set_xlabel("training step")
        integer_ticks(ax.xaxis)
    else:
        ax.plot(np.arange(len(result.cumulative_tokens)), result.cumulative_tokens, color=COLORS["lowp"],
                label=f"cumulative over tokens (step {result.steps[0]}, batch 0)")
        ax.set_xlabel("token position T")
    ax.axhline(0, color=COLORS["neutral"], lw=0.8)
    ax.set_ylabel("cumulative Σ (δ_lp − δ_hp)\n(gradient units)")
    ax.set_title(f"{total_title(result)}\n{result.preset} vs fp32")
    legend_outside(ax)
    return save_figure(fig, path, "Paper Fig. 5(a)'s view: the cumulative sum of Σ_T(δ_lp − δ_hp)[T]; under a biased "
                                  "rounding it stays one-signed, without one it wanders around 0.")


@styled
def plot_top_token(result, path: Path) -> Path:
    """Fig. 5b/c: dO[T, :] and (O_lp − O_hp)[T, :] per feature at the token with the largest δ error."""
    tok = result.top_token
    fig, (ax1, ax2) = new_figure(2, 1, width=8.4, height=5.0, sharex=True)
    D = len(tok.do)
    top = {f.feature for f in result.top_features[:3]}
    colors = [COLORS["highlight"] if i in top else COLORS["highp"] for i in range(D)]
    ax1.bar(range(D), tok.do, color=colors)
    ax1.set_ylabel("dO[T, i]")
    ax1.set_title(f"(b) dO at token T={tok.token} (step {tok.step}, batch {tok.batch}, layer {result.focus_layer} head "
                  f"{result.focus_head})")
    ax2.bar(range(D), tok.o_err, color=colors)
    ax2.set_ylabel("(O_lp − O_hp)[T, i]")
    ax2.set_xlabel("feature i")
    ax2.set_title(f"(c) O error at the same token; (δ_lp − δ_hp)[T] = {tok.delta_err:+.3g}")
    from matplotlib.patches import Patch

    legend_outside(ax1, handles=[Patch(color=COLORS["highlight"], label=f"top features\n{sorted(top)}"),
                                 Patch(color=COLORS["highp"], label="other features")])
    for ax in (ax1, ax2):
        ax.axhline(0, color=COLORS["neutral"], lw=0.8)
    return save_figure(fig, path, top_token_caption(result))


def top_token_caption(result) -> str:
    """What the top-token panels show: the paper's mechanism where the Σδ bias is significant, else a view of noise."""
    c = result.claim
    if not c.found:
        return ("Paper Fig. 5(b)/(c)'s view at the token with the largest δ error of the most significant head; "
                "without a significant Σδ bias it shows rounding noise, not a mechanism.")
    how = "share their sign" if c.sign > 0 else "have opposite signs"
    return (f"Paper Fig. 5(b)/(c): where dO and the O error {how} in the features that carry the bias, their product "
            f"makes (δ_lp − δ_hp)[T] {'positive' if c.sign > 0 else 'negative'}.")


def draw(result, out: Path) -> list[Path]:
    """Every delta-bias figure into the folder `out` (the top-token panel only when there is one)."""
    paths = [plot_cumulative(result, out / "delta_bias_cumulative.png")]
    if result.top_token is not None:
        paths.append(plot_top_token(result, out / "delta_bias_top_token.png"))
    return paths
