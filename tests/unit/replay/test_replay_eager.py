"""Attention written as plain tensor ops replayed from its recorded op sequence: captured from hand-written
attentions (minGPT's, einsum in (B, T, H, D), baddbmm over (B·H) with the scale as alpha, ALiBi, an inline
soft-cap, a sliding window, timm's scale on q) in fp32 and under CPU bf16 autocast, the re-execution
(preset eager-reexec) reproduces every stored O bit; the emulator's model (preset eager) reproduces every bit of
the bf16 ones; a CUDA recipe is refused by re-execution with its reason."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fa_forensics
from fa_forensics.dump import open_dump
from fa_forensics.errors import ConfigError
from fa_forensics.fidelity.recipe import Recipe, hp_config, lp_config_for
from fa_forensics.replay import ReplayConfig, replay
from fa_forensics.replay.plain_recipe import PlainRecipe, hf_eager

T, C, H = 20, 32, 4
D = C // H


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def mingpt(q, k, v):
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(~_causal(q.shape[2]), float("-inf"))
    return F.softmax(att, dim=-1) @ v


def einsum_bthd(q, k, v):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, T, H, D)
    att = torch.einsum("bthd,bshd->bhts", q, k) * D ** -0.5
    att = att.masked_fill(~_causal(q.shape[1]), float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", att, v).transpose(1, 2)


def baddbmm_alpha(q, k, v):
    B = q.shape[0]
    q3, k3, v3 = (t.reshape(B * H, T, D) for t in (q, k, v))
    bias = torch.zeros(T, T).masked_fill(~_causal(T), float("-inf")).expand(B * H, T, T)
    att = torch.baddbmm(bias, q3, k3.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(D))
    return torch.bmm(att.softmax(-1), v3).view(B, H, T, D)


def alibi(q, k, v):
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)]).view(1, H, 1, 1)
    pos = torch.arange(T)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    att = att + slopes * (pos.view(1, -1) - pos.view(-1, 1)).clamp(max=0).float()
    att = att.masked_fill(~_causal(T), float("-inf"))
    return F.softmax(att, dim=-1) @ v


def softcap(q, k, v):
    att = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    att = torch.tanh(att / 5.0) * 5.0
    att = att + torch.zeros(T, T).masked_fill(~_causal(T), torch.finfo(torch.float32).min)
    return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)


def sliding_window(q, k, v):
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    allowed = (j <= i) & (j > i - 6)
    att = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    att = att + torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)


def q_scaled(q, k, v):  # timm's Attention with fused_attn off
    q = q * D ** -0.5
    return (q @ k.transpose(-2, -1)).softmax(dim=-1) @ v


FORMS = [mingpt, einsum_bthd, baddbmm_alpha, alibi, softcap, sliding_window, q_scaled]


class Attn(nn.Module):
    def __init__(self, core):
        super().__init__()
        self.core, self.qkv, self.proj = core, nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        B = x.shape[0]
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        return self.proj(self.core(q, k, v).transpose(1, 2).reshape(B, T, C))


def _capture(tmp_path, core, bf16: bool):
    torch.manual_seed(0)
    net = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"attn": Attn(core)})])})
    net.forward = lambda x: net["layers"][0]["attn"](x)
    with fa_forensics.capture(net, out=tmp_path / "run.zarr", steps=[0], batch=None, step_by="manual") as cap:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = net(torch.randn(2, T, C))
        y.float().square().mean().backward()
        cap.step()
    return open_dump(tmp_path / "run.zarr")


def _share(dump, preset: str) -> float:
    info = dump.layer_info(0, 0)
    q, k, v, o = (dump.read(0, 0, n) for n in "qkvo")
    mask = dump.read(0, 0, "mask") if "mask" in info.arrays else None
    config = lp_config_for(dump, 0, 0, Recipe(preset))
    out = replay(q, k, v, config, causal=info.causal, scale=info.scale, mask=mask).o
    return float((out.view(-1) == o.view(-1)).double().mean())


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("core", FORMS, ids=[f.__name__ for f in FORMS])
def test_reexecution_reproduces_every_stored_o_bit(tmp_path, core, bf16):
    dump = _capture(tmp_path, core, bf16)
    recorded = PlainRecipe.from_fact(dump.layer_info(0, 0).call["plain_recipe"])
    assert recorded.device == "cpu" and recorded.threads == torch.get_num_threads()
    assert PlainRecipe.from_fact(recorded.to_fact()) == recorded
    assert _share(dump, "eager-reexec") == 1.0
    if bf16:  # bf16 inputs multiply exactly and their sums are short: the emulator's model holds every bit
        assert _share(dump, "eager") == 1.0


def test_the_recorded_ops_are_replayed_not_the_kernels_form(tmp_path):
    """The soft-cap and the P cast of the recorded ops: the flash emulator's bf16 recipes, which have neither,
    miss bits the re-execution reproduces; the high-precision side keeps the soft-cap."""
    dump = _capture(tmp_path, softcap, bf16=True)
    assert _share(dump, "eager-reexec") == 1.0
    assert _share(dump, "bf16-autocast-cpu") < 0.9
    lp = lp_config_for(dump, 0, 0, Recipe("eager-reexec"))
    assert lp.plain.has_softcap and hp_config(lp).plain == lp.plain and not hp_config(lp).is_low_precision


def test_repairs_change_the_recorded_op_where_it_rounds(tmp_path):
    """P kept in fp32 (isolate's p-fp32) moves O off the stored bits and toward the fp32 replay of the same ops;
    stochastic rounding of the P and O casts gives other bits with another seed."""
    dump = _capture(tmp_path, mingpt, bf16=True)
    info = dump.layer_info(0, 0)
    q, k, v, o = (dump.read(0, 0, n) for n in "qkvo")
    lp = lp_config_for(dump, 0, 0, Recipe("eager-reexec"))
    hp = replay(q, k, v, hp_config(lp), causal=info.causal, scale=info.scale).o.double()

    def run(config):
        return replay(q, k, v, config, causal=info.causal, scale=info.scale).o

    base, p32 = run(lp), run(lp.with_(p_dtype="fp32", o_dtype="fp32"))
    assert torch.equal(base, o)
    assert (p32.double() - hp).abs().mean() < (base.double() - hp).abs().mean()
    s1 = run(lp.with_(rounding="stochastic", seed=1))
    s2 = run(lp.with_(rounding="stochastic", seed=2))
    assert not torch.equal(s1, s2) and (s1.double() - hp).abs().max() < 0.05


def test_reexecution_gradients_are_autograds_through_the_recorded_ops(tmp_path):
    dump = _capture(tmp_path, mingpt, bf16=False)
    info = dump.layer_info(0, 0)
    q, k, v, do = (dump.read(0, 0, n) for n in ("q", "k", "v", "do"))
    out = replay(q, k, v, lp_config_for(dump, 0, 0, Recipe("eager-reexec")), do, causal=info.causal,
                 scale=info.scale)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    mingpt(*leaves).backward(do)
    for got, leaf in zip((out.dq, out.dk, out.dv), leaves):
        assert torch.equal(got, leaf.grad)


def test_a_cuda_recipe_is_refused_by_reexecution_with_its_reason():
    recipe = PlainRecipe(hf_eager().ops, device="cuda")
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ConfigError, match="ran on cuda.*preset eager"):
        replay(q, q, q, ReplayConfig.preset("eager-reexec").with_(plain=recipe), causal=True)
    emulated = replay(q, q, q, ReplayConfig.preset("eager").with_(plain=recipe), causal=True).o
    assert emulated.shape == q.shape and torch.isfinite(emulated.float()).all()


@pytest.mark.parametrize("fact, message", [
    ({"ops": []}, "not product"),
    ({"ops": [{"op": "matmul", "in": ["float32"], "out": "float32"}, {"op": "exp", "in": [], "out": "float32"}]},
     "ops\\[1\\]"),
    ({"ops": [{"op": "matmul", "in": ["float32"], "out": "int8"}]}, "ops\\[0\\].out"),
    ("matmul softmax matmul", "not an object"),
])
def test_a_malformed_recipe_fact_is_named(fact, message):
    with pytest.raises(ConfigError, match=message):
        PlainRecipe.from_fact(fact)
