"""Figures of the FP8 P-cast study (paper 002, Figs. 1-3) and the per-head dump view.

Each function takes a result of fa_forensics.analyses.pcast.compute and writes one PNG.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.ticker import NullLocator
from scipy import stats

from fa_forensics.analyses.pcast.compute import PcastDumpResult
from fa_forensics.analyses.pcast.e4m3 import DpPoint
from fa_forensics.analyses.pcast.sim import DELTA_FIG3, PcastSimResult
from fa_forensics.analyses.pcast.theory import LN_UNDERFLOW
from fa_forensics.analyses.style import COLORS, legend_outside, new_figure, save_figure, styled

# The five configurations of the paper's §6.2, with their look.
CURVES = (
    ("forward", 1.0, COLORS["lowp"], "o", "-"),
    ("forward", 256.0, COLORS["fix"], "s", "-"),
    ("forward", 448.0, COLORS["alt"], "^", "-"),
    ("reverse", 1.0, COLORS["highp"], "v", "--"),
    ("reverse", 256.0, COLORS["highlight"], "D", "--"),
)


@styled
def fig_dp_sawtooth(curve: Sequence[DpPoint], path: Path) -> Path:
    """Paper Fig. 1: dp(S) over the E4M3 number line, powers of two on the 2^-4 envelope."""
    fig, ax = new_figure(width=6.4, height=3.8)
    S = np.array([p.S for p in curve])
    dp = np.array([p.dp for p in curve])
    ax.plot(S, dp, color=COLORS["neutral"], lw=1.0, label="dp(S), exhaustive E4M3 enumeration")
    pow2 = [p for p in curve if p.bit_exact and p.S <= 256]
    ax.scatter([p.S for p in pow2], [p.dp for p in pow2], color=COLORS["highp"], zorder=3, s=18,
               label="S = 2^k (bit-exact)")
    ax.axhline(2.0 ** -4, color=COLORS["highp"], ls=":", lw=0.8, label="lower envelope 2^-4")
    for p in curve:
        if p.S == 256.0:
            ax.scatter([p.S], [p.dp], marker="*", s=160, color=COLORS["fix"], zorder=4,
                       label=f"S = 256: dp = {p.dp:.4f}")
        if p.S == 448.0:
            ax.scatter([p.S], [p.dp], marker="o", s=50, color=COLORS["lowp"], zorder=4,
                       label=f"S = 448: dp = {p.dp:.4f}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0.05, 0.3)
    ax.set_xlabel("static P scale S (log2 axis)")
    ax.set_ylabel("dp(S) = max E4M3 step met by P·S / S")
    ax.set_title("E4M3 P-cast: normalized quantization step dp(S)")
    ax.legend(loc="upper left")
    return save_figure(fig, path, "Reproduces paper 002 Fig. 1: dp(S) is a sawtooth whose lower envelope 2^-4 is met "
                                  "exactly by S = 2^k ≤ 256; S = 448 sits 14% above it; S > 448 saturates.")


def _curve(res: PcastSimResult, order: str, S: float, seq: int | None = None, delta: float | None = None):
    """The rows of one (order, S) curve, at one N or one Δ."""
    rows = [r for r in res.rows if r.order == order and r.S == S
            and (seq is None or r.seq == seq) and (delta is None or r.delta == delta)]
    return rows


@styled
def fig_mse_vs_delta(res: PcastSimResult, path: Path) -> Path:
    """Paper Fig. 2: MSE vs sink strength (top) and the zeroed fraction and non-sink mass (bottom)."""
    fig, (ax, bx) = new_figure(2, 1, width=9.0, height=6.4, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    n = res.n_main
    for order, S, color, marker, ls in CURVES:
        rows = sorted(_curve(res, order, S, seq=n), key=lambda r: r.delta)
        if not rows:
            continue
        d = [r.delta for r in rows]
        ax.errorbar(d, [r.mse for r in rows], yerr=[r.mse_se for r in rows], color=color, marker=marker, ls=ls,
                    ms=4, capsize=2, label=f"{order} S={S:g}")
    ax.set_yscale("log")
    ax.set_ylabel("output MSE vs fp64 (mean ± se over seeds)")
    ax.set_title(f"FP8 P-cast: MSE vs sink strength (N = {n}, k = {res.config.n_sinks} sinks, B = {res.config.block})")
    legend_outside(ax)
    base = sorted(_curve(res, "forward", 1.0, seq=n), key=lambda r: r.delta)
    fix = sorted(_curve(res, "forward", 256.0, seq=n), key=lambda r: r.delta)
    ref = base or fix
    if ref:
        d = np.array([r.delta for r in ref])
        bx.bar(d - 0.2, [r.nonsink_mass for r in ref], width=0.4, color=COLORS["highp"], alpha=0.6,
               label="non-sink probability mass")
        if base:
            bx.bar(d + 0.2, [r.frac_zeroed for r in base], width=0.4, color=COLORS["lowp"], alpha=0.8,
                   label="fraction of non-sink P zeroed,\nforward S=1")
            bx.plot(d, [r.closed_form for r in base], color="black", ls="--", lw=1,
                    label="closed form Φ(Δ+δ_k−10ln2)")
        if fix:
            bx.plot(d, [r.frac_zeroed for r in fix], color=COLORS["fix"], marker="s", ms=3,
                    label="fraction zeroed, forward S=256")
            bx.plot(d, [r.closed_form for r in fix], color=COLORS["fix"], ls=":", lw=1, label="closed form, S=256")
    bx.set_ylim(0, 1.05)
    bx.set_xlabel("sink strength Δ (standard deviations of the non-sink scores)")
    bx.set_ylabel("fraction")
    legend_outside(bx)
    return save_figure(fig, path, "Reproduces paper 002 Fig. 2: forward S=1 peaks in the transition region (Δ ≈ 6-8); "
                                  f"S=256 or reverse order stay at the quantization floor. δ_k = {res.delta_k:.3f} "
                                  f"(integrated), {res.config.n_seeds} seeds × {res.config.n_queries} queries.")


@styled
def fig_mse_vs_seq(res: PcastSimResult, path: Path) -> Path:
    """Paper Fig. 3: MSE vs sequence length at Δ = 7."""
    fig, ax = new_figure(width=9.0, height=4.2)
    for order, S, color, marker, ls in CURVES:
        rows = sorted(_curve(res, order, S, delta=DELTA_FIG3), key=lambda r: r.seq)
        if rows:
            ax.errorbar([r.seq for r in rows], [r.mse for r in rows], yerr=[r.mse_se for r in rows], color=color,
                        marker=marker, ls=ls, ms=4, capsize=2, label=f"{order} S={S:g}")
    base = {r.seq: r.mse for r in _curve(res, "forward", 1.0, delta=DELTA_FIG3)}
    fix = {r.seq: r.mse for r in _curve(res, "forward", 256.0, delta=DELTA_FIG3)}
    ax.set_xscale("log", base=2)
    gains = sorted(set(base) & set(fix))
    if gains:  # the ratios as the top axis's labels, above the data instead of over it
        top = ax.secondary_xaxis("top")
        top.set_xticks(gains, [f"×{base[n] / fix[n]:.1f}" for n in gains], fontsize=7)
        top.xaxis.set_minor_locator(NullLocator())
        top.set_xlabel("MSE of forward S=1 / forward S=256", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N (keys)")
    ax.set_ylabel("output MSE vs fp64 (mean ± se over seeds)")
    ax.set_title(f"FP8 P-cast: MSE vs sequence length at Δ = {DELTA_FIG3:g}")
    legend_outside(ax)
    return save_figure(fig, path,
                       "Reproduces paper 002 Fig. 3: the gain of forward S=256 over forward S=1 (top axis: ratio) "
                                  "grows with N as the non-sink mass at risk grows.")


@styled
def fig_dump_heads(res: PcastDumpResult, path: Path) -> Path:
    """Each captured head's forward-S=1 zeroed fraction against its measured sink strength."""
    fig, ax = new_figure(width=9.0, height=4.0)
    d = np.linspace(0, 14, 200)
    c1 = stats.norm.cdf(d + res.delta_k - LN_UNDERFLOW)
    ax.plot(d, c1, color="black", ls="--", lw=1, label="closed form S=1, Φ(Δ+δ_k−10 ln 2)")
    ax.plot(d, stats.norm.cdf(d + res.delta_k - LN_UNDERFLOW - math.log(256)), color=COLORS["fix"], ls=":", lw=1,
            label="closed form S=256")
    for S, color, marker in ((1.0, COLORS["lowp"], "o"), (256.0, COLORS["fix"], "s")):
        pts = [(h.sink_strength, h.setting(S, "forward").frac_zeroed) for h in res.heads
               if h.setting(S, "forward") is not None and math.isfinite(h.sink_strength)]
        if pts:
            x, y = zip(*pts)
            ax.scatter(x, y, color=color, marker=marker, s=22, zorder=3, label=f"captured heads, forward S={S:g}")
    ax.set_xlabel("measured sink strength Δ̂ = gap/sd − δ_k (standard deviations)")
    ax.set_ylabel("fraction of non-sink P zeroed")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title(f"FP8 P-cast on captured heads ({len(res.heads)} heads)")
    legend_outside(ax)
    return save_figure(fig, path, "Per-head version of paper 002 Table 1 / Eq. 7 on real scores: points are measured "
                                  "by the kernel-faithful cast of each head's scores; lines are the Gaussian closed "
                                  "form.")


def draw(res: PcastDumpResult, out: Path) -> list[Path]:
    """The per-head figure of the dump study into the folder `out`."""
    return [fig_dump_heads(res, out / "pcast_heads.png")]
