"""Training-time figures from a TimelineResult (paper Fig. 2, 3, 11, 13, and the leading indicators).

Every panel marks the steps at which the capture's alarm fired (dotted lines; the replayed rule's when
the capture ran without an alarm), uses a log axis where its values span more than a decade (a max
logit or a W_Q norm that blows up), marks steps whose value is NaN or infinite along its top edge, keeps
its legend outside the data, and says in its caption what the data shows (measured on this run), not
what such a plot shows in the paper.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from fa_forensics.analyses.significance import ALPHA
from fa_forensics.analyses.style import COLORS, new_figure, save_figure, styled
from fa_forensics.analyses.timeline.compute import TimelineResult, lead_indicator
from fa_forensics.monitor.alarm import readable

DECADE_SPAN = 10.0  # a positive series whose largest / smallest value exceeds this is drawn on a log axis


def _nanmax(values: np.ndarray, axis) -> np.ndarray:
    """The largest finite value along `axis` (NaN where there is none: a gap in the plot)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices (unmeasured steps)
        return np.nanmax(np.where(np.isfinite(values), values, np.nan), axis=axis)


def non_finite_steps(values: np.ndarray) -> np.ndarray:
    """(S,) True where some cell of `values` (S, ...) is infinite, or NaN after a finite value (a NaN before any
    finite value is "not measured")."""
    v = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    finite = np.isfinite(v)
    bad = np.isinf(v) | (~finite & np.maximum.accumulate(finite, axis=0))
    return bad.any(axis=1)


def _alarm_records(r: TimelineResult) -> list[dict]:
    """The alarms the figures mark: the capture's, else the replayed rule's (as records)."""
    if r.alarms:
        return list(r.alarms)
    if r.capture_rule is None and r.replay is not None:
        return [a.to_json() for a in r.replay.alarms]
    return []


def _alarm_steps(r: TimelineResult) -> list[int]:
    return sorted({a["step"] for a in _alarm_records(r)} | set(r.alarm_steps))


def _mark_alarms(ax, r: TimelineResult, label: bool = True) -> None:
    for i, step in enumerate(_alarm_steps(r)):
        ax.axvline(step, color=COLORS["highlight"], lw=0.9, ls=":", zorder=1,
                   label="alarm" if (label and i == 0) else None)


def _mark_non_finite(ax, steps: np.ndarray, values: np.ndarray, label: bool = True) -> None:
    """A tick along the top edge at each step where `values` (S, ...) went NaN or infinite."""
    bad = non_finite_steps(values)
    if bad.any():
        ax.plot(steps[bad], np.ones(int(bad.sum())), ls="none", marker="|", ms=9, color=COLORS["lowp"],
                transform=ax.get_xaxis_transform(), clip_on=False, label="NaN or inf" if label else None)


def _log_if_decades(ax, values: np.ndarray) -> bool:
    """Log y-axis when the finite positive values span more than a decade (and none is ≤ 0)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size and (v > 0).all() and v.max() / v.min() > DECADE_SPAN:
        ax.set_yscale("log")
        _readable_log_ticks(ax, float(np.log10(v.max() / v.min())))
        return True
    return False


def _legend_outside(fig, axes) -> None:
    """One legend for `axes` (each label once), right of the plots (constrained layout makes room): never over
    the data."""
    entries: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="outside right upper")


def _readable_log_ticks(ax, decades: float) -> None:
    """Tick labels of a log axis as plain numbers (2, 30, 1e+36), not 3×10¹; at 1, 2 and 5 times each power
    of ten when the axis spans few decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if decades <= 3:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: readable(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _span_text(values: np.ndarray, what: str) -> str:
    """'what went from A to B (×C)' over the finite values of a series, or '' if it has none."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    if not finite.any():
        return ""
    first, last, top = v[finite][0], v[finite][-1], np.nanmax(np.where(finite, v, np.nan))
    ratio = f" (×{readable(last / first)})" if first > 0 and last > 0 else ""
    text = f"{what} went from {readable(first)} to {readable(last)}{ratio}, largest {readable(top)}"
    if non_finite_steps(v).any():
        text += "; it became NaN or infinite"
    return text


def _alarm_caption(r: TimelineResult) -> str:
    records = _alarm_records(r)
    if not records:
        return "No alarm." if (r.capture_rule is not None or r.replay is not None) else ""
    who = "the capture's alarm" if r.alarms else "the rule replayed over the timeline"
    steps = sorted({a["step"] for a in records})
    order = lead_indicator(records)
    return (f"Dotted lines: {who} (first at step {steps[0]}, {len(records)} alarm(s))"
            + (f"; {order}." if order else "."))


def loss_curve(r: TimelineResult, path: Path) -> Path:
    fig, ax = new_figure(height=3.2)
    ax.plot(r.steps, r.loss, color=COLORS["lowp"], lw=1.2, label="loss")
    log = _log_if_decades(ax, r.loss)
    _mark_non_finite(ax, r.steps, r.loss)
    _mark_alarms(ax, r)
    ax.set(title="Training loss", xlabel="step", ylabel="loss (nats/token)" + (", log scale" if log else ""))
    _legend_outside(fig, [ax])
    caption = " ".join(x for x in (f"Paper Fig. 2 for this run: {_span_text(r.loss, 'the loss')}.",
                                   _alarm_caption(r)) if x)
    return save_figure(fig, path, caption)


def spectral_heatmap(r: TimelineResult, path: Path) -> Path:
    from matplotlib.colors import LogNorm

    wq = r.series["wq_sigma"]  # (S, L, H)
    per_layer = _nanmax(wq, axis=2).T  # (L, S)
    finite = per_layer[np.isfinite(per_layer)]
    log = finite.size and finite.min() > 0 and finite.max() / finite.min() > DECADE_SPAN
    fig, ax = new_figure(height=0.9 + 0.45 * max(r.n_layers, 2))
    im = ax.imshow(per_layer, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                   norm=LogNorm(vmin=finite.min(), vmax=finite.max()) if log else None,
                   extent=(r.steps[0] - 0.5, r.steps[-1] + 0.5, -0.5, r.n_layers - 0.5))
    ax.set(title="Spectral norm of W_Q per layer (max over heads)", xlabel="step", ylabel="layer")
    ax.set_yticks(range(r.n_layers))
    ax.grid(False)
    _mark_alarms(ax, r, label=False)
    fig.colorbar(im, ax=ax, label="‖W_Q‖₂" + (" (log scale)" if log else ""))
    largest = _span_text(_nanmax(wq, axis=(1, 2)), "the largest ‖W_Q‖₂")
    caption = " ".join(x for x in (f"Paper Fig. 11 for this run: {largest}." if largest else "",
                                   _alarm_caption(r)) if x)
    return save_figure(fig, path, caption)


def spectral_per_head(r: TimelineResult, path: Path) -> Path:
    wq = r.series["wq_sigma"]
    fig, axes = new_figure(1, r.n_layers, width=min(3.0 * r.n_layers + 1.2, 13), height=3.0, squeeze=False,
                           sharey=True)
    log = _log_if_decades(axes[0, 0], wq)
    for layer in range(r.n_layers):
        ax = axes[0, layer]
        for head in range(r.n_heads):
            ax.plot(r.steps, wq[:, layer, head], lw=1, label=f"head {head}")
            _mark_non_finite(ax, r.steps, wq[:, layer, head], label=head == 0)
        _mark_alarms(ax, r, label=layer == 0)
        ax.set(title=f"layer {layer}", xlabel="step")
    axes[0, 0].set_ylabel("‖W_Q‖₂ of the head" + (", log scale" if log else ""))
    fig.suptitle("Spectral norm of each head's W_Q over training")
    _legend_outside(fig, axes[0])
    top = _top_head_text(r)
    caption = " ".join(x for x in (f"Paper Fig. 3 for this run: {top}." if top else "", _alarm_caption(r)) if x)
    return save_figure(fig, path, caption)


def _top_head_text(r: TimelineResult) -> str:
    if r.top_wq_head is None:
        return ""
    layer, head = r.top_wq_head
    return _span_text(r.series["wq_sigma"][:, layer, head], f"the head with the largest final ‖W_Q‖₂ (layer {layer} "
                                                              f"head {head})")


def ties_vs_loss(r: TimelineResult, path: Path) -> Path:
    ties = np.nansum(r.series["near_max_ties"], axis=(1, 2))
    fig, ax = new_figure(width=7.4, height=3.4)
    ax.plot(r.steps, ties, color=COLORS["lowp"], lw=1.2, label="repeated-max rows")
    ax.set(xlabel="step", ylabel="rows with a repeated max (all heads)")
    ax2 = ax.twinx()
    ax2.plot(r.steps, r.loss, color=COLORS["highp"], lw=1.0, ls="--", label="loss")
    log = _log_if_decades(ax2, r.loss)
    ax2.set_ylabel("loss (nats/token)" + (", log scale" if log else ""))
    ax2.grid(False)
    rho = "n/a" if r.ties_loss_spearman is None else f"{r.ties_loss_spearman:+.2f} (p = {r.ties_loss_p_value:.2g})"
    ax.set_title(f"Repeated maxima against loss\nSpearman ρ {rho}")
    _mark_alarms(ax, r)
    _legend_outside(fig, [ax, ax2])
    if r.ties_loss_spearman is None:
        what = "too few measured steps to relate them"
    elif r.ties_loss_p_value < ALPHA:
        what = (f"they move together (Spearman ρ = {r.ties_loss_spearman:+.2f}); both follow training, so this "
                "alone does not show that ties lead the loss")
    else:
        what = f"no significant relation (Spearman ρ = {r.ties_loss_spearman:+.2f}, p = {r.ties_loss_p_value:.2g})"
    caption = " ".join(x for x in (f"Paper Fig. 13 for this run: {what}.", _alarm_caption(r)) if x)
    return save_figure(fig, path, caption)


def _per_layer_panel(r: TimelineResult, path: Path, metric: str, title: str, ylabel: str, what: str,
                     log_allowed: bool = True) -> Path:
    values = r.series[metric]  # (S, L, H)
    per_layer = _nanmax(values, axis=2)  # (S, L)
    fig, ax = new_figure(height=3.2)
    for layer in range(r.n_layers):
        ax.plot(r.steps, per_layer[:, layer], lw=1.1, label=f"layer {layer}")
    _mark_non_finite(ax, r.steps, values)
    log = log_allowed and _log_if_decades(ax, per_layer)
    _mark_alarms(ax, r)
    ax.set(title=title, xlabel="step", ylabel=ylabel + (", log scale" if log else ""))
    _legend_outside(fig, [ax])
    span = _span_text(_nanmax(values, axis=(1, 2)), what)
    caption = " ".join(x for x in (f"{span}." if span else "", _alarm_caption(r)) if x)
    return save_figure(fig, path, caption)


def max_logit_per_layer(r: TimelineResult, path: Path) -> Path:
    return _per_layer_panel(r, path, "max_logit", "Max attention logit per layer (max over heads)",
                            "max α·q·k (logit units)", "The largest attention logit")


def top1_per_layer(r: TimelineResult, path: Path) -> Path:
    return _per_layer_panel(r, path, "top1_prob", "Top-1 attention probability per layer (max over heads)",
                            "mean top-1 probability", "The largest head's mean top-1 probability",
                            log_allowed=False)


@styled
def draw(r: TimelineResult, out: Path) -> list[Path]:
    """Every figure the series allow; returns the paths written."""
    out = Path(out)
    paths = [loss_curve(r, out / "timeline_loss.png")]
    if "wq_sigma" in r.series and np.isfinite(r.series["wq_sigma"]).any():
        paths += [spectral_heatmap(r, out / "timeline_wq_heatmap.png"),
                  spectral_per_head(r, out / "timeline_wq_heads.png")]
    if "near_max_ties" in r.series:
        paths.append(ties_vs_loss(r, out / "timeline_ties_vs_loss.png"))
    if "max_logit" in r.series:
        paths.append(max_logit_per_layer(r, out / "timeline_max_logit.png"))
    if "top1_prob" in r.series:
        paths.append(top1_per_layer(r, out / "timeline_top1.png"))
    return paths


