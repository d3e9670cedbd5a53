"""The house style's layout rules (fa_forensics/analyses/style.py), each checked by the layout checker on a
figure that would be broken without it."""
from __future__ import annotations

import struct

import numpy as np
from figure_layout import layout_problems
from matplotlib.colors import Normalize, SymLogNorm

from fa_forensics.analyses import style


def saved(monkeypatch, tmp_path, build) -> tuple:
    """(figure as written, PNG path): `build()` returns (fig, caption)."""
    figures = []
    render = style.render_png
    monkeypatch.setattr(style, "render_png", lambda fig: (figures.append(fig), render(fig))[1])
    fig, caption = style.styled(build)()
    path = style.save_figure(fig, tmp_path / "f.png", caption)
    return figures[0], path


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    return struct.unpack(">II", head[16:24])


def test_index_ticks_label_every_item_when_they_fit_and_thin_them_when_not(monkeypatch, tmp_path):
    def build(n, width):
        def make():
            fig, ax = style.new_figure(width=width, height=3.0)
            ax.imshow(np.arange(n * 2, dtype=float).reshape(2, n), aspect="auto")
            style.index_ticks(ax.xaxis, [f"head {i}" for i in range(n)])
            return fig, None
        return make

    few, _ = saved(monkeypatch, tmp_path, build(6, 8.0))
    assert [t.get_text() for t in few.axes[0].get_xticklabels()] == [f"head {i}" for i in range(6)]
    many, _ = saved(monkeypatch, tmp_path, build(64, 6.0))
    shown = [t.get_text() for t in many.axes[0].get_xticklabels()]
    assert 2 <= len(shown) < 64 and shown[0] == "head 0"
    assert layout_problems(many) == []


def test_a_few_hot_cells_get_a_scale_that_shows_the_rest(monkeypatch, tmp_path):
    rng = np.random.default_rng(0)
    m = rng.normal(size=(32, 64)) * 0.01
    m[:, 7] = 50.0
    norm = style.diverging_norm(m)
    assert isinstance(norm, SymLogNorm) and norm.vmax == 50.0 and norm.linthresh < 0.05
    assert isinstance(style.diverging_norm(rng.normal(size=(32, 64))), Normalize)
    assert not isinstance(style.diverging_norm(rng.normal(size=(32, 64))), SymLogNorm)

    def build():
        fig, ax = style.new_figure(width=6.0, height=3.0)
        im = ax.imshow(m, cmap="RdBu_r", norm=style.diverging_norm(m), aspect="auto")
        style.colorbar(fig, im, ax, "value")
        return fig, None

    fig, _ = saved(monkeypatch, tmp_path, build)
    assert layout_problems(fig) == []


def test_saved_at_its_own_size_with_long_titles_wrapped_and_the_scale_in_the_label(monkeypatch, tmp_path):
    def build():
        fig, (a, b) = style.new_figure(1, 2, width=14.0, height=3.0)  # wider than the page: drawn at its width
        for ax in (a, b):
            ax.plot(np.arange(5), np.arange(5) * 1e-6)
            ax.set_title("a panel title far longer than the panel it sits above, which must wrap")
            ax.set_ylabel("a quantity (value)")
        fig.suptitle("and a figure title that is longer still than the figure's own width at this font size, "
                     "since it names the step, the layer, the head, the recipe and the accumulation model, so it "
                     "must wrap too")
        return fig, "A caption of some length, as every figure has, naming the paper figure it reproduces " * 3

    fig, path = saved(monkeypatch, tmp_path, build)
    width, height = png_size(path)
    assert width == round(style.PAGE_WIDTH_IN * style.DPI) and abs(height - fig.bbox.height) < 1  # not cropped
    assert "\n" in fig.axes[0].get_title() and "\n" in fig._suptitle.get_text()
    assert fig.axes[0].yaxis.label.get_text().endswith("[×1e−6]")
    assert not fig.axes[0].yaxis.get_offset_text().get_visible()
    assert layout_problems(fig, max_width_px=style.PAGE_WIDTH_IN * style.DPI) == []


def test_a_legend_beside_the_panel_never_covers_data(monkeypatch, tmp_path):
    def build():
        fig, ax = style.new_figure(width=6.0, height=3.0)
        x = np.linspace(0, 1, 100)
        for k in range(4):  # lines filling the whole panel: no corner is free
            ax.plot(x, np.sin(6 * x + k), label=f"line {k}")
        style.legend_outside(ax)
        return fig, None

    fig, _ = saved(monkeypatch, tmp_path, build)
    assert layout_problems(fig) == []
