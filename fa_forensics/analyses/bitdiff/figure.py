"""Figures of bitdiff's tensor mode: the ULP-distance histogram and the per-feature bias map."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from fa_forensics.analyses.wording import percent
from fa_forensics.analyses.style import (
    COLORS, colorbar, diverging_norm, index_ticks, integer_ticks, new_figure, save_figure, styled,
)


@styled
def plot_bitdiff(result, out: Path) -> list[Path]:
    """ULP histogram and bias map (mean signed error per (layer, head) × feature, significant cells outlined)."""
    from fa_forensics.analyses.bitdiff.compute import bias_map

    out = Path(out)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{result.a}_vs_{result.b}").strip("_")  # "auto (bf16)" -> "auto_bf16"
    paths = []

    fig, ax = new_figure(width=6.4, height=3.6)
    counts = np.array(result.ulp_hist["counts"])
    ax.bar(np.arange(len(counts)), counts, color=COLORS["lowp"])
    ax.set_xticks(np.arange(len(counts)), result.ulp_hist["bins"], rotation=60, fontsize=7)
    ax.set_yscale("symlog")
    ax.set_xlabel(f"signed ULP distance of {result.a} − {result.b} ({result.fmt} ulps)")
    ax.set_ylabel("elements (count)")
    ax.set_title(f"bitdiff {result.a} vs {result.b}: {percent(result.mismatch_rate, 1)} of elements differ")
    paths.append(save_figure(fig, out / f"bitdiff_ulp_{name}.png",
                             "ULP-distance histogram of O, the bit-level view behind paper Fig. 5(c) / Fig. 6."))

    rows, mean, significant = bias_map(result)
    m = mean.numpy()
    fig, ax = new_figure(width=9.0, height=min(1.6 + 0.28 * len(rows), 9.0))
    im = ax.imshow(m, aspect="auto", cmap="RdBu_r", norm=diverging_norm(m), interpolation="nearest")
    sig = significant.numpy()
    ys, xs = np.nonzero(sig)
    # a black outline on a white one: visible on a dark cell of either sign and on a pale one
    ax.scatter(xs, ys, marker="s", s=40, facecolors="none", edgecolors="white", linewidths=2.6)
    ax.scatter(xs, ys, marker="s", s=40, facecolors="none", edgecolors="black", linewidths=1.1,
               label="significant (Holm, effect floor)")
    index_ticks(ax.yaxis, [f"L{l} H{h}" for l, h in rows])
    integer_ticks(ax.xaxis)
    ax.set_xlabel("feature i (head dimension)")
    ax.set_ylabel("layer, head")
    ax.set_title(f"bias map: mean (O_{result.a} − O_{result.b}) per feature")
    ax.grid(False)
    colorbar(fig, im, ax, "mean signed error (value)")
    if len(xs):
        fig.legend(loc="outside right upper", fontsize=7)
    paths.append(save_figure(fig, out / f"bitdiff_biasmap_{name}.png",
                             "Signed O error per feature (paper Fig. 5(c) over all tokens): features with a "
                             "significant sign bias are outlined."))
    return paths


def draw(result, out: Path) -> list[Path]:
    """Every bitdiff figure into the folder `out`."""
    return plot_bitdiff(result, out)
