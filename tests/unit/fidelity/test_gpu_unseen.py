"""The kernel models on launches they were not fitted to, recorded on an H200 after the models were written
(tests/data/h200_unseen, see its README): a non-causal head-dim-64 bf16 launch, a causal head-dim-128 fp16 one,
and SDPA inside torch.compile choosing its own backend. O, lse and dQ of the kept rows are replayed from the
recorded inputs (dQ from the kernel's recorded O and lse); the shares asserted are the measured ones rounded down.
The memory-efficient kernel's backward without a mask is checked on every row of the non-causal launch's head
(tests/data/h200_bwd/d64_bfloat16_full_rows adds rows 0..959), where its key splits set the order of every sum.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.emulate.backward_kernels import kernel_backward
from fa_forensics.replay.emulate.efficient_schedule import backward_tile, key_splits
from fa_forensics.replay.emulate.forward import forward
from fa_forensics.replay.gpu_fidelity import kernel_preset, read_tensors

DATA = Path(__file__).resolve().parents[2] / "data" / "h200_unseen"
# (set, kernel) -> (O share, dQ share) floors; None: not recorded
FLOORS = {
    ("d64_bfloat16_full", "cudnn"): (1.0, 1.0),
    ("d64_bfloat16_full", "efficient"): (1.0, 1.0),
    ("d64_bfloat16_full", "flash"): (1.0, 1.0),
    ("d128_float16_causal", "cudnn"): (1.0, 0.998),
    ("d128_float16_causal", "efficient"): (1.0, 1.0),
    ("d128_float16_causal", "flash"): (1.0, 1.0),
    ("compiled", "cudnn"): (1.0, None),
}


def _load(tag: str, data: Path = DATA):
    tensors, metadata = read_tensors(data / f"{tag}.safetensors.xz")
    return tensors, json.loads(metadata["layout"])


def _share(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.to(b.dtype) == b).double().mean().item()


@pytest.mark.parametrize("tag,kernel", sorted(FLOORS), ids=[f"{t}-{k}" for t, k in sorted(FLOORS)])
def test_unseen_launch_reproduced(tag, kernel):
    t, layout = _load(tag)
    g = lambda name: t[f"{tag}.{name}"]  # noqa: E731
    q, k, v = g("q").float(), g("k").float(), g("v").float()
    r0, _ = layout["o_rows"]
    name = kernel_preset(kernel, q.shape[-1], layout["dtype"], layout["launch_batch"], layout["launch_heads"],
                         layout["T_recorded"])
    config = ReplayConfig.preset(name)
    causal = layout["causal"]
    fwd = forward(q, k, v, config, causal=causal, scale=layout["scale"], generator=None, row0=r0)
    o_floor, dq_floor = FLOORS[tag, kernel]
    assert _share(fwd.o, g(f"{kernel}.o")) >= o_floor
    if f"{tag}.{kernel}.lse" in t:  # every lse is modelled bit for bit (flash: __logf of ℓ, split-KV combine
        # with expf / logf; efficient: logf of ℓ summed per thread, quad and warp tile; cuDNN: __logf of ℓ summed
        # per thread and fused into the rescale)
        assert _share(fwd.lse, g(f"{kernel}.lse").float()) == 1.0
    if dq_floor is not None:
        _, dq, _, _ = kernel_backward(q, k, v, g("do").float(), g(f"{kernel}.o").float(), g(f"{kernel}.lse").float(),
                                      config, causal=causal, scale=layout["scale"], row0=r0)
        assert _share(dq, g(f"{kernel}.dq")) >= dq_floor


def test_the_compiled_run_chose_cudnn():
    """SDPA under torch.compile on the H200 picked cuDNN for bf16 causal inputs, as it does eagerly."""
    _, layout = _load("compiled")
    assert layout["kernels"] == ["cudnn"]


@pytest.mark.parametrize("kernel", ["cudnn", "efficient", "flash"])
def test_dk_dv_of_a_key_block_at_head_dim_128_in_fp16(kernel):
    """dK and dV of keys 832..895 of the causal head-dim-128 fp16 launch, from the kernel's own O and lse, bit for
    bit. Only rows 832.. see those keys, and P of a row needs only these keys' scores and the row's lse, so the keys
    before 832 are zeros here (they change dQ, which is not compared). cuDNN's P needs its fused multiply-add
    fma(S, α, −lse): with fp32(S·α) − lse, 18 elements of this block's dV differ (α = 128^-1/2 is not a power
    of two)."""
    tag = "d128_float16_causal"
    tensors, metadata = read_tensors(DATA / f"{tag}_keys832.safetensors.xz")
    layout = json.loads(metadata["layout"])
    g = lambda name: tensors[f"{tag}.{name}"]  # noqa: E731
    j0, j1 = layout["dkdv_keys"]
    assert layout["q_rows"] == [j0, layout["T"]] and layout["causal"]
    k, v = (torch.nn.functional.pad(g(n).float(), (0, 0, j0, 0)) for n in ("k", "v"))  # keys 0..j0-1 as zeros
    config = ReplayConfig.preset(kernel_preset(kernel, 128, "float16", 1, 1, layout["T"]))
    _, _, dk, dv = kernel_backward(g("q").float(), k, v, g("do").float(), g(f"{kernel}.o").float(),
                                   g(f"{kernel}.lse").float(), config, causal=True, scale=layout["scale"], row0=j0)
    assert torch.equal(dk[..., j0:j1, :].to(torch.float16), g(f"{kernel}.dk"))
    assert torch.equal(dv[..., j0:j1, :].to(torch.float16), g(f"{kernel}.dv"))


def _efficient_nomask_backward(**changes):
    """The memory-efficient backward model on every row of head 0 of the non-causal d64 bf16 launch, from the
    kernel's recorded O and lse, with the launch's key splits (or `changes`); returns ({gradient: share of
    recorded bits reproduced}, the split count)."""
    tag = "d64_bfloat16_full"
    last, layout = _load(tag)
    first, kept = _load(f"{tag}_rows", DATA.parent / "h200_bwd")
    assert kept["q_rows"][1] == layout["q_rows"][0] and layout["q_rows"][1] == layout["T_recorded"]
    rows = lambda name: torch.cat([first[f"{tag}.{name}"], last[f"{tag}.{name}"]], dim=2).float()  # noqa: E731
    q, do, o = rows("q"), rows("do"), rows("efficient.o")
    lse = torch.cat([first[f"{tag}.efficient.lse"], last[f"{tag}.efficient.lse"]], dim=-1).float()
    k, v = last[f"{tag}.k"].float(), last[f"{tag}.v"].float()
    splits = key_splits(layout["launch_batch"], layout["launch_heads"], k.shape[2], backward_tile(k.shape[3]))
    config = ReplayConfig.preset("sdpa-efficient").with_(**{"bwd_key_splits": splits, **changes})
    _, dq, dk, dv = kernel_backward(q, k, v, do, o, lse, config, causal=False, scale=layout["scale"])
    keys = [j for a, b in kept["dkdv_keys"] for j in range(a, b)]
    (r0, r1), (l0, l1) = kept["dq_rows"], layout["dq_rows"]
    # the dQ of rows r0..r1 alone: those rows placed in the launch's T queries, which set the CTAs' walks
    _, dq_rows, _, _ = kernel_backward(q[:, :, r0:r1], k, v, do[:, :, r0:r1], o[:, :, r0:r1], lse[:, :, r0:r1],
                                       config, causal=False, scale=layout["scale"], row0=r0,
                                       num_queries=layout["T_recorded"])
    got = {"dq": dq[:, :, r0:r1], "dq_last": dq[:, :, l0:l1], "dk": dk[:, :, keys], "dv": dv[:, :, keys],
           "dq_of_the_rows_alone": dq_rows}
    want = {"dq": first[f"{tag}.efficient.dq"], "dq_last": last[f"{tag}.efficient.dq"],
            "dk": first[f"{tag}.efficient.dk"], "dv": first[f"{tag}.efficient.dv"],
            "dq_of_the_rows_alone": first[f"{tag}.efficient.dq"]}
    return {name: _share(got[name], want[name]) for name in got}, splits


def test_the_efficient_backward_without_a_mask_follows_the_key_splits():
    """Without a mask the memory-efficient backward splits the keys over 16 CTAs per head (one 64-key block
    each); CTA s walks the query blocks from block s, wrapping around, and a query block's dQ is summed in the
    order the CTAs reach it. Key blocks 5 and 10 (dK, dV) and query block 5 (dQ) are reproduced bit for bit, the
    latter also from its 64 rows alone placed in the launch's 1024 queries (num_queries); one CTA per head
    (deterministic mode's schedule: every walk ascending) misses some of each."""
    shares, splits = _efficient_nomask_backward()
    assert splits == 16
    assert shares == {"dq": 1.0, "dq_last": 1.0, "dk": 1.0, "dv": 1.0, "dq_of_the_rows_alone": 1.0}
    one_cta, _ = _efficient_nomask_backward(bwd_key_splits=1)
    assert max(one_cta.values()) < 0.9995, one_cta
