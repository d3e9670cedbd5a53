"""The shared look of every figure, and the one way figures are saved.

Every figure is for a person: a title, labelled axes with units, a legend or colour bar where
needed, and a caption naming the paper figure it reproduces. Figures are laid out by matplotlib's
constrained layout on a canvas at most PAGE_WIDTH_IN wide, so the report page shows them unscaled;
`save_figure` wraps titles and the caption to the width they have, reserves room for the caption
under the panels and writes the canvas as it is (nothing reaches past its edges, nothing is cropped
away). PNGs are drawn with the Agg backend: no display needed.
"""
from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional, TypeVar

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import Normalize, SymLogNorm  # noqa: E402
from matplotlib.ticker import FuncFormatter, Locator, MaxNLocator  # noqa: E402

# Colours: low precision, high precision, fix, alternatives (colour-blind safe, Okabe-Ito).
COLORS = {
    "lowp": "#D55E00",
    "highp": "#0072B2",
    "fix": "#009E73",
    "alt": "#CC79A7",
    "neutral": "#555555",
    "highlight": "#E69F00",
}

DPI = 110
PAGE_WIDTH_IN = 10.0  # the widest figure: 1100 px at DPI, which the report page shows at its own size
CAPTION_SIZE = 7.5

_RC = {
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "axes.formatter.useoffset": False,  # ticks show their own values: no "+2.95e2" to add in one's head
}

F = TypeVar("F", bound=Callable)


def styled(draw: F) -> F:
    """Run a figure function under the house rcParams, so that every artist it adds (titles, legends,
    labels) takes the house sizes, not only the axes made by `new_figure`."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        with plt.rc_context(_RC):
            return draw(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.4, height: float = 4.0, **kwargs):
    """A figure and its axes in the house style (at most PAGE_WIDTH_IN wide), laid out by constrained layout."""
    with plt.rc_context(_RC):
        fig, axes = plt.subplots(nrows, ncols, figsize=(min(width, PAGE_WIDTH_IN), height), **kwargs)
    fig.set_layout_engine("constrained")
    return fig, axes


def new_panel_rows(nrows: int, ncols: int, *, width: float = PAGE_WIDTH_IN, height: float = 4.0):
    """A figure of `nrows` rows of `ncols` panels, each row laid out on its own (a legend or colour bar beside
    one panel takes room from its row only); returns the figure and an (nrows, ncols) array of axes."""
    with plt.rc_context(_RC):
        fig = plt.figure(figsize=(min(width, PAGE_WIDTH_IN), height), layout="constrained")
        rows = fig.subfigures(nrows, 1)
        axes = np.array([np.atleast_1d(row.subplots(1, ncols)) for row in np.atleast_1d(rows)])
    return fig, axes


def style_context():
    """Context manager applying the house rcParams (for code that calls pyplot directly)."""
    return plt.rc_context(_RC)


class _FittingIndexLocator(Locator):
    """Ticks at 0..n-1 standing for `labels`: every one when the axis has room for all of them, else every k-th.
    The room is the axis's length over a label's size along it: its height (stacked labels, or labels turned
    upright) or, for level labels side by side, the width of the longest (0.6 em a character, plus a 1 em gap)."""

    def __init__(self, labels: Sequence[str]):
        self.labels = labels

    def __call__(self):
        n = len(self.labels)
        lo, hi = sorted(self.axis.get_view_interval())
        label = self.axis.get_major_ticks(1)[0].label1
        size = label.get_fontsize()
        box = self.axis.axes.bbox
        if self.axis.axis_name == "x" and abs(label.get_rotation() % 180) < 45:  # level labels side by side
            length, along = box.width, (0.6 * max((len(s) for s in self.labels), default=1) + 1.0) * size
        else:
            length, along = (box.width if self.axis.axis_name == "x" else box.height), 1.4 * size
        room = length * 72 / self.axis.axes.figure.dpi / along
        step = max(1, math.ceil(n / max(room, 1)))
        return [i for i in range(0, n, step) if lo - 0.5 <= i <= hi + 0.5]


def index_ticks(axis, labels: Sequence) -> None:
    """Tick an axis whose positions 0..n-1 stand for `labels` (heads, layers, feature ids, rows of a map): every
    label when they fit along the axis without overlapping, else every k-th."""
    labels = [str(label) for label in labels]
    axis.set_major_locator(_FittingIndexLocator(labels))
    axis.set_major_formatter(FuncFormatter(
        lambda x, _pos: labels[int(round(x))] if 0 <= round(x) < len(labels) else ""))


def integer_ticks(axis) -> None:
    """Ticks at whole numbers only (training steps, token counts, indices)."""
    axis.set_major_locator(MaxNLocator(nbins="auto", integer=True, min_n_ticks=1))


VISIBLE_SHADE = 0.04  # |value| / limit from which a cell's colour differs visibly from the centre's (white)
VISIBLE_SHARE = 0.05  # a linear scale must show at least this share of the cells off the centre colour


def diverging_norm(values, bulk: float = 0.95):
    """A colour scale centred on 0 that shows what `values` hold: linear from −max|value| to +max|value| unless
    that would leave fewer than VISIBLE_SHARE of the cells visibly off white (a few cells far above the rest);
    then linear up to the `bulk` quantile of |value| (the middle half of the colours) and logarithmic beyond."""
    a = np.abs(np.asarray(values, dtype=np.float64))
    a = a[np.isfinite(a)]
    lim = float(a.max()) if a.size else 0.0
    if lim == 0.0:
        return Normalize(-1.0, 1.0)
    knee = float(np.quantile(a, bulk))
    if (a > VISIBLE_SHADE * lim).mean() >= VISIBLE_SHARE or knee <= 0.0:
        return Normalize(-lim, lim)
    return SymLogNorm(linthresh=knee, linscale=max(1.0, math.log10(lim / knee)), vmin=-lim, vmax=lim, base=10)


def colorbar(fig, image, ax, label: str):
    """The colour bar of `image` beside `ax`; a logarithmic scale is ticked at 0, ± its linear limit and ± its
    end (decades crowd each other near the linear part)."""
    norm = image.norm
    if isinstance(norm, SymLogNorm):
        knee, lim = norm.linthresh, norm.vmax
        bar = fig.colorbar(image, ax=ax, label=label, ticks=[-lim, -knee, 0.0, knee, lim])
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.2g}"))
        return bar
    return fig.colorbar(image, ax=ax, label=label)


def legend_outside(ax, **kwargs):
    """The panel's legend beside it, right of its axes: a legend never covers data, wherever the data lies."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kwargs)


def _length(text, renderer) -> float:
    """How far a text runs along its own direction, in pixels (a vertical label: its height)."""
    box = text.get_window_extent(renderer)
    return box.height if abs(text.get_rotation() % 180 - 90) < 1 else box.width


def _wrap(text, length_px: float, renderer) -> None:
    """Break the words of a Text into lines no longer than `length_px` (its own line breaks are kept)."""
    if length_px <= 0 or not text.get_text() or _length(text, renderer) <= length_px:
        return
    out = []
    for paragraph in text.get_text().split("\n"):
        line = ""
        for word in paragraph.split(" "):
            trial = f"{line} {word}" if line else word
            text.set_text(trial)
            if line and _length(text, renderer) > length_px:
                out.append(line)
                line = word
            else:
                line = trial
        out.append(line)
    text.set_text("\n".join(out))


def _fold_offsets(fig) -> None:
    """Move each axis's scale ("1e−5", drawn at the axis's end where it runs into labels and titles) into the
    axis's label."""
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            scale = axis.get_offset_text()
            if scale.get_visible() and scale.get_text().strip():
                label = axis.label.get_text()
                axis.set_label_text(f"{label} [×{scale.get_text()}]" if label else f"×{scale.get_text()}")
                scale.set_visible(False)


def _fit_texts(fig, renderer) -> None:
    """Wrap each panel's title and axis labels to the panel's width or height (a colour bar's label to its
    length) and the figure's title to the figure's width."""
    for ax in fig.axes:
        _wrap(ax.title, ax.bbox.width, renderer)
        _wrap(ax.xaxis.label, ax.bbox.width, renderer)
        _wrap(ax.yaxis.label, ax.bbox.height, renderer)
    if fig._suptitle is not None:
        _wrap(fig._suptitle, 0.96 * fig.bbox.width, renderer)


def add_caption(fig, caption: str) -> None:
    """The caption under the panels, wrapped to the figure's width; the figure grows by its height so that
    the panels keep theirs."""
    renderer = fig.canvas.get_renderer()
    text = fig.supxlabel(caption, x=0.01, ha="left", fontsize=CAPTION_SIZE, color=COLORS["neutral"])
    _wrap(text, 0.98 * fig.bbox.width, renderer)
    lines = text.get_text().count("\n") + 1
    fig.set_figheight(fig.get_figheight() + lines * CAPTION_SIZE * 1.25 / 72)


def render_png(fig) -> bytes:
    """The figure's canvas as PNG bytes (the figure as laid out: its own size, nothing cropped)."""
    png = io.BytesIO()
    fig.savefig(png, format="png")
    return png.getvalue()


def save_figure(fig, path: Path, caption: Optional[str] = None) -> Path:
    """Write `fig` as PNG to `path` with `caption` (e.g. "Reproduces paper Fig. 5a: ...") below it."""
    from fa_forensics.dump.safe_files import atomic_write

    path = Path(path)
    fig.canvas.draw()  # the layout and the ticks, so that labels can be fitted to their panels
    _fold_offsets(fig)
    _fit_texts(fig, fig.canvas.get_renderer())
    if caption:
        add_caption(fig, caption)
    png = render_png(fig)
    plt.close(fig)
    atomic_write(path, png, "out")  # never through a link planted at the file's name
    return path
