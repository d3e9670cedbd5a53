"""Figures of `isolate`: Σδ error and O bias per repair, and the baseline's Σδ error per layer and head."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fa_forensics.analyses.style import COLORS, new_figure, save_figure


def plot_variants(result, path: Path) -> Path:
    """Two bar panels: Σ_T(δ_var − δ_hp) ± se and O bias ± se for the baseline and each single repair."""
    names = [v.name for v in result.variants]
    y = np.arange(len(names))
    fig, (ax1, ax2) = new_figure(1, 2, width=9.0, height=3.8, sharey=True)
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
    ax1.legend(handles=[Patch(color=COLORS["lowp"], label=f"baseline ({result.preset})"),
                        Patch(color=COLORS["fix"], label="culprit: removes ≥ 90% of the bias"),
                        Patch(color=COLORS["alt"], label="other repair")], loc="center right")
    fig.suptitle(f"isolate: single repairs vs the fp32 replay ({result.accumulation} accumulation)")
    return save_figure(fig, path,
                       "Reproduces the isolation experiments of paper §3.2 (Claim 1) as measurements on stored "
                                  "inputs: which single repair removes the positive Σ(δ_lp − δ_hp).")


def plot_heads(result, path: Path) -> Path:
    """Heat map layer x head of the baseline's Σ_T(δ_lp − δ_hp), summed over the selected steps."""
    layers = sorted({h.layer for h in result.heads})
    heads = sorted({h.head for h in result.heads})
    grid = np.zeros((len(layers), len(heads)))
    for h in result.heads:
        grid[layers.index(h.layer), heads.index(h.head)] += h.delta_err_sum
    lim = float(np.abs(grid).max()) or 1.0
    fig, ax = new_figure(width=max(4.0, 0.45 * len(heads) + 2.5), height=max(2.5, 0.4 * len(layers) + 1.8))
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(len(heads)), heads)
    ax.set_yticks(range(len(layers)), layers)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="Σ_T (δ_lp − δ_hp), summed over steps")
    ax.set_title(f"Where the δ error is: baseline {result.preset} vs fp32")
    return save_figure(fig, path, "Analogue of paper Fig. 3 / Fig. 11 (localizing the failing layer and head), "
                                  "measured as the δ error instead of the spectral norm.")


def draw(result, out: Path) -> list[Path]:
    """Every isolate figure into the folder `out`."""
    return [plot_variants(result, out / "isolate_variants.png"), plot_heads(result, out / "isolate_heads.png")]
