"""`fa-forensics timeline` on a store written by a monitored training run (typer's CliRunner)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fa_forensics
from fa_forensics.analyses.registry import BY_NAME
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from tiny_training import monitored_run, tiny_gpt

runner = CliRunner()
N_STEPS = 16


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    """A real monitored run of the tiny demo GPT (bf16 flash attention): 16 steps, 2 layers × 2 heads."""
    out = tmp_path_factory.mktemp("tl") / "run.zarr"
    return out, monitored_run(out, N_STEPS, steps=[N_STEPS - 1], layers=[0], monitor_every=1)


@pytest.mark.slow  # about 3 s of CPU or more
def test_timeline_prints_table_writes_figures_and_json(monitored, tmp_path):
    out, losses = monitored
    figs, js = tmp_path / "figs", tmp_path / "t.json"
    r = runner.invoke(app, ["timeline", str(out), "--out", str(figs), "--json", str(js)])
    assert r.exit_code == 0, r.output
    assert f"{N_STEPS} monitored steps (0..{N_STEPS - 1}), 2 layers × 2 heads" in " ".join(r.output.split())
    assert "repeated maxima vs loss: Spearman" in r.output
    names = sorted(p.name for p in figs.iterdir())
    assert names == ["timeline_loss.png", "timeline_max_logit.png", "timeline_ties_vs_loss.png", "timeline_top1.png",
                     "timeline_wq_heads.png", "timeline_wq_heatmap.png"]
    assert all((figs / n).stat().st_size > 10_000 for n in names)
    payload = json.loads(js.read_text())
    assert list(payload) == list(BY_NAME["timeline"].json_keys)  # the keys of its payload type, then figures
    tl = open_dump(out).timeline
    assert payload["steps"] == list(range(N_STEPS)) and payload["loss"] == losses
    assert payload["n_layers"] == 2 and payload["n_heads"] == 2
    for metric in ("max_logit", "near_max_ties", "p_one_extra", "top1_prob", "wq_sigma"):
        series = np.array(payload["series"][metric])  # [layer][head][step]
        assert series.shape == (2, 2, N_STEPS)
        np.testing.assert_array_equal(series, np.transpose(tl[metric], (1, 2, 0)))
    assert payload["alarm_steps"] == [] and payload["alarms"] == [] and payload["capture_alarm_rule"] is None
    assert sorted(Path(f).name for f in payload["figures"]) == names
    assert -1 <= payload["ties_loss_spearman"] <= 1 and 0 <= payload["ties_loss_p_value"] <= 1
    layer, head = payload["top_wq_head"]
    assert tl["wq_sigma"][-1, layer, head] == np.nanmax(tl["wq_sigma"][-1])
    assert list(payload) == list(BY_NAME["timeline"].json_keys)  # the keys the registry documents


def test_timeline_of_a_store_without_one_is_one_line(tmp_path):
    out = tmp_path / "plain.zarr"
    model = tiny_gpt(n_layer=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with fa_forensics.capture(model, out=out, steps=[0]):
        _, loss = model(torch.randint(0, 256, (1, 32)), torch.randint(0, 256, (1, 32)))
        loss.backward()
        opt.step()
    r = runner.invoke(app, ["timeline", str(out)])
    assert r.exit_code == 2 and "has no timeline" in r.output and "--monitor-every" in r.output
    assert "Traceback" not in r.output
