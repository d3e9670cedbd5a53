"""The monitor's scale-aware pieces: attention entropy against a brute-force softmax, qk-norm detection on real
modules, the scale test against the run's early values (logit growth, saturation, output-logit divergence either
way), W_Q's norm left alone behind a qk-norm, and the drops' wording."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fa_forensics.monitor.alarm import AlarmRule, alarm_codes, recorded_alarms, replay_rule
from fa_forensics.monitor.drops import dropped_steps, dropped_text
from fa_forensics.monitor.qk_norm import has_qk_norm
from fa_forensics.monitor.stats import head_statistics
from tests.helpers.unstable_training import Attention


def _entropy(q, k, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        T, Tk = s.shape[-2:]
        s = s.masked_fill(torch.arange(Tk)[None, :] > (torch.arange(T) + (Tk - T))[:, None], -math.inf)
    p = s.softmax(-1)
    return -(torch.where(p > 0, p * p.log(), 0.0)).sum(-1).mean(dim=(0, 2))


@pytest.mark.parametrize("T,Tk,causal,chunk", [(70, 70, True, 128), (64, 64, False, 16), (33, 50, True, 8)])
def test_attention_entropy_equals_the_softmax_entropy(T, Tk, causal, chunk):
    gen = torch.Generator().manual_seed(T)
    q, k = torch.randn(2, 3, T, 16, generator=gen) * 3, torch.randn(2, 3, Tk, 16, generator=gen)
    got = head_statistics(q, k, causal=causal, chunk=chunk).attn_entropy
    assert torch.allclose(got.double(), _entropy(q, k, causal), atol=1e-5)


def test_attention_entropy_limits_and_nan():
    q = torch.zeros(1, 1, 32, 8)  # uniform attention: row t sees t + 1 keys, entropy log(t + 1)
    got = head_statistics(q, torch.randn(1, 1, 32, 8), causal=True).attn_entropy
    assert got.item() == pytest.approx(np.mean(np.log(np.arange(1, 33))), abs=1e-5)
    q = torch.randn(1, 2, 40, 16)
    q[0, 0, 5] = math.nan
    got = head_statistics(q, torch.randn(1, 2, 40, 16)).attn_entropy
    assert math.isnan(got[0]) and math.isfinite(got[1])


def test_qk_norm_is_found_on_the_module_that_has_it():
    assert has_qk_norm(Attention(32, 2, qk_norm=True)) is True
    assert has_qk_norm(Attention(32, 2, qk_norm=False)) is False
    block = torch.nn.Module()
    block.ln_1, block.attn = torch.nn.LayerNorm(32), Attention(32, 2, qk_norm=False)
    assert has_qk_norm(block) is False  # the block's input norm is not a qk-norm
    assert has_qk_norm(None) is None


def _feed(rule, n, **series):
    return [a for i in range(n) for a in rule.observe(i, **{m: v[i] for m, v in series.items()})]


def test_scale_test_alarms_on_logit_growth_long_before_the_warm_up_ends():
    n = 60
    steps = np.arange(n)
    logits = np.full((n, 2, 2), 3.0) + np.random.default_rng(0).normal(0, 0.2, (n, 2, 2))
    logits[:, 1, 0] = 3.0 * 1.2 ** steps  # grows from the start
    alarms = _feed(AlarmRule(), n, max_logit=logits)
    assert alarms and all(a.rule == "scale" and (a.layer, a.head) == (1, 0) for a in alarms)
    first = alarms[0]
    ref = np.median(logits[:5, 1, 0])  # the reference: the first 5 monitored values' median (4.32)
    grown = [t for t in steps if logits[t, 1, 0] >= 20 * ref and logits[t, 1, 0] - ref >= 50]
    assert first.step == grown[0] + 2  # held for scale_persist = 3 monitored steps
    assert first.step < AlarmRule().warmup
    assert len(alarms) == 1  # once per excursion


def test_healthy_growth_of_the_max_logit_does_not_alarm():
    n = 120
    logits = np.linspace(2.0, 15.0, n)[:, None, None] * np.ones((1, 2, 2))  # ×7.5, +13 logits: learning
    assert _feed(AlarmRule(), n, max_logit=logits) == []


def test_saturation_needs_both_a_top1_near_1_and_a_collapsed_entropy():
    n = 30
    top1 = np.full((n, 1, 2), 0.3)
    entropy = np.full((n, 1, 2), 2.5)
    top1[10:, 0, 0], entropy[10:, 0, 0] = 0.995, 0.05  # collapsed onto one key
    top1[10:, 0, 1], entropy[10:, 0, 1] = 0.995, 1.0  # one sharp row type, entropy still 0.4 × its start
    alarms = _feed(AlarmRule(), n, top1_prob=top1, attn_entropy=entropy)
    assert [(a.step, a.metric, a.head, a.rule) for a in alarms] == [(12, "attn_entropy", 0, "scale")]
    assert "saturated" in alarms[0].message()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_output_lse_divergence_alarms_either_way(sign):
    n = 40
    lse = 5.6 + np.random.default_rng(1).normal(0, 0.1, n)
    lse[20:] += sign * 0.5 * np.arange(1, 21)  # 0.5 nats a step away from where it started
    alarms = _feed(AlarmRule(), n, output_lse=lse)
    assert len(alarms) == 1 and alarms[0].metric == "output_lse" and alarms[0].layer is None
    ref = np.median(lse[:5])
    away = [t for t in range(n) if abs(lse[t] - ref) >= 5]  # output_lse_rise = 5 nats
    assert alarms[0].step == away[0] + 2 and alarms[0].baseline == pytest.approx(ref)  # held 3 monitored steps
    codes = alarm_codes(alarms, {"output_lse": ()})
    steps = np.arange(n)
    timeline = {"step": steps, "output_lse": lse,
                "alarm_output_lse": np.array([codes["alarm_output_lse"] if s == alarms[0].step else 0 for s in steps])}
    assert [r["step"] for r in recorded_alarms(timeline)] == [alarms[0].step]


def test_wq_sigma_is_not_alarmed_behind_a_qk_norm():
    n = 80
    wq = np.ones((n, 2, 1))
    wq[60:] = 3.0  # ×3 jump in both layers after the warm-up
    layers = {a.layer for a in replay_rule(AlarmRule(), np.arange(n), None, qk_norm=[True, False], wq_sigma=wq)}
    assert layers == {1}


def test_dropped_steps_in_words():
    attrs = {"capture": {"monitor": {"dropped_steps": [
        {"step": 58, "reason": "recorded after an alarm: no room", "episode": 57, "mb": 3.7},
        {"step": 59, "reason": "recorded after an alarm: no room", "episode": 57, "mb": 3.7}]}}}
    drops = dropped_steps(attrs)
    assert dropped_text(drops) == "steps 58, 59 (alarm episode from step 57): recorded after an alarm: no room"
    assert dropped_steps({"capture": {}}) == [] and dropped_text([]) == ""


def test_a_cell_that_jumps_and_outgrows_its_scale_at_once_records_the_jump():
    n = 30
    logits = np.full((n, 1, 1), 2.0) + np.random.default_rng(2).normal(0, 0.1, (n, 1, 1))
    logits[20:] = 1e6  # W_Q ×1e6 at step 20: a jump and a scale alarm, both on their third step
    alarms = _feed(AlarmRule(warmup=10), n, max_logit=logits)
    assert [(a.step, a.rule) for a in alarms] == [(22, "jump")]
    codes = alarm_codes(alarms, {"max_logit": (1, 1)})["alarm_max_logit"]
    assert codes[0, 0] == 2  # the jump's code: what the capture's line named is what the row records
