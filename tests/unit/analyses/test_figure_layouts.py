"""Every figure of every analysis, drawn on real data as `report` and the commands draw it, passes the layout
checker (tests/helpers/figure_layout.py): no overlapping tick labels or texts, no text past the figure's
edge, no legend or note over data, no empty panel, no blank image, nothing wider than the report page.

Data: the bundled dumps, planted dumps made here with other shapes (many heads and layers, sinks, one
head), the timeline of a monitored training run, and pcast's simulation. Each figure is checked as it
is written: `style.render_png` is observed, the real PNG is still written.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from figure_layout import layout_problems

from fa_forensics.analyses import style
from fa_forensics.analyses.registry import BY_NAME, REPORTED
from fa_forensics.dump import open_dump
from fa_forensics.enums import Backend
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.layers.fanout import Workers
from fa_forensics.layers.selection import select
from fa_forensics.planted import SynthSpec, synth
from tiny_training import monitored_run

REPO = Path(__file__).resolve().parents[3]
PAGE_PX = style.PAGE_WIDTH_IN * style.DPI

BUNDLED = {"planted.zarr": REPO / "sample_dumps" / "planted.zarr", "demo.zarr": REPO / "sample_dumps" / "demo.zarr"}
PLANTED = {
    # 2 layers × 12 heads (long tick rows, a tall bias map), two planted heads, FP8 sinks in the others
    "many-heads": SynthSpec(seq=64, heads=12, head_dim=16, batch=1, steps=2, layers=2, planted_heads=(3, 9),
                            sink_strength=8.0, seed=1),
    # the smallest: one planted head of two, one layer
    "small": SynthSpec(seq=64, heads=2, head_dim=16, batch=1, steps=2, layers=1, planted_heads=(0,), seed=3),
}
# In the fast loop: these analyses on the small dump (about 1 s each); the rest runs in CI's full suite (1 to 10 s
# of CPU each).
FAST = {("small", "delta-bias"), ("small", "pv-trace"), ("small", "bitdiff"), ("small", "fix-check")}


@pytest.fixture(scope="module")
def dump_path(tmp_path_factory):
    """name -> path: a bundled dump, or a planted one written on first use."""
    root = tmp_path_factory.mktemp("layout-dumps")
    made: dict[str, Path] = {}

    def path(name: str) -> Path:
        if name in BUNDLED:
            return BUNDLED[name]
        if name not in made:
            synth(root / f"{name}.zarr", PLANTED[name])
            made[name] = root / f"{name}.zarr"
        return made[name]

    return path


@pytest.fixture(scope="module")
def shared_match_cache(tmp_path_factory) -> Path:
    """One match cache for the module: each dump is matched once, as one `report` run matches it."""
    return tmp_path_factory.mktemp("layout-match-cache")


@pytest.fixture
def drawn(monkeypatch, shared_match_cache) -> list:
    """The figures written while the test runs, each as laid out when its PNG is rendered."""
    monkeypatch.setenv("FA_FORENSICS_CACHE_DIR", str(shared_match_cache))
    figures = []
    render = style.render_png

    def observed(fig):
        figures.append(fig)
        return render(fig)

    monkeypatch.setattr(style, "render_png", observed)
    return figures


def assert_clean(figures: list, paths: list) -> None:
    assert paths and len(figures) == len(paths), (paths, figures)
    problems = {Path(p).name: [str(x) for x in layout_problems(fig, max_width_px=PAGE_PX)]
                for fig, p in zip(figures, paths)}
    assert not any(problems.values()), problems


# the bundled dumps that carry a monitor's timeline (the timeline section needs one; test_every_timeline_figure_...
# below draws a monitored run's)
WITH_TIMELINE = {name for name, path in BUNDLED.items() if (path / "timeline").is_dir()}
CASES = [pytest.param(dump, a.name, id=f"{dump}-{a.name}",
                      marks=() if (dump, a.name) in FAST else pytest.mark.slow)
         for dump in [*BUNDLED, *PLANTED] for a in REPORTED
         if a.section.needs != "timeline" or dump in WITH_TIMELINE]


@pytest.mark.parametrize("dump_name, name", CASES)
def test_every_figure_of_every_analysis_is_laid_out_cleanly(dump_name, name, dump_path, drawn, tmp_path):
    analysis = BY_NAME[name]
    dump = open_dump(dump_path(dump_name))
    sels = select(dump, dump.steps[-1]) if analysis.section.whole_dump else select(dump)
    result = analysis.report_run(dump, sels, Recipe(), Backend.EMULATE, Workers())
    assert_clean(drawn, analysis.draw(result, tmp_path))


def test_fix_check_without_do_draws_its_one_panel_cleanly(make_dump, drawn, tmp_path):
    analysis = BY_NAME["fix-check"]
    dump = open_dump(make_dump(names=("q", "k", "v", "o"), seq=32, head_dim=16, heads=2, steps=(0,)))
    result = analysis.report_run(dump, select(dump), Recipe("bf16"), Backend.EMULATE, Workers())
    paths = analysis.draw(result, tmp_path)
    assert_clean(drawn, paths)
    assert len(drawn[0].axes) == 1  # no Σδ panel of zero-height bars


@pytest.fixture(scope="module")
def monitored_timeline(tmp_path_factory):
    """The timeline of a real monitored training run of the tiny demo GPT (bf16 flash attention)."""
    from fa_forensics.analyses.timeline.compute import analyse_timeline

    out = tmp_path_factory.mktemp("timeline") / "run.zarr"
    monitored_run(out, 12, n_layer=3, n_head=4, steps=[11], layers=[0], monitor_every=1)
    return analyse_timeline(open_dump(out).timeline)


def test_every_timeline_figure_is_laid_out_cleanly(monitored_timeline, drawn, tmp_path):
    from fa_forensics.analyses.timeline.figure import draw

    paths = draw(monitored_timeline, tmp_path)
    assert len(paths) == 6  # loss, W_Q heatmap and per head, ties against loss, max logit, top-1
    assert_clean(drawn, paths)


def test_every_pcast_simulation_figure_is_laid_out_cleanly(drawn, tmp_path):
    from fa_forensics.analyses.pcast import figure as figs
    from fa_forensics.analyses.pcast import sim
    from fa_forensics.analyses.pcast.e4m3 import dp_sawtooth

    res = sim.simulate(sim.SimConfig(deltas=(4.0, 7.0, 10.0), seqs=(128, 256), n_seeds=2, n_queries=2, head_dim=16))
    paths = [figs.fig_dp_sawtooth(dp_sawtooth(), tmp_path / "dp.png"),
             figs.fig_mse_vs_delta(res, tmp_path / "delta.png"), figs.fig_mse_vs_seq(res, tmp_path / "seq.png")]
    assert_clean(drawn, paths)
