"""Training-time figures from a TimelineResult (paper Fig. 2, 3, 11, 13, and max logits)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from fa_forensics.analyses.timeline.compute import TimelineResult
from fa_forensics.analyses.style import COLORS, legend_outside, new_figure, save_figure, styled


def loss_curve(r: TimelineResult, path: Path) -> Path:
    fig, ax = new_figure(height=3.2)
    ax.plot(r.steps, r.loss, color=COLORS["lowp"], lw=1.2)
    ax.set(title="Training loss", xlabel="step", ylabel="loss (nats/token)")
    return save_figure(fig, path, "Reproduces paper Fig. 2 (loss over training steps).")


def spectral_heatmap(r: TimelineResult, path: Path) -> Path:
    wq = r.series["wq_sigma"]  # (S, L, H)
    with warnings.catch_warnings():  # a step with no W_Q found is all-NaN: drawn as a gap, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        per_layer = np.nanmax(wq, axis=2).T  # (L, S)
    fig, ax = new_figure(height=0.5 + 0.45 * max(r.n_layers, 2))
    im = ax.imshow(per_layer, aspect="auto", origin="lower", cmap="viridis",
                   extent=(r.steps[0] - 0.5, r.steps[-1] + 0.5, -0.5, r.n_layers - 0.5))
    ax.set(title="Spectral norm of W_Q per layer (max over heads)", xlabel="step", ylabel="layer")
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="‖W_Q‖₂")
    return save_figure(fig, path,
                       "Reproduces paper Fig. 11 (spectral norms of attention weights per layer over steps).")


def spectral_per_head(r: TimelineResult, path: Path) -> Path:
    wq = r.series["wq_sigma"]
    fig, axes = new_figure(1, r.n_layers, width=min(3.0 * r.n_layers, 12), height=3.0, squeeze=False, sharey=True)
    for layer in range(r.n_layers):
        ax = axes[0, layer]
        for head in range(r.n_heads):
            ax.plot(r.steps, wq[:, layer, head], lw=1, label=f"head {head}")
        ax.set(title=f"layer {layer}", xlabel="step")
    axes[0, 0].set_ylabel("‖W_Q‖₂ of the head")
    fig.suptitle("Spectral norm of each head's W_Q over training")
    legend_outside(axes[0, -1])
    return save_figure(fig, path, "Reproduces paper Fig. 3 (W_Q spectral norm per head; outlier heads stand out).")


def ties_vs_loss(r: TimelineResult, path: Path) -> Path:
    ties = np.nansum(r.series["near_max_ties"], axis=(1, 2))
    fig, ax = new_figure(height=3.2)
    ax.plot(r.steps, ties, color=COLORS["lowp"], lw=1.2, label="rows with a repeated maximum (all heads)")
    ax.set(xlabel="step", ylabel="rows with repeated max (count)")
    ax2 = ax.twinx()
    ax2.plot(r.steps, r.loss, color=COLORS["highp"], lw=1.0, ls="--", label="loss")
    ax2.set_ylabel("loss (nats/token)")
    ax2.grid(False)
    rho = "n/a" if r.ties_loss_spearman is None else f"{r.ties_loss_spearman:+.2f} (p = {r.ties_loss_p_value:.2g})"
    ax.set_title(f"Repeated maxima against loss — Spearman ρ {rho}")
    for i, step in enumerate(r.alarm_steps):
        ax.axvline(step, color=COLORS["highlight"], lw=0.8, ls=":", label="alarm" if i == 0 else None)
    lines = ax.get_lines() + ax2.get_lines()
    lines = [ln for ln in lines if not ln.get_label().startswith("_")]
    fig.legend(lines, [ln.get_label() for ln in lines], loc="outside right upper")  # beside both y axes
    return save_figure(fig, path, "Reproduces paper Fig. 13 (multiple maxima as a leading indicator of failure).")


def max_logit_per_layer(r: TimelineResult, path: Path) -> Path:
    with warnings.catch_warnings():  # unmeasured steps are all-NaN: drawn as gaps
        warnings.simplefilter("ignore", RuntimeWarning)
        ml = np.nanmax(r.series["max_logit"], axis=2)  # (S, L)
    fig, ax = new_figure(height=3.2)
    for layer in range(r.n_layers):
        ax.plot(r.steps, ml[:, layer], lw=1.1, label=f"layer {layer}")
    ax.set(title="Max attention logit per layer", xlabel="step", ylabel="max α·q·k (logit units)")
    legend_outside(ax)
    return save_figure(fig, path, "Max scaled attention score per layer (growing logits precede ties and failure).")


@styled
def all_timeline_figures(r: TimelineResult, out: Path) -> list[Path]:
    """Every figure the series allow; returns the paths written."""
    paths = [loss_curve(r, out / "timeline_loss.png")]
    if "wq_sigma" in r.series and np.isfinite(r.series["wq_sigma"]).any():
        paths += [spectral_heatmap(r, out / "timeline_wq_heatmap.png"),
                  spectral_per_head(r, out / "timeline_wq_heads.png")]
    if "near_max_ties" in r.series:
        paths.append(ties_vs_loss(r, out / "timeline_ties_vs_loss.png"))
    if "max_logit" in r.series:
        paths.append(max_logit_per_layer(r, out / "timeline_max_logit.png"))
    return paths
