"""The layout checker (tests/helpers/figure_layout.py) catches each defect on a deliberately broken figure, and
passes the same figure drawn right: overlapping tick labels, overlapping or clipped text, a legend or a note
over data, an empty panel, a blank image, a figure too wide for the page."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from figure_layout import layout_problems  # noqa: E402


def kinds(fig, **kwargs) -> list[str]:
    try:
        return [p.kind for p in layout_problems(fig, **kwargs)]
    finally:
        plt.close(fig)


def figure(width=4.0, height=3.0, ncols=1):
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), layout="constrained")
    return fig, axes


def test_tick_labels_run_together_on_a_narrow_axis():
    fig, ax = figure()
    ids = [2344, 7200, 8711, 1235, 6621, 9902, 1187, 3450, 5521, 6012, 7723, 8834]
    ax.bar([str(i) for i in ids], np.arange(1, 13))
    found = layout_problems(fig)
    assert [p.kind for p in found].count("tick-overlap") >= 5
    assert all("x axis" in p.where for p in found if p.kind == "tick-overlap")
    plt.close(fig)


def test_the_same_ticks_laid_out_upright_pass():
    fig, ax = figure()
    ids = [2344, 7200, 8711, 1235, 6621, 9902, 1187, 3450, 5521, 6012, 7723, 8834]
    ax.barh([str(i) for i in ids], np.arange(1, 13))
    assert kinds(fig) == []


def test_rotated_labels_that_clear_each_other_pass_though_their_upright_boxes_would_meet():
    fig, ax = figure(width=5.0)
    ax.bar(np.arange(12), np.arange(1, 13))
    ax.set_xticks(np.arange(12), [f"label {i:02d}" for i in range(12)], rotation=45, ha="right",
                  rotation_mode="anchor")
    assert "tick-overlap" not in kinds(fig)


def test_ticks_outside_the_view_are_not_drawn_and_not_counted():
    fig, ax = figure()
    ax.plot(np.arange(10), np.arange(10))
    ax.set_xticks(np.arange(0, 100, 0.5))  # 200 ticks, all but a few beyond the view
    ax.set_xlim(0, 2)
    assert kinds(fig) == []


def test_two_texts_on_top_of_each_other():
    fig, ax = figure()
    ax.plot([0, 1], [0, 1])
    ax.set_title("a title that is long enough")
    fig.text(0.5, 0.97, "a second line placed on it", ha="center", va="top")
    assert "text-overlap" in kinds(fig)


def test_text_past_the_figure_edge_is_clipped():
    fig, ax = figure()
    ax.plot([0, 1], [0, 1])
    fig.text(0.8, 0.5, "a note that runs off the right edge of the canvas")
    assert "clipped" in kinds(fig)


def test_a_colour_bar_label_longer_than_its_bar_is_clipped():
    fig, ax = figure(width=4.0, height=1.6)
    im = ax.imshow(np.random.default_rng(0).normal(size=(4, 8)))
    fig.colorbar(im, ax=ax, label="Σ_T (δ_lp − δ_hp), summed over every selected step and head")
    assert "clipped" in kinds(fig)


def test_text_cut_by_the_box_it_is_clipped_to():
    fig, ax = figure()
    ax.plot([0, 1], [0, 1])
    ax.text(0.9, 0.5, "clipped by the axes", transform=ax.transAxes, clip_on=True)
    assert "clipped" in kinds(fig)


def test_a_legend_over_the_line_it_explains():
    fig, ax = figure()
    x = np.linspace(0, 1, 50)
    ax.plot(x, 0.5 + 0 * x, label="a flat line through the middle")
    ax.legend(loc="center")
    assert "legend-over-data" in kinds(fig)


def test_a_legend_over_bars_and_their_error_bars():
    fig, ax = figure(width=5.0)
    ax.barh(np.arange(8), np.full(8, 8.0), xerr=0.5)
    ax.legend(["bars"], loc="center right")
    assert "legend-over-data" in kinds(fig)


def test_a_legend_over_a_heat_map():
    fig, ax = figure()
    ax.imshow(np.random.default_rng(0).normal(size=(8, 8)))
    ax.scatter([1], [1], label="marked cell")
    ax.legend(loc="upper right")
    assert "legend-over-data" in kinds(fig)


def test_a_legend_beside_the_panel_passes():
    fig, ax = figure(width=6.0)
    x = np.linspace(0, 1, 50)
    ax.plot(x, 0.5 + 0 * x, label="a flat line")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    assert kinds(fig) == []


def test_a_legend_in_an_empty_corner_passes():
    fig, ax = figure()
    x = np.linspace(0, 1, 50)
    ax.plot(x, x**4, label="rises late")
    ax.legend(loc="upper left")
    assert kinds(fig) == []


def test_an_annotation_over_the_line_it_labels():
    fig, ax = figure()
    x = np.linspace(0, 1, 50)
    ax.plot(x, x)
    ax.annotate("a note on the line", (0.5, 0.5), ha="center", va="center")
    assert "text-over-data" in kinds(fig)


def test_a_panel_without_data_and_one_with_only_nan():
    fig, (ax1, ax2, ax3) = figure(width=9.0, ncols=3)
    ax1.plot([0, 1], [0, 1])
    ax2.set_title("nothing drawn")
    ax3.plot([0, 1, 2], [np.nan, np.nan, np.nan])
    ax3.set_title("only NaN")
    found = layout_problems(fig)
    plt.close(fig)
    empty = sorted(p.where for p in found if p.kind == "empty-panel")
    assert len(empty) == 2 and "nothing drawn" in empty[0] and "only NaN" in empty[1]


def test_zero_height_bars_are_no_data():
    fig, ax = figure()
    ax.bar(np.arange(4), np.zeros(4))
    assert "empty-panel" in kinds(fig)


def test_a_panel_turned_off_must_say_why():
    fig, (ax1, ax2) = figure(width=8.0, ncols=2)
    ax1.plot([0, 1], [0, 1])
    ax2.axis("off")
    assert "empty-panel" in kinds(fig)
    fig, (ax1, ax2) = figure(width=8.0, ncols=2)
    ax1.plot([0, 1], [0, 1])
    ax2.axis("off")
    ax2.text(0.5, 0.5, "no gradient error\nto accumulate", ha="center", transform=ax2.transAxes)
    assert kinds(fig) == []


def test_a_twin_axis_counts_as_data_of_its_panel():
    fig, ax = figure()
    ax2 = ax.twinx()
    ax2.plot([0, 1], [0, 1])
    assert "empty-panel" not in kinds(fig)


@pytest.mark.parametrize("blank", [True, False])
def test_an_image_of_a_few_hot_cells_on_white_is_blank(blank):
    rng = np.random.default_rng(0)
    m = rng.normal(size=(64, 128)) * (1e-3 if blank else 1.0)
    m[:, 5] = 100.0  # one column far above the rest
    fig, ax = figure(width=5.0)
    lim = 100 if blank else 3  # the hot column's scale, or the rest's (the column saturates)
    ax.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    assert ("blank-image" in kinds(fig)) is blank


def test_a_figure_wider_than_the_page():
    fig, ax = figure(width=13.0)
    ax.plot([0, 1], [0, 1])
    assert kinds(fig, max_width_px=1100) == ["too-wide"]
