"""The compiled elementwise stages of the emulator (replay/emulate/fused.py) against its torch path, bit for bit
(a replay under Engine.COMPILED against one under Engine.SPEC): every preset, both accumulation models, causal or
not, masks, ties, every knob."""
import zlib

import numba
import numpy as np
import pytest
import torch

from fa_forensics.enums import Engine
from fa_forensics.numerics import exp_fp32, round_to
from fa_forensics.numerics.engines import use_engine
from fa_forensics.numerics.scalar_jit import exp32, format_code, round_ne
from fa_forensics.replay import ReplayConfig, replay
from fa_forensics.replay.config import PRESETS
from fa_forensics.replay.emulate import fused

_FIELDS = ("o", "lse", "delta", "dq", "dk", "dv")
_STATS = ("repeated_max_rows", "p_one_count", "stabilized_rows", "p_zeroed", "rows")


@numba.njit
def _round_all(x, out, man_bits, emin, max_value, saturates):
    for i in range(x.shape[0]):
        out[i] = round_ne(x[i], man_bits, emin, max_value, saturates)


@numba.njit
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = exp32(x[i])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float().contiguous(), b.float().contiguous()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))).all())


def test_scalar_cast_is_round_to_nearest_even_for_every_format():
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31 - 1, (300_000,), generator=g, dtype=torch.int64).to(torch.int32)
    wide = torch.randn(300_000, generator=g) * torch.exp2(torch.randint(-150, 128, (300_000,), generator=g).float())
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, 464.0, 465.0, -480.0,
                          57344.0, 61440.0, 65504.0, 65520.0, -65519.0, 3.3895e38, 3.39e38, 1e-40, -1e-45, 2.0**-133])
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    # fp8 values, midpoints, neighbours
    ties = torch.cat([e4m3, e4m3 + e4m3 * 2.0**-4, torch.nextafter(e4m3, torch.tensor(1e30))])
    x = torch.cat([random_bits.view(torch.float32), wide, edges, ties, -ties])
    for fmt in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp32"):
        got = np.empty(x.shape[0], np.float32)
        _round_all(x.numpy(), got, *format_code(fmt))
        assert _same_bits(torch.from_numpy(got), round_to(x, fmt)), fmt


def test_scalar_exp_is_exp_fp32():
    """Every fp32 argument agrees (checked exhaustively, 4.28e9 values, on the development
    machine); here a sample of 2 million, the arguments near 0 and the edges of the range checks."""
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.rand(2_000_000, generator=g) * 193 - 104,
                   torch.arange(-2**20, 2**20, dtype=torch.int32).view(torch.float32),  # ±tiny around 0
                   torch.tensor([float("-inf"), float("inf"), float("nan"), -104.0, 88.72, 89.0, -110.0, -103.97,
                                 88.7228394, 88.7228317, 89.0001, -110.0001, 1e30, -1e30])])
    got = np.empty(x.shape[0], np.float32)
    _exp_all(x.numpy(), got)
    assert _same_bits(torch.from_numpy(got), exp_fp32(x))


def _replay_both(cfg, q, k, v, do, causal, mask=None):
    """(compiled stages, torch path) replays of one configuration."""
    assert fused.eligible(cfg, q, k, v, do, scale=q.shape[-1] ** -0.5)
    fast = replay(q, k, v, cfg, do=do, causal=causal, mask=mask, engine=Engine.COMPILED)
    ref = replay(q, k, v, cfg, do=do, causal=causal, mask=mask, engine=Engine.SPEC)
    return fast, ref


def _assert_identical(fast, ref, label):
    for f in _FIELDS:
        assert _same_bits(getattr(fast, f), getattr(ref, f)), (label, f)
    for f in _STATS:
        assert torch.equal(getattr(fast.stats, f), getattr(ref.stats, f)), (label, f)


def _inputs(seed: int, T: int = 80, D: int = 16, H: int = 2, ties: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, H, T, D, generator=g) * s for s in (3.0, 3.0, 1.0, 1.0))
    if ties:  # coarse scores: repeated row maxima and exact ties
        q, k = torch.round(q * 2) / 2, torch.round(k * 2) / 2
    return q, k, v, do


@pytest.mark.parametrize("name", [p for p in PRESETS if p != "stochastic"])
def test_fused_stages_equal_the_torch_path_on_every_preset(name):
    q, k, v, do = _inputs(zlib.crc32(name.encode()))
    for acc in ("ieee", "tensor-core"):
        for causal in (True, False):
            cfg = ReplayConfig.preset(name).with_(accumulation=acc)
            if cfg.block_n is None or cfg.block_n > 32:
                cfg = cfg.with_(block_m=32, block_n=32)  # several blocks at this small T
            _assert_identical(*_replay_both(cfg, q, k, v, do, causal), (name, acc, causal))


_KNOBS = [
    dict(softmax="stabilized"),
    dict(softmax="stabilized", s_dtype="bf16", stats_dtype="bf16", masked_blocks="visit", row_sum_floor=1e-10),
    dict(softmax="fixed-offset", offset=3.0),
    dict(p_scale=256.0, p_scale_mode="multiply", p_dtype="fp8_e4m3"),
    dict(p_scale=448.0, p_dtype="fp8_e4m3", pv_dtype="fp32"),
    dict(delta="o-highp"), dict(delta="o-recomputed"), dict(delta="dp-p"), dict(delta_dtype="bf16"),
    dict(kv_order="reverse", block_n=24),
    dict(masked_blocks="visit"),
    dict(input_dtype="fp16", p_dtype="fp16", pv_dtype="fp16", o_dtype="fp16"),
    dict(p_dtype="fp8_e5m2", ds_dtype="bf16", dp_dtype="bf16", rescale_dtype="bf16"),
    dict(ds_alpha=True, grad_dtype="bf16"),
]


# about 3 s of CPU or more each
_SLOW_KNOBS = (dict(softmax="stabilized"), dict(p_scale=256.0, p_scale_mode="multiply", p_dtype="fp8_e4m3"))


@pytest.mark.parametrize("knob_index", [
    pytest.param(i, id=",".join(f"{k}={v}" for k, v in kn.items()), marks=pytest.mark.slow if kn in _SLOW_KNOBS else ())
    for i, kn in enumerate(_KNOBS)])
def test_fused_stages_equal_the_torch_path_for_every_knob_with_masks_and_ties(knob_index):
    knobs = _KNOBS[knob_index]
    g = torch.Generator().manual_seed(7)
    T = 64
    allowed = torch.rand(1, 1, T, T, generator=g) > 0.3
    allowed[..., :3, :] = False  # rows that see no key at all
    masks = [None, allowed, torch.where(allowed, torch.randn(1, 1, T, T, generator=g), torch.tensor(float("-inf"))),
             torch.where(allowed, 0.0, torch.finfo(torch.float32).min)]
    cfg = ReplayConfig.preset("bf16").with_(**{"block_m": 32, "block_n": 32, **knobs})
    for ties in (False, True):
        q, k, v, do = _inputs(3, T=T, ties=ties)
        for i, mask in enumerate(masks):
            causal = (i + knob_index) % 2 == 0  # every mask with and without causal, across the knobs
            _assert_identical(*_replay_both(cfg, q, k, v, do, causal, mask), (knobs, ties, i))


@pytest.mark.parametrize("acc", ["ieee", "tensor-core"])
def test_fused_stages_skip_unseen_keys_in_one_kv_block_and_in_row_blocks(acc):
    """The default shape of work (one KV block, the backward in blocks of query rows): causal
    products skip the keys a row cannot see, bit for bit the torch path's full products."""
    from fa_forensics.replay.emulate.run import StreamPlan, emulate_replay

    q, k, v, do = _inputs(11, T=100, H=3, ties=True)
    g = torch.Generator().manual_seed(12)
    allowed = torch.rand(1, 1, 100, 100, generator=g) > 0.3
    masks = [None, allowed, torch.where(allowed, torch.randn(1, 1, 100, 100, generator=g), torch.tensor(float("-inf")))]
    cases = [("bf16", "o-lowp", masks[0]), ("bf16", "dp-p", masks[1]), ("fp8-s448", "o-lowp", masks[2]),
             ("bf16-autocast-train", "o-lowp", masks[1])]
    for name, delta, mask in cases:
        cfg = ReplayConfig.preset(name).with_(accumulation=acc, delta=delta)
        for plan in (StreamPlan(heads=3, block_m=None), StreamPlan(heads=2, block_m=32)):
            runs = [emulate_replay(q, k, v, cfg, do, causal=True, scale=0.25, plan=plan, mask=mask, engine=engine)
                    for engine in (Engine.COMPILED, Engine.SPEC)]
            _assert_identical(*runs, (name, delta, plan))


@pytest.mark.parametrize("acc", ["ieee", "tensor-core"])
def test_a_shift_below_the_row_maximum_that_overflows_p_bar_gives_the_torch_paths_bits(acc):
    """A fixed offset below 0 shifts by less than the maximum: exp overflows to inf on large scores,
    and the products that take such a P̄ must not skip their finiteness check."""
    q, k, v, do = _inputs(17, T=48)
    cfg = ReplayConfig.preset("bf16").with_(softmax="fixed-offset", offset=-100.0, accumulation=acc)
    assert not fused.p_bar_bounded(cfg)
    fast, ref = _replay_both(cfg, q, k, v, do, True)
    assert bool(torch.isnan(ref.o).any() | torch.isinf(ref.o).any())
    _assert_identical(fast, ref, acc)


def test_the_torch_path_runs_where_the_compiled_stages_do_not_apply():
    q, k, v, do = _inputs(5)
    scale = q.shape[-1] ** -0.5
    with use_engine(Engine.SPEC):
        assert not fused.eligible(ReplayConfig(), q, k, v, do, scale=scale)
    for bad in (float("inf"), float("nan")):  # where the torch path's −inf + inf is NaN
        mask = torch.zeros(1, 1, q.shape[2], q.shape[2])
        mask[..., 0, 5] = bad
        assert not fused.eligible(ReplayConfig(), q, k, v, do, scale=scale, mask=mask)
    assert fused.eligible(ReplayConfig(), q, k, v, do, scale=scale, mask=torch.full((1, 1, 80, 80), float("-inf")))
    assert not fused.eligible(ReplayConfig.preset("stochastic"), q, k, v, do, scale=scale)
    huge = q.clone()
    huge[0, 0, 0, 0] = 3e38
    assert not fused.eligible(ReplayConfig(), huge, k, v, do, scale=scale)
    inf = q.clone()
    inf[0, 1, 2, 3] = float("inf")
    assert not fused.eligible(ReplayConfig(), inf, k, v, do, scale=scale)
    assert fused.eligible(ReplayConfig(), q, k, v, do, scale=scale)
