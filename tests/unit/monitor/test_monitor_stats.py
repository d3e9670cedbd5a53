"""Per-head monitor statistics against brute force on real numerics."""
import math

import numpy as np
import pytest
import torch

from fa_forensics.monitor import AlarmRule, find_query_weights, head_spectral_norms, head_statistics


@torch.no_grad()
def _reference_statistics(q, k, *, scale, causal=True, eps=1e-3, p_dtype=torch.bfloat16, chunk=128):
    """The monitor's first, direct version (masked_fill, cast P̄ to p_dtype, compare with 1): the reference
    the faster `head_statistics` must equal bit for bit."""
    B, H, T, D = q.shape
    Tk = k.shape[2]
    kf = k.float()
    max_logit = torch.full((H,), -torch.inf)
    ties = torch.zeros(H, dtype=torch.int64)
    p_one_extra = torch.zeros(H, dtype=torch.int64)
    top1_sum = torch.zeros(H, dtype=torch.float64)
    cols = torch.arange(Tk)
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        s = torch.matmul(q[:, :, start:stop].float(), kf.transpose(-1, -2)) * scale  # (B, H, c, Tk)
        if causal:
            rows = torch.arange(start, stop) + (Tk - T)
            s = s.masked_fill(cols[None, :] > rows[:, None], -torch.inf)
        r_m = s.amax(dim=-1, keepdim=True)
        max_logit = torch.maximum(max_logit, r_m.amax(dim=(0, 2, 3)))
        ties += (((r_m - s) <= eps).sum(dim=-1) > 1).sum(dim=(0, 2))
        p_bar = torch.exp(s - r_m)
        ones = (p_bar.to(p_dtype) == 1).sum(dim=-1)
        p_one_extra += (ones - 1).clamp(min=0).sum(dim=(0, 2))
        top1_sum += (1.0 / p_bar.sum(dim=-1)).double().sum(dim=(0, 2))
    return max_logit, ties, p_one_extra, (top1_sum / (B * T)).float()


def _planted(seed, B, H, T, D, Tk=None, dtype=torch.bfloat16, spread=1.0):
    """Random q, k with head 1 made to tie: keys 5 and 9 equal, queries from 9 on aligned with them."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, T, D, generator=g) * spread).to(dtype)
    k = torch.randn(B, H, Tk or T, D, generator=g).to(dtype)
    k[:, 1, 9] = k[:, 1, 5]
    q[:, 1, 9:] = (4 * k[:, 1, 5]).unsqueeze(1)
    return q, k


CASES = [  # (B, H, T, Tk, D, chunk, causal, p_dtype, eps, spread)
    (2, 4, 256, 256, 32, 128, True, torch.bfloat16, 1e-3, 1.0),  # the demo model's shape
    (2, 3, 96, 96, 16, 7, True, torch.bfloat16, 1e-3, 3.0),  # odd chunks
    (1, 2, 200, 200, 64, 64, True, torch.bfloat16, 1e-3, 8.0),  # sharp rows: many P̄ == 1
    (2, 2, 33, 33, 8, 16, False, torch.bfloat16, 1e-3, 1.0),  # not causal, odd T
    (1, 3, 64, 100, 16, 32, True, torch.bfloat16, 1e-3, 2.0),  # longer K (bottom-right causal)
    (1, 2, 100, 64, 16, 32, True, torch.bfloat16, 1e-3, 2.0),  # shorter K: fully masked rows (NaN)
    (2, 3, 96, 96, 16, 64, True, torch.float16, 1e-3, 3.0),  # fp16 P̄: ε beyond its P̄ == 1 set
    (2, 3, 96, 96, 16, 64, True, torch.bfloat16, 5e-2, 3.0),  # large ε: full comparison
]


@pytest.mark.parametrize("B, H, T, Tk, D, chunk, causal, p_dtype, eps, spread", CASES)
def test_head_statistics_equal_the_direct_version_bit_for_bit(B, H, T, Tk, D, chunk, causal, p_dtype, eps, spread):
    q, k = _planted(B * 1000 + T + Tk + D + chunk, B, H, T, D, Tk, dtype=torch.bfloat16, spread=spread)
    scale = D ** -0.5
    got = head_statistics(q, k, scale=scale, causal=causal, eps=eps, p_dtype=p_dtype, chunk=chunk)
    ref = _reference_statistics(q, k, scale=scale, causal=causal, eps=eps, p_dtype=p_dtype, chunk=chunk)
    assert torch.equal(got.max_logit, ref[0])
    assert got.near_max_ties.tolist() == ref[1].tolist()
    assert got.p_one_extra.tolist() == ref[2].tolist()
    np.testing.assert_array_equal(got.top1_prob.numpy(), ref[3].numpy())  # NaN where rows are fully masked
    assert int(ref[2].sum()) > 0  # the planted head has P̄ == 1 twice in many rows
    # the worker receives fp32 copies of the bf16 tensors (strided row chunks, no further copy): same bits
    got32 = head_statistics(q.float(), k.float(), scale=scale, causal=causal, eps=eps, p_dtype=p_dtype, chunk=chunk)
    for a, b in zip((got32.max_logit, got32.near_max_ties, got32.p_one_extra, got32.top1_prob), ref):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_head_statistics_on_nan_and_inf_scores_match_the_direct_version():
    q, k = _planted(5, 1, 3, 64, 16)
    q[0, 0, 10, 3] = float("nan")  # one NaN query: its row is NaN
    k[0, 2, 4, 0] = float("inf")  # an infinite key: +inf / −inf / NaN scores
    q2, k2 = _planted(6, 1, 2, 64, 16)
    q2[0, 1, 20:] *= 1e19  # finite inputs whose scores overflow to ±inf in fp32
    k2[0, 1] *= 1e19
    for q_, k_ in ((q, k), (q2, k2)):
        got = head_statistics(q_, k_, scale=0.25)
        ref = _reference_statistics(q_, k_, scale=0.25)
        assert got.near_max_ties.tolist() == ref[1].tolist() and got.p_one_extra.tolist() == ref[2].tolist()
        np.testing.assert_array_equal(got.max_logit.numpy(), ref[0].numpy())
        np.testing.assert_array_equal(got.top1_prob.numpy(), ref[3].numpy())
        assert not torch.isfinite(ref[0]).all() or not torch.isfinite(ref[3]).all()  # the case is non-finite


def _brute(q, k, scale, eps, causal=True):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale  # (B, H, T, T)
    T = q.shape[2]
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf)
    r_m = s.amax(-1, keepdim=True)
    ties = (((r_m - s) <= eps).sum(-1) > 1).sum((0, 2))
    p_bar = torch.exp((s - r_m).float())
    ones = (p_bar.bfloat16() == 1).sum(-1)
    top1 = (1 / torch.exp(s - r_m).sum(-1)).mean((0, 2))
    return s.amax((0, 2, 3)), ties, (ones - 1).clamp(min=0).sum((0, 2)), top1


@pytest.mark.parametrize("chunk", [7, 64, 512])
def test_head_statistics_match_brute_force_on_planted_ties(chunk):
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 3, 96, 16
    q = torch.randn(B, H, T, D, generator=g).bfloat16()
    k = torch.randn(B, H, T, D, generator=g).bfloat16()
    # head 1: keys 5 and 9 identical and queries aligned with them → exact repeated maxima
    k[:, 1, 9] = k[:, 1, 5]
    q[:, 1, 9:] = (4 * k[:, 1, 5]).unsqueeze(1)
    scale = D ** -0.5
    got = head_statistics(q, k, scale=scale, eps=1e-3, chunk=chunk)
    max_logit, ties, p_one_extra, top1 = _brute(q, k, scale, 1e-3)
    torch.testing.assert_close(got.max_logit, max_logit.float(), rtol=1e-6, atol=1e-5)
    assert got.near_max_ties.tolist() == ties.tolist()
    assert got.p_one_extra.tolist() == p_one_extra.tolist()
    torch.testing.assert_close(got.top1_prob, top1.float(), rtol=1e-4, atol=1e-5)
    # every row of head 1 from token 9 on has its maximum twice (keys 5 and 9)
    assert got.near_max_ties[1] >= B * (T - 9)
    assert got.near_max_ties[1] > 10 * max(int(got.near_max_ties[0]), int(got.near_max_ties[2]), 1)


def test_wq_sigma_is_exact_at_every_step_of_a_real_training_run():
    """σ(W_Q) against torch.linalg.matrix_norm(ord=2) at every step of real AdamW training (nanoGPT layout)."""
    from fa_forensics.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=4, n_embd=64, attention="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(20):
        idx = torch.randint(0, 256, (2, 16), generator=gen)
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        w_heads = find_query_weights(model.transformer.h[0].attn, n_heads=4)  # (4, 16, 64)
        exact = torch.linalg.matrix_norm(w_heads.double(), ord=2)
        worst = max(worst, float(((head_spectral_norms(w_heads).double() - exact).abs() / exact).max()))
    assert worst < 1e-6  # fp32 rounding of the result only


def test_query_weights_of_hf_layouts():
    C, H = 32, 4

    class Conv1D(torch.nn.Module):  # HF GPT-2 stores (C, 3C) and computes x @ W
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(C, 3 * C))

    gpt2 = torch.nn.Module()
    gpt2.c_attn = Conv1D()
    w = find_query_weights(gpt2, H)
    torch.testing.assert_close(w.reshape(C, C), gpt2.c_attn.weight[:, :C].t())
    llama = torch.nn.Module()
    llama.q_proj = torch.nn.Linear(C, C, bias=False)
    torch.testing.assert_close(find_query_weights(llama, H).reshape(C, C), llama.q_proj.weight)
    assert find_query_weights(torch.nn.Module(), H) is None


def test_alarm_fires_on_persistent_ties_and_loss_spike_not_on_noise_or_bursts():
    rule = AlarmRule(window=20, min_history=8, warmup=10)
    rng = np.random.default_rng(0)
    for step in range(40):  # noisy but stationary: no alarm
        ties = rng.poisson(5, size=(2, 3))
        assert rule.observe(step, loss=3 + 0.05 * rng.standard_normal(), near_max_ties=ties) == []
    burst = rng.poisson(5, size=(2, 3))
    burst[0, 1] = 80  # one batch of repeated text: a one-step burst is not an alarm (persist 3)
    assert rule.observe(40, loss=3.0, near_max_ties=burst) == []
    raised = []
    for step in range(41, 46):  # a drift that stays: one alarm, on its third step, not repeated
        ties = rng.poisson(5, size=(2, 3))
        ties[1, 2] = 60
        raised += rule.observe(step, loss=3.0, near_max_ties=ties)
    assert [(a.step, a.metric, a.layer, a.head) for a in raised] == [(43, "near_max_ties", 1, 2)]
    assert "step 43 layer 1 head 2" in raised[0].message()
    # a loss jump must hold two monitored steps (one hard batch that recovers is no alarm): it alarms on the second
    assert rule.observe(46, loss=9.0, near_max_ties=rng.poisson(5, size=(2, 3))) == []
    alarms = rule.observe(47, loss=9.0, near_max_ties=rng.poisson(5, size=(2, 3)))
    assert [(a.step, a.metric) for a in alarms] == [(47, "loss")]


def test_alarm_is_silent_during_warmup():
    rule = AlarmRule(window=20, min_history=8, warmup=50)
    for step in range(50):
        loss = 3.0 if step < 20 else 30.0  # a spike inside the warmup
        assert rule.observe(step, loss=loss) == []


def _brute_rounded(q, k, scale, eps, score_dtype):
    """Brute force in a kernel's score precision: S = cast(fp32(cast(q·k → dtype))·α → dtype), whole (T, T)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).to(score_dtype).float()
    s = (s * scale).to(score_dtype).float()
    T = q.shape[2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf)
    r_m = s.amax(-1, keepdim=True)
    d = s - r_m
    ties = ((d >= -eps).sum(-1) > 1).sum((0, 2))
    ones = (torch.exp(d).bfloat16() == 1).sum(-1)
    return ties, (ones - 1).clamp(min=0).sum((0, 2)), r_m.amax((0, 2, 3))


@pytest.mark.parametrize("chunk", [32, 128])
def test_bf16_scores_count_the_repeated_maxima_a_bf16_kernel_has(chunk):
    """A kernel with bf16 scores (the paper's recipe) rounds close scores onto one value: counted in
    that precision there are several times more repeated maxima than fp32 scores show."""
    g = torch.Generator().manual_seed(4)
    B, H, T, D = 2, 2, 128, 64
    q = (torch.randn(B, H, T, D, generator=g) * 3.0).bfloat16()  # sharp rows, maxima of order 10-20
    k = torch.randn(B, H, T, D, generator=g).bfloat16()
    scale = D ** -0.5
    got = head_statistics(q, k, scale=scale, chunk=chunk, score_dtype=torch.bfloat16)
    ties, p_one_extra, max_logit = _brute_rounded(q, k, scale, 1e-3, torch.bfloat16)
    assert got.near_max_ties.tolist() == ties.tolist()
    assert got.p_one_extra.tolist() == p_one_extra.tolist()
    assert torch.equal(got.max_logit, max_logit)
    fp32 = head_statistics(q, k, scale=scale, chunk=chunk)
    assert int(got.near_max_ties.sum()) >= 3 * max(int(fp32.near_max_ties.sum()), 1)


def test_deferred_wq_sigma_equals_the_direct_one():
    """On a GPU the collector forms W_Q's Gram on the device and takes its eigenvalue on the host at the
    end of the step (no synchronization per layer): the same σ as head_spectral_norms (both layouts)."""
    from fa_forensics.monitor.spectral import ScaledGram

    g = torch.Generator().manual_seed(0)
    for shape in ((4, 16, 64), (4, 64, 16)):  # D ≤ C (W Wᵀ) and D > C (Wᵀ W)
        w = torch.randn(*shape, generator=g)
        np.testing.assert_array_equal(ScaledGram(w).to_host().sigma().numpy(), head_spectral_norms(w).numpy())


def test_spectral_norms_of_nan_inf_and_huge_weights_are_values_not_exceptions():
    """LAPACK cannot decompose a NaN Gram ('failed to converge'), and a Gram of weights above ~1e154 overflows
    float64: each head is a value anyway, the exact norm where the weights are finite."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 16, 64, generator=g, dtype=torch.float64)
    w[1] *= 1e36  # W_Q times 1e36 (the Gram holds 1e72)
    w[2] *= 1e200  # beyond float64's Gram: 1e400
    w[3] *= 1e-200  # subnormal squares
    w[4, 3, 7] = float("nan")
    w[5, 0, 0] = float("inf")
    with pytest.raises(RuntimeError):  # what killed training runs: torch's own solver on the NaN head
        torch.linalg.eigvalsh(w[4] @ w[4].T)
    sigma = head_spectral_norms(w)
    exact = [torch.linalg.matrix_norm(w[h] / w[h].abs().max(), ord=2) * w[h].abs().max() for h in range(4)]
    for h in range(4):
        assert float(sigma[h]) == pytest.approx(float(exact[h]), rel=1e-12), h
    assert math.isnan(sigma[4]) and math.isinf(sigma[5]) and sigma[5] > 0
    assert sigma.dtype == torch.float64  # a 1e200 norm is not an fp32 inf


def test_the_collector_turns_non_finite_inputs_into_nan_statistics_and_its_own_failures_into_one_warning():
    from fa_forensics.monitor.collector import StepCollector

    said = []
    collector = StepCollector(warn=lambda key, message: said.append((key, message)))
    attn = torch.nn.Module()
    attn.c_attn = torch.nn.Linear(32, 96)
    with torch.no_grad():
        attn.c_attn.weight[:32] = float("nan")  # W_Q went NaN
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8, generator=g), torch.randn(2, 4, 16, 8, generator=g)
    q[:, :, 3] = float("nan")  # NaN activations in some rows
    collector.begin(5)
    collector.observe_call(0, q, k, scale=None, causal=True, p_dtype=torch.bfloat16, module=attn, module_name="a")
    collector.observe_call(1, q, k[:, :, :, :4], scale=None, causal=True, p_dtype=torch.bfloat16, module=None,
                           module_name="b")  # q and k disagree: the statistics raise inside the monitor
    row = collector.finish()
    assert np.isnan(row["wq_sigma"][0]).all() and np.isnan(row["max_logit"][0]).all()
    assert np.isnan(row["top1_prob"][0]).all() and np.isnan(row["max_logit"][1]).all()  # the failed layer: NaN
    failed = [m for key, m in said if key.startswith("failed:")]
    assert len(failed) == 1 and "layer 1 at step 5 could not be computed" in failed[0], said
    assert "training goes on" in failed[0]
