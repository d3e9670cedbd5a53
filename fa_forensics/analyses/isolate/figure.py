"""Figures of `isolate`: Σδ error and O bias per repair, and the baseline's Σδ error per layer and head."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fa_forensics.analyses.style import (
    COLORS, colorbar, diverging_norm, index_ticks, legend_outside, new_figure, save_figure, styled,
)


@styled
def plot_variants(result, path: Path) -> Path:
    """Two bar panels: Σ_T(δ_var − δ_hp) ± se and O bias ± se for the baseline and each single repair."""
    names = [v.name for v in result.variants]
    y = np.arange(len(names))
    fig, (ax1, ax2) = new_figure(1, 2, width=10.0, height=max(3.8, 1.6 + 0.28 * len(names)), sharey=True)
    colors = [COLORS["lowp"] if n == "baseline" else (COLORS["fix"] if n in result.culprits else COLORS["alt"])
              for n in names]
    ax1.barh(y, [v.delta_err_sum for v in result.variants], xerr=[v.delta_err_se for v in result.variants],
             color=colors, capsize=3)
    ax1.set_yticks(y, names)
    ax1.invert_yaxis()
    ax1.axvline(0, color=COLORS["neutral"], lw=0.8)
    ax1.set_xlabel("Σ_T (δ_var − δ_hp)  (gradient units, summed over tokens)")
    ax1.set_title("δ error per variant (± 1 se)")
    ax2.barh(y, [v.o_bias for v in result.variants], xerr=[v.o_bias_se for v in result.variants], color=colors,
             capsize=3)
    ax2.axvline(0, color=COLORS["neutral"], lw=0.8)
    ax2.set_xlabel("mean (O_var − O_hp)  (output units)")
    ax2.set_title("O bias per variant (± 1 se)")
    from matplotlib.patches import Patch

    ax2.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    legend_outside(ax2, handles=[Patch(color=COLORS["lowp"], label=f"baseline\n({result.preset})"),
                                 Patch(color=COLORS["fix"], label="culprit: removes\nthe bias"),
                                 Patch(color=COLORS["alt"], label="other repair")])
    fig.suptitle(f"isolate: single repairs vs the fp32 replay ({result.accumulation} accumulation)")
    return save_figure(fig, path, variants_caption(result))


def variants_caption(result) -> str:
    """The isolation experiments of paper §3.2 (Claim 1), worded by what the baseline shows here."""
    c = result.claim
    lead = "The isolation experiments of paper §3.2 (Claim 1) as measurements on stored inputs: "
    if not c.found:
        return lead + "the baseline has no significant Σ(δ_lp − δ_hp) bias here, so no repair has one to remove."
    return lead + (f"which single repair removes the baseline's {'positive' if c.sign > 0 else 'negative'} "
                   "Σ(δ_lp − δ_hp) bias.")


@styled
def plot_heads(result, path: Path) -> Path:
    """Heat map layer x head of the baseline's Σ_T(δ_lp − δ_hp), summed over the selected steps."""
    layers = sorted({h.layer for h in result.heads})
    heads = sorted({h.head for h in result.heads})
    grid = np.zeros((len(layers), len(heads)))
    for h in result.heads:
        grid[layers.index(h.layer), heads.index(h.head)] += h.delta_err_sum
    fig, ax = new_figure(width=max(4.0, 0.45 * len(heads) + 2.5), height=min(max(2.5, 0.4 * len(layers) + 1.8), 9.0))
    im = ax.imshow(grid, cmap="RdBu_r", norm=diverging_norm(grid), aspect="auto")
    index_ticks(ax.xaxis, heads)
    index_ticks(ax.yaxis, layers)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.grid(False)
    colorbar(fig, im, ax, "Σ_T (δ_lp − δ_hp), summed over steps")
    ax.set_title(f"Where the δ error is: baseline {result.preset} vs fp32")
    return save_figure(fig, path, "Analogue of paper Fig. 3 / Fig. 11 (localizing the failing layer and head), "
                                  "measured as the δ error instead of the spectral norm.")


def draw(result, out: Path) -> list[Path]:
    """Every isolate figure into the folder `out`."""
    return [plot_variants(result, out / "isolate_variants.png"), plot_heads(result, out / "isolate_heads.png")]
