"""The timeline's diagnosis on recorded training runs (tests/data/timelines: real fp32 CPU runs of tiny GPTs): logit
growth is named with its head, onset and evidence, healthy runs get none, a learning-rate blow-up is told from a
gradual growth, and a series the timeline lacks is missing evidence, never a zero."""
from pathlib import Path

import numpy as np
import pytest

from fa_forensics.analyses.timeline.diagnose import ACTIONS, LOSS_RISE, diagnose, loss_spike, summary

DATA = Path(__file__).resolve().parents[2] / "data" / "timelines"


def _run(name: str) -> dict:
    return {k: np.asarray(v, dtype=np.float64 if k != "step" else np.int64)
            for k, v in np.load(DATA / f"{name}.npz").items()}


def _diagnose(t: dict, **extra):
    t = dict(t)
    return diagnose(t.pop("step"), **t, **extra)


@pytest.mark.parametrize("name, layer, head, step", [("attn_logit_growth", 1, 1, 20), ("demo_gpt_lr0.1", 0, 0, 5),
                                                     ("lr_spike_after_150", 1, 2, 151)])
def test_attention_logit_growth_is_named_with_its_head_onset_and_evidence(name, layer, head, step):
    t = _run(name)
    f = _diagnose(t)
    assert f.mechanism == "attention-logit-growth" and (f.layer, f.head, f.step) == (layer, head, step)
    series = t["max_logit"][:, layer, head]
    i = int(np.flatnonzero(t["step"] == step)[0])
    assert f.number("max logit at onset") == pytest.approx(series[i]) and series[:i].max() < series[i]
    assert f.number("peak max logit") == pytest.approx(np.nanmax(series)) and f.number("growth") > 10
    assert f.number("last top-1 probability") > 0.95 > 0.3 > f.number("early top-1 probability")
    assert "qk-layernorm" in f.action and "learning rate" in f.action
    text = summary(f)
    assert text.startswith(f"attention-logit growth in layer {layer} head {head} from step {step}: its max logit rose")
    assert f.missing == ("attn_entropy", "output_lse")  # recorded before the monitor had these series


@pytest.mark.parametrize("name", ["healthy_qk_norm", "demo_gpt_lr0.03"])
def test_healthy_runs_have_no_instability(name):
    f = _diagnose(_run(name))
    assert f.mechanism == "none" and not f.found and f.step is None and f.action == ""


def test_a_healthy_run_with_one_hard_batch_has_no_loss_spike():
    """healthy_qk_norm's step 90 batch costs 0.8 nats more than its neighbours, then the loss is back: not a spike."""
    loss = _run("healthy_qk_norm")["loss"]
    assert loss[90] > np.median(loss[70:90]) + LOSS_RISE and loss[91] < np.median(loss[70:90]) + LOSS_RISE
    assert loss_spike(loss) is None


def test_a_learning_rate_blow_up_is_every_indicator_jumping_with_the_loss():
    t = _run("demo_gpt_lr0.3")
    f = _diagnose(t)
    assert f.mechanism == "optimizer-blow-up" and f.step == 1 == f.loss_spike_step
    assert f.number("loss at the spike") > f.number("loss before the spike") + LOSS_RISE
    assert f.number("share of heads jumping at the spike") >= 0.5 and "attention-logit-growth" in f.also
    assert "warm-up" in f.action and "clip" in f.action


def test_output_logit_divergence_from_the_output_lse_series():
    """A healthy recorded run with an output log-sum-exp that drifts from step 40 on: output-logit divergence,
    named before an attention mechanism, with z-loss advice."""
    t = _run("healthy_qk_norm")
    n = len(t["step"])
    lse = np.full(n, np.log(256.0))
    lse[40:] += np.linspace(0.0, 60.0, n - 40)
    f = _diagnose(t, output_lse=lse)
    assert f.mechanism == "output-logit-divergence" and f.layer is None
    assert 40 < f.step < 100 and lse[int(np.flatnonzero(t["step"] == f.step)[0])] - np.log(256) > 10
    assert "z-loss" in f.action and "output_lse" not in f.missing


def test_attention_entropy_collapse_before_a_loss_spike():
    """The recorded growth run with its logits capped (no growth) but its top-1 probability saturating in one head
    and the loss diverging after it: entropy collapse is the mechanism."""
    t = _run("healthy_qk_norm")
    top1 = t["top1_prob"].copy()
    top1[100:, 0, 1] = 0.995
    loss = t["loss"].copy()
    loss[130:] = np.nan
    f = _diagnose({**t, "top1_prob": top1, "loss": loss})
    assert f.mechanism == "attention-entropy-collapse" and (f.layer, f.head, f.step) == (0, 1, 100)
    assert f.loss_spike_step == 130 and f.number("steps from onset to the loss spike") == 30
    # the same saturation without a loss spike is a sharp head, not a failure
    assert _diagnose({**t, "top1_prob": top1}).mechanism == "none"


def test_missing_series_are_missing_evidence():
    t = _run("attn_logit_growth")
    only_loss = diagnose(t["step"], loss=t["loss"])
    assert only_loss.mechanism == "none" and {"max_logit", "top1_prob", "output_lse"} <= set(only_loss.missing)
    nothing = diagnose(t["step"])
    assert nothing.mechanism == "no-evidence" and not nothing.found and ACTIONS[nothing.mechanism] == ""
    js = _diagnose(t).to_json()
    assert js["mechanism"] == "attention-logit-growth" and js["found"] and js["evidence"]["growth"] > 10
    assert js["summary"] == summary(_diagnose(t)) and js["missing"] == list(_diagnose(t).missing)
