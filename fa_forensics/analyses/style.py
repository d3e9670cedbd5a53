"""The shared look of every figure, and the one way figures are saved.

Every figure is for a person: a title, labelled axes with units, a legend or colour bar where
needed, and a caption naming the paper figure it reproduces. `save_figure` draws the caption
under the axes and writes a PNG (Agg backend: no display needed).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Colours: low precision, high precision, fix, alternatives (colour-blind safe, Okabe-Ito).
COLORS = {
    "lowp": "#D55E00",
    "highp": "#0072B2",
    "fix": "#009E73",
    "alt": "#CC79A7",
    "neutral": "#555555",
    "highlight": "#E69F00",
}

_RC = {
    "figure.dpi": 110,
    "savefig.dpi": 110,
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
}


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.4, height: float = 4.0, **kwargs):
    """A figure and its axes in the house style."""
    with plt.rc_context(_RC):
        fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), **kwargs)
    fig.set_layout_engine("constrained")
    return fig, axes


def style_context():
    """Context manager applying the house rcParams (for code that calls pyplot directly)."""
    return plt.rc_context(_RC)


def save_figure(fig, path: Path, caption: Optional[str] = None) -> Path:
    """Write `fig` as PNG to `path` with `caption` (e.g. "Reproduces paper Fig. 5a: ...") below it."""
    path = Path(path)
    if caption:
        fig.text(0.01, 0.0, caption, ha="left", va="top", fontsize=7.5, color=COLORS["neutral"], wrap=True,
                 transform=fig.transFigure)
    import io

    from fa_forensics.dump.safe_files import atomic_write

    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    atomic_write(path, png.getvalue(), "out")  # never through a link planted at the file's name
    return path
