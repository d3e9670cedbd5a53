"""The words of the verdicts on real replays: no "nan", "n/a%" or "+nan% ± nan%" where a value was not
measured, max P̄ beside the rows where the fix fired, figure titles that follow the test's verdict, no
matplotlib warning leaking on stderr."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app

from test_fix_check_collapse import T, write_high_tie_dump

REPO = Path(__file__).resolve().parents[2]
PLANTED = REPO / "sample_dumps" / "planted.zarr"
runner = CliRunner()
NAN = re.compile(r"\bnan\b|n/a%|nan%")  # lower case: the tables have a "NaN" column


def test_fix_check_shows_max_p_bar_where_the_fix_fired_on_near_ties(tmp_path):
    dump = write_high_tie_dump(tmp_path / "near.zarr", high=12.0, low=12.0, near=True)  # ties within ε, none exact
    js = tmp_path / "fc.json"
    r = runner.invoke(app, ["fix-check", str(dump), "--preset", "bf16", "--json", str(js),
                            "--out", str(tmp_path / "f")])
    d = json.loads(js.read_text())
    text = " ".join(r.output.split())
    assert d["triggered_rows"] == 2 * (T - 1) and d["fixed"]["repeated_rows"] == 2 * (T - 1), r.output
    assert d["baseline"]["max_p_bar"] == 1.0 and 0 < d["max_p_bar"] < 1  # e^-12, cast to bf16
    assert f"max P̄ in the {2 * (T - 1)} row(s) whose maximum repeats (within ε = 0.001): baseline 1, fixed" in text
    assert f"the fix fired in {2 * (T - 1)} row(s)" in text and not NAN.search(text), text


def test_pv_trace_without_an_o_bias_says_n_a_not_nan_percent(tmp_path, monkeypatch):
    import fa_forensics.analyses.pv_trace.figure as figure

    captions, save = [], figure.save_figure
    monkeypatch.setattr(figure, "save_figure", lambda fig, path,
                        caption=None: captions.append(caption) or save(fig, path))
    js = tmp_path / "pv.json"
    # fp32 against fp32: no O bias in any feature, so no share of it can be attributed
    r = runner.invoke(app, ["pv-trace", str(PLANTED), "--preset", "fp32", "--step", "0", "--head", "0",
                            "--json", str(js), "--out", str(tmp_path / "fig")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "n/a (no O bias to share out)" in text and not NAN.search(text), text
    assert len(captions) == 1 and "no error to attribute" in captions[0] and not NAN.search(captions[0]), captions
    from fa_forensics.report.html import _finding

    sentence = _finding("pv-trace", json.loads(js.read_text()))
    assert "has no error" in sentence and "%" not in sentence, sentence


def test_report_sentences_never_put_a_percent_sign_on_n_a():
    from fa_forensics.report.html import _finding

    for name, data in (("bitdiff", {"a": "bf16", "b": "fp32"}), ("pv-trace", {"final_error": 1e-3})):
        sentence = _finding(name, data)
        assert not NAN.search(sentence), sentence


def test_delta_bias_title_follows_the_sign_test(make_dump, tmp_path):
    from fa_forensics.analyses.delta_bias import compute as delta_bias
    from fa_forensics.fidelity.recipe import Recipe
    from fa_forensics.layers.selection import select
    from fa_forensics.dump import open_dump
    from fa_forensics.analyses.delta_bias.figure import total_title

    dump = open_dump(make_dump(steps=(0,), heads=1, seq=16))  # random inputs: no planted bias
    r = delta_bias.run(dump, select(dump, 0), Recipe("bf16"))
    title = total_title(r)
    assert r.total_p_value > 0.5  # seed 0: nothing to find
    assert title.startswith("No significant δ bias") and "biased" not in title, title
    planted = open_dump(PLANTED)
    rp = delta_bias.run(planted, select(planted, 0, 0, 1), Recipe("bf16"))
    # one step of the planted head: about 40 units (batch row, tie group), not significant over the family, so the
    # title claims no bias and names the planted head with its positive Σδ
    assert rp.total > 0 and not rp.claim.found and rp.claim.n_units < rp.n_tokens
    title = total_title(rp)
    assert title.startswith("No significant δ bias (most significant head: layer 0 head 1, +"), title


@pytest.mark.slow  # about 3 s of CPU or more
def test_rank1_figure_without_gradient_error_raises_no_log_scale_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "Data has no positive values ... log-scaled" would fail here
        r = runner.invoke(app, ["rank1-sim", str(PLANTED), "--preset", "fp32", "--out", str(tmp_path)])
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "log-scaled" not in text, text
    assert "no W_Q gradient error to analyse" in text and not NAN.search(text), text
    assert list(tmp_path.glob("rank1_sim_*.png"))
