"""Figure of `rank1-sim`: paper Fig. 4 (similar rank-1 matrices) plus the accumulation test across steps."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import SymLogNorm
from matplotlib.ticker import FormatStrFormatter, MaxNLocator, NullFormatter

from fa_forensics.analyses.wording import finite, number
from fa_forensics.analyses.style import (
    COLORS, colorbar, diverging_norm, index_ticks, integer_ticks, legend_outside, new_panel_rows, save_figure, styled,
)


@styled
def plot_rank1(result, path: Path) -> Path:
    """(a, b) two rank-1 matrices (PK)[T]ᵀX[T]; (c) their pairwise cosines; (d) column weights; (e) growth of
    ‖Σ E_s‖; (f) the singular values of Σ E."""
    fig, axes = new_panel_rows(3, 2, width=10.0, height=10.5)
    ax = axes.ravel()
    for j in range(2):
        a = ax[j]
        if j < len(result.example_matrices):
            m = np.asarray(result.example_matrices[j])
            norm = diverging_norm(m)  # a few standout columns would leave a linear scale blank
            im = a.imshow(m, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest")
            tk = result.tokens[j]
            scale = ", log colour beyond ±" + number(norm.linthresh, ".2g") if isinstance(norm, SymLogNorm) else ""
            a.set_title(f"({'ab'[j]}) (PK)[T]ᵀX[T], step {tk.step} T={tk.token}{scale}")
            colorbar(fig, im, a, "value")
        a.set_xlabel("input feature (column of X)")
        a.set_ylabel("head dim d")
        integer_ticks(a.xaxis)
        integer_ticks(a.yaxis)
        a.grid(False)
    cos = np.asarray(result.cosine)
    im = ax[2].imshow(cos, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    ax[2].set_title(f"(c) pairwise cosine, off-diagonal mean {result.cosine_offdiag_mean:+.2f}")
    ax[2].set_xlabel("chosen token #")
    ax[2].set_ylabel("chosen token #")
    integer_ticks(ax[2].xaxis)
    integer_ticks(ax[2].yaxis)
    ax[2].grid(False)
    fig.colorbar(im, ax=ax[2], label="cosine similarity")
    if result.top_columns:
        feats = [c.feature for c in result.top_columns]
        y = np.arange(len(feats))
        ax[3].barh(y, [c.weight for c in result.top_columns], color=COLORS["highlight"])
        index_ticks(ax[3].yaxis, feats)  # feature ids are names, one a row: never run together
        ax[3].invert_yaxis()
    ax[3].set_title("(d) input features that stand out")
    ax[3].set_ylabel("input feature (column of X)")
    ax[3].set_xlabel("share of ‖(PK)ᵀX‖² (mean over tokens)")
    c = np.asarray(result.cumulative_norms, dtype=np.float64)
    if c.size and (c > 0).all():  # a log axis needs positive values
        n = np.arange(1, len(c) + 1)
        ax[4].loglog(n, c, "o-", color=COLORS["lowp"], label=accumulation_label(result))
        ax[4].loglog(n, c[0] * n, "--", color=COLORS["neutral"], label="slope 1\n(compounds)")
        ax[4].loglog(n, c[0] * np.sqrt(n), ":", color=COLORS["highp"], label="slope 0.5\n(washes out)")
        ax[4].xaxis.set_major_locator(MaxNLocator(nbins="auto", integer=True, min_n_ticks=1))
        ax[4].xaxis.set_major_formatter(FormatStrFormatter("%d"))  # steps are counted: 1, 2, 3, not 2×10⁰
        ax[4].xaxis.set_minor_formatter(NullFormatter())
        legend_outside(ax[4])
    elif c.size:
        ax[4].text(0.5, 0.5, "no gradient error to accumulate\n(the replays agree at some step)", ha="center",
                   va="center", transform=ax[4].transAxes, color=COLORS["neutral"])
        ax[4].axis("off")
    ax[4].set_title("(e) accumulation of the W_Q gradient error")
    ax[4].set_xlabel("number of steps n")
    ax[4].set_ylabel("Frobenius norm")
    sv = np.asarray(result.singular_values)
    if sv.size:
        ax[5].bar(np.arange(1, sv.size + 1), sv, color=COLORS["highp"])
    integer_ticks(ax[5].xaxis)
    ax[5].set_title(f"(f) singular values of Σ E; eff. rank {number(result.effective_rank, '.2f')}")
    ax[5].set_xlabel("index")
    ax[5].set_ylabel("singular value")
    fig.suptitle(f"rank1-sim: layer {result.focus_layer} head {result.focus_head}")
    return save_figure(fig, path, caption(result))


def accumulation_label(result) -> str:
    """The legend of the accumulation curve: its exponent only where the verdict interprets it (a significant Σδ
    claim, `compute.verdict`); otherwise why none is claimed."""
    expo = result.accumulation_exponent
    claim = getattr(result, "claim", None)
    if not finite(expo):
        return "‖Σ_(s≤n) E_s‖,\nexponent not measured"
    if claim is not None and not claim.found:
        return "‖Σ_(s≤n) E_s‖,\nno exponent claimed:\nno significant Σδ bias"
    return f"‖Σ_(s≤n) E_s‖,\nexponent {number(expo, '.2f')}"


def caption(result) -> str:
    """Paper Fig. 4 (c, f)'s question, with this head's answer (the paper finds the matrices alike)."""
    return ("Paper Fig. 4 (c, f)'s view (Eq. 2-3): how alike the rank-1 matrices (PK)[T]ᵀX[T] of different tokens and "
            f"steps are (here mean cosine {number(result.cosine_offdiag_mean, '+.2f')}; alike in the paper's run) and "
            "which input features dominate them.")


def draw(result, out: Path) -> list[Path]:
    """The rank-1 figure into the folder `out` (none without X: there are no rank-1 matrices to draw)."""
    if not result.has_x:
        return []
    return [plot_rank1(result, out / f"rank1_sim_l{result.focus_layer}_h{result.focus_head}.png")]
