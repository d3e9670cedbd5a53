"""Figures of pv-trace: the paper's Fig. 6 (V column, cumulative P̄V error, detail of the largest step)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fa_forensics.analyses.wording import finite, percent, share_with_se
from fa_forensics.analyses.style import COLORS, integer_ticks, new_figure, save_figure, styled


@styled
def plot_pv_trace(report, path: Path) -> Path:
    """Three panels: (a) histogram of V[:, i], (b) Eq. 5 error along t with P̄ = 1 marked,
    (c) a window around the largest jump; the fourth place holds their legend and the split of the error."""
    tr = report.trace
    t = np.arange(tr.error.numel())
    err = tr.error.numpy()
    v = tr.v.numpy()
    ones = np.array(tr.p_one_positions, dtype=int)
    fig, axes = new_figure(2, 2, width=10.0, height=7.0)
    (ax_a, ax_b), (ax_c, ax_note) = axes

    frac_neg = float((v < 0).mean()) if v.size else float("nan")
    ax_a.hist(v, bins=40, color=COLORS["highp"])
    ax_a.axvline(0, color=COLORS["neutral"], lw=0.8)
    ax_a.set_title(f"(a) V[:, {tr.feature}]: {percent(frac_neg)} negative")
    ax_a.set_xlabel(f"V[t, {tr.feature}] (value)")
    ax_a.set_ylabel("count (tokens)")

    ax_b.plot(t, err, color=COLORS["lowp"], lw=1.0, label="Eq. 5 error(t)")
    if ones.size:
        ax_b.scatter(ones, err[ones], color=COLORS["highlight"], s=22, zorder=3, label="P̄[T, t] = 1")
    ax_b.axhline(0, color=COLORS["neutral"], lw=0.8)
    ax_b.set_title(f"(b) cumulative error of P̄V, row {tr.row}, feature {tr.feature}")
    ax_b.set_xlabel("key position t (token)")
    ax_b.set_ylabel("(ΣP̄V)_lp − (ΣP̄V)_hp (value)")
    integer_ticks(ax_b.xaxis)

    j = tr.largest_jump
    centre = j.t if j is not None else (int(ones[0]) if ones.size else 0)
    lo, hi = max(0, centre - 10), min(len(t), centre + 11)
    ax_c.step(t[lo:hi], err[lo:hi], where="post", color=COLORS["lowp"], lw=1.2)
    in_win = ones[(ones >= lo) & (ones < hi)]
    if in_win.size:
        ax_c.scatter(in_win, err[in_win], color=COLORS["highlight"], s=30, zorder=3)
    title = "(c) detail around the largest step"
    if j is not None:
        ax_c.scatter([j.t], [err[j.t]], s=90, facecolors="none", edgecolors="black", linewidths=1.0, zorder=4,
                     label="largest step")
        title += f": {j.error_step:+.2e} at t = {j.t} (rounded {j.direction})"
    ax_c.set_title(title)
    ax_c.set_xlabel("key position t (token)")
    ax_c.set_ylabel("error (value)")
    integer_ticks(ax_c.xaxis)

    ax_note.axis("off")  # the legend of (b) and (c) and the split of the final error: text beside the data
    handles = [*ax_b.get_legend_handles_labels()[0], *ax_c.get_legend_handles_labels()[0]]
    ax_note.legend(handles=handles, loc="upper left", title="(b), (c)", alignment="left")
    sp = tr.split
    shares = ", ".join(f"{c.cls} {share_with_se(c.share, c.se)}" for c in report.class_shares
                       if c.rows and finite(c.share))
    note = f"final rounding: {sp.cls}\n(A = {sp.a:.8g}, r = {sp.r:+.2e})"
    if shares:
        note += f"\n\nO bias of the head by class:\n{shares}"
    ax_note.text(0.0, 0.0, note, transform=ax_note.transAxes, fontsize=8, va="bottom", ha="left")
    fig.suptitle(f"pv-trace: step {report.step}, layer {report.layer}, head {report.head}, "
                 f"{tr.accumulation} accumulation, P̄V rounded to {tr.pv_format}")
    share = (f"the P̄ = 1 mechanism carries {percent(tr.frac_error_from_p_one)} of it (order-independent split A + r)"
             if finite(tr.frac_error_from_p_one) else "there is no error to attribute")
    caption = (f"Reproduces paper Fig. 6 (a)-(c): error of one P̄V dot product (Eq. 5); final error "
               f"{tr.final_error:+.3e}; its final rounding is a {tr.split.cls}, and {share}.")
    return save_figure(fig, path, caption)


def draw(report, out: Path) -> list[Path]:
    """The Eq. 5 trace figure into the folder `out`."""
    tr = report.trace
    return [plot_pv_trace(report,
                          out / f"pv_trace_s{report.step}_l{report.layer}_h{report.head}_r{tr.row}_f{tr.feature}.png")]
