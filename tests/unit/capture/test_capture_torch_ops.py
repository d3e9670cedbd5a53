"""Attention written as plain torch ops, found without flags on recorded steps: nanoGPT's manual path
(tests/data/plain_attention), Hugging Face GPT-2 and Llama (grouped-query heads) with
attn_implementation="eager" built from small configs, timm's non-fused Attention, and the forms the
products take (einsum with any output order, bmm over (B·H), baddbmm). Stored Q, K, V, O are the
tensors the model's products got and made (O bit for bit), dO the gradient of that O; the losses of
a run are bit-equal with and without capture; steps that are not recorded run without the mode."""
from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_hf import padded_batch, tiny_gpt2, tiny_llama

import fa_forensics
from fa_forensics.dump import open_dump

DATA = Path(__file__).resolve().parents[2] / "data"
T = 16


@pytest.fixture
def nanogpt(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA / "plain_attention"))
    yield importlib.import_module("nanogpt_manual")
    sys.modules.pop("nanogpt_manual", None)


def _modes() -> int:
    return len(torch.overrides._get_current_function_mode_stack())


# -- nanoGPT's manual attention ------------------------------------------------------------------------
def test_nanogpt_manual_path_is_recorded_with_its_dropout_and_o_bit_for_bit(tmp_path, nanogpt):
    plain = nanogpt.train(3, dropout=0.1)
    torch.manual_seed(0)
    model = nanogpt.GPT(dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    seen, modes, losses = {}, [], []
    model.register_forward_pre_hook(lambda m, a: modes.append(_modes()))
    with fa_forensics.capture(model, out=tmp_path / "run.zarr", steps=[1], batch=None):
        for it in range(3):
            idx = torch.randint(0, 64, (2, 24), generator=gen)
            loss = model(idx, idx.roll(-1, 1))
            blocks = [b.attn.last for b in model.transformer.h]
            for b in blocks:
                b["y"].retain_grad()
            loss.backward()
            if it == 1:
                seen = [{n: t.detach().clone() for n, t in b.items()} | {"dy": b["y"].grad.clone()} for b in blocks]
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    assert losses == plain  # capture changes nothing training computes, dropout's random numbers included
    assert modes == [0, 0, 0]  # the mode is pushed by the root's own hook, after the hooks registered before it
    assert _modes() == 0
    d = open_dump(tmp_path / "run.zarr")
    assert d.steps == [1] and d.layers() == [0, 1]
    for layer, s in enumerate(seen):
        attrs = dict(d._layer(1, layer).attrs)
        assert attrs["source"] == "torch_ops" and attrs["softmax"] == "standard" and attrs["causal"] is True
        assert attrs["module"] == f"transformer.h.{layer}.attn" and attrs["layout"] == "BHTD"
        assert attrs["dropout_p"] == pytest.approx(0.1) and attrs["scale"] == pytest.approx(1 / math.sqrt(8))
        assert attrs["chain"] == "matmul mul masked_fill softmax dropout matmul"
        assert "mask" not in d._array_names(1, layer)  # the causal bias buffer is recorded as causal
        for name in "qkv":
            assert torch.equal(d.read(1, layer, name), s[name])
        assert torch.equal(d.read(1, layer, "o"), s["y"])  # with dropout: what the model computed
        assert torch.equal(d.read(1, layer, "do"), s["dy"])


def test_steps_not_recorded_run_without_the_mode(tmp_path, nanogpt):
    model = nanogpt.GPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    modes = []
    model.transformer.h[0].attn.register_forward_pre_hook(lambda m, a: modes.append(_modes()))
    with fa_forensics.capture(model, out=tmp_path / "run.zarr", steps=[1], batch=None):
        for _ in range(3):
            idx = torch.randint(0, 64, (2, 24))
            model(idx, idx).backward()
            with torch.no_grad():  # evaluation on a recorded step: no mode either
                model(idx, idx)
            opt.step()
    assert modes == [0, 0, 1, 0, 0, 0]


# -- Hugging Face eager -----------------------------------------------------------------------------------
def _spy_eager(monkeypatch, module_path):
    """Wrap the model file's eager function: what it returned (O, (B, T, H, D)) and that O's gradient."""
    module = importlib.import_module(module_path)
    original = module.eager_attention_forward
    calls = []

    def spy(attn_module, query, key, value, attention_mask, **kwargs):
        out, weights = original(attn_module, query, key, value, attention_mask, **kwargs)
        entry = {"q": query.detach(), "k": key.detach(), "mask": attention_mask, "o": out.detach().clone()}
        if out.requires_grad:
            out.register_hook(lambda g, entry=entry: entry.__setitem__("do", g.clone()))
        calls.append(entry)
        return out, weights

    monkeypatch.setattr(module, "eager_attention_forward", spy)
    return calls


def _train_hf(model, steps, session=None, padded=True):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, attention_mask = padded_batch(T)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=attention_mask if padded else None, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _eager_o(q, k, v, scale, mask):
    """HF's eager chain on the stored tensors under bf16 autocast: the bits the model computed."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask is not None:
            s = s + mask
        return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype), v)


@pytest.mark.parametrize("padded", [False, True])
def test_hf_gpt2_eager_is_recorded_bit_for_bit_with_its_mask(tmp_path, monkeypatch, padded):
    calls = _spy_eager(monkeypatch, "transformers.models.gpt2.modeling_gpt2")
    plain = _train_hf(tiny_gpt2(T, implementation="eager"), 2, padded=padded)
    calls.clear()
    model = tiny_gpt2(T, implementation="eager")
    with fa_forensics.capture(model, out=tmp_path / "run.zarr", steps=[1], batch=None):
        captured = _train_hf(model, 2, padded=padded)
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))
    d = open_dump(tmp_path / "run.zarr")
    assert d.steps == [1] and d.layers() == [0, 1]
    for layer, call in enumerate(calls[2:]):  # the calls of step 1
        attrs = dict(d._layer(1, layer).attrs)
        assert attrs["source"] == "torch_ops" and attrs["hf_attention"] == "eager"
        assert attrs["module"] == f"transformer.h.{layer}.attn" and attrs["scale"] == 0.25
        assert (attrs["score_dtype"], attrs["softmax_dtype"], attrs["p_dtype"]) == ("bfloat16", "float32", "bfloat16")
        q, k, v, o = (d.read(1, layer, n) for n in "qkvo")
        assert torch.equal(q, call["q"]) and torch.equal(k, call["k"])
        assert torch.equal(o, call["o"].transpose(1, 2)) and torch.equal(d.read(1, layer, "do"),
                                                                         call["do"].transpose(1, 2))
        if padded:  # rows of the padding see no key: the mask stays additive, HF's own values
            assert attrs["causal"] is False and attrs["mask"] == "additive"
            assert torch.equal(d.read(1, layer, "mask"), call["mask"])
            assert torch.equal(_eager_o(q, k, v, attrs["scale"], d.read(1, layer, "mask")), o)
        else:
            assert attrs["causal"] is True and "mask" not in d._array_names(1, layer)
            assert torch.equal(_eager_o(q, k, v, attrs["scale"], call["mask"]), o)


def test_hf_llama_eager_grouped_query_heads(tmp_path, monkeypatch):
    calls = _spy_eager(monkeypatch, "transformers.models.llama.modeling_llama")
    model = tiny_llama(T, implementation="eager")
    with fa_forensics.capture(model, out=tmp_path / "run.zarr", steps=[0], batch=None):
        _train_hf(model, 1, padded=False)
    d = open_dump(tmp_path / "run.zarr")
    for layer, call in enumerate(calls):
        attrs = dict(d._layer(0, layer).attrs)
        assert attrs["module"] == f"model.layers.{layer}.self_attn" and attrs["n_heads"] == 4
        assert attrs["causal"] is True and attrs["hf_attention"] == "eager" and attrs["dtype"] == "bfloat16"
        q, k, v, o = (d.read(0, layer, n) for n in "qkvo")
        assert call["k"].shape == (2, 2, T, 8) and k.shape == (2, 4, T, 8)  # 2 K/V heads, one per query head stored
        assert torch.equal(k[:, 0], k[:, 1]) and torch.equal(k[:, 2], k[:, 3]) and not torch.equal(k[:, 0], k[:, 2])
        assert torch.equal(k[:, ::2], call["k"].to(torch.bfloat16))
        assert torch.equal(o, call["o"].transpose(1, 2)) and torch.equal(d.read(0, layer, "do"),
                                                                         call["do"].transpose(1, 2))


# -- timm's non-fused Attention ------------------------------------------------------------------------------
@pytest.fixture
def timm_attention(monkeypatch):
    """timm's Attention class, non-fused (TIMM_FUSED_ATTN=0). timm's package __init__ imports torchvision, whose
    PyPI build needs a CUDA torch; timm's attention module does not, so where `import timm` fails it is loaded
    from timm's own files without running the package __init__ files."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install --no-deps timm)")
    monkeypatch.setenv("TIMM_FUSED_ATTN", "0")
    before = set(sys.modules)
    try:
        from timm.layers import Attention
    except Exception:
        for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("timm")
        for name, path in (("timm", spec.submodule_search_locations[0]),
                           ("timm.layers", spec.submodule_search_locations[0] + "/layers")):
            shell = types.ModuleType(name)
            shell.__path__ = [path]
            sys.modules[name] = shell
        Attention = importlib.import_module("timm.layers.attention").Attention
    yield Attention
    for name in set(sys.modules) - before:
        if name == "timm" or name.startswith("timm."):
            del sys.modules[name]


def test_timm_non_fused_attention_records_the_scaled_q(tmp_path, timm_attention):
    class ViT(nn.Module):
        def __init__(self, dim=48, heads=3):
            super().__init__()
            self.embed = nn.Linear(12, dim)
            self.blocks = nn.ModuleList([nn.ModuleDict({"norm": nn.LayerNorm(dim),
                                                        "attn": timm_attention(dim, num_heads=heads, attn_drop=0.0)})
                                         for _ in range(2)])
            self.head = nn.Linear(dim, 5)

        def forward(self, x):
            x = self.embed(x)
            for b in self.blocks:
                x = x + b["attn"](b["norm"](x))
            return self.head(x.mean(1))

    torch.manual_seed(0)
    model = ViT()
    assert model.blocks[0]["attn"].fused_attn is False
    proj_in = {}
    for i, b in enumerate(model.blocks):
        def keep(m, args, i=i):
            args[0].retain_grad()
            proj_in[i] = args[0]
        b["attn"].proj.register_forward_pre_hook(keep)
    x, y = torch.randn(2, T, 12), torch.tensor([1, 3])
    with fa_forensics.capture(model, out=tmp_path / "run.zarr", steps=[0], batch=None, step_by="manual") as cap:
        F.cross_entropy(model(x), y).backward()
        cap.step()
    d = open_dump(tmp_path / "run.zarr")
    for layer in (0, 1):
        attrs = dict(d._layer(0, layer).attrs)
        assert attrs["module"] == f"blocks.{layer}.attn" and attrs["causal"] is False and attrs["n_heads"] == 3
        assert attrs["scale"] == 1.0 and attrs["q_scale"] == pytest.approx(16 ** -0.5)  # timm scales q first
        assert attrs["chain"] == "matmul softmax dropout matmul"
        q, k, v, o = (d.read(0, layer, n) for n in "qkvo")
        # O as the model's projection got it: (B, T, H·D) back to (B, H, T, D)
        assert torch.equal(o, proj_in[layer].detach().view(2, T, 3, 16).transpose(1, 2))
        assert torch.equal(d.read(0, layer, "do"), proj_in[layer].grad.view(2, T, 3, 16).transpose(1, 2))
        assert torch.equal(torch.softmax(q @ k.transpose(-1, -2), -1) @ v, o)


# -- the forms of the products --------------------------------------------------------------------------------
class Custom(nn.Module):
    """Attention module whose core is `core(q, k, v)`, q, k, v (B, H, T, D) from X; it keeps what core returned."""

    def __init__(self, core, C=16, H=2):
        super().__init__()
        self.core, self.H, self.qkv, self.proj = core, H, nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        B, T_, C = x.shape
        q, k, v = (t.view(B, T_, self.H, C // self.H).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        o, native = self.core(q, k, v)
        native.retain_grad()
        self.seen = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "native": native}
        return self.proj(o)


def _record(tmp_path, core, T_=12):
    torch.manual_seed(0)
    net = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"attn": Custom(core)})])})
    net.forward = lambda x: net["layers"][0]["attn"](x)
    with fa_forensics.capture(net, out=tmp_path / "run.zarr", steps=[0], batch=None, step_by="manual") as cap:
        net(torch.randn(3, T_, 16)).square().mean().backward()
        cap.step()
    return net["layers"][0]["attn"].seen, open_dump(tmp_path / "run.zarr")


def test_einsum_with_a_bthd_output_is_stored_as_bhtd(tmp_path):
    def core(q, k, v):
        s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
        o = torch.einsum("bhij,bhjd->bihd", s.softmax(-1), v)  # (B, T, H, D)
        return o.reshape(*o.shape[:2], -1), o

    seen, d = _record(tmp_path, core)
    attrs = dict(d._layer(0, 0).attrs)
    assert attrs["layout"] == "BTHD" and attrs["chain"] == "einsum div softmax einsum" and attrs["causal"] is False
    assert attrs["scale"] == pytest.approx(1 / math.sqrt(8))
    assert torch.equal(d.read(0, 0, "o"), seen["native"].detach().transpose(1, 2))
    assert torch.equal(d.read(0, 0, "do"), seen["native"].grad.transpose(1, 2))


def test_bmm_over_folded_heads_is_split_by_x_and_baddbmm_bias_kept(tmp_path):
    bias = torch.linspace(-1, 1, 12 * 12).view(1, 12, 12)

    def core(q, k, v):  # torch.nn.MultiheadAttention's way: (B·H, T, D), q scaled first, the bias through baddbmm
        B, H, T_, D = q.shape
        q3, k3, v3 = (t.reshape(B * H, T_, D) for t in (q, k, v))
        s = torch.baddbmm(bias.expand(B * H, T_, T_), q3 * D ** -0.5, k3.transpose(1, 2))
        o = torch.bmm(F.softmax(s, dim=-1), v3)
        return o.view(B, H, T_, D).transpose(1, 2).reshape(B, T_, H * D), o

    seen, d = _record(tmp_path, core)
    attrs = dict(d._layer(0, 0).attrs)
    assert attrs["layout"] == "(B*H)TD" and attrs["n_heads"] == 2 and attrs["mask"] == "additive"
    assert attrs["q_scale"] == pytest.approx(8 ** -0.5) and attrs["scale"] == 1.0
    assert torch.equal(d.read(0, 0, "k"), seen["k"]) and d.read(0, 0, "mask").shape == (1, 1, 12, 12)
    assert torch.equal(d.read(0, 0, "mask")[0, 0], bias[0])
    assert torch.equal(d.read(0, 0, "o"), seen["native"].detach().view(3, 2, 12, 8))
    assert torch.equal(d.read(0, 0, "do"), seen["native"].grad.view(3, 2, 12, 8))


def test_where_with_the_lowest_value_and_a_padding_mask_combine(tmp_path):
    keep = torch.ones(3, 1, 1, 12, dtype=torch.bool)
    keep[2, ..., :4] = False

    def core(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.3
        s = torch.where(torch.ones(12, 12, dtype=torch.bool).tril(), s, torch.finfo(s.dtype).min)
        s = s.masked_fill(~keep, float("-inf"))
        o = s.softmax(dim=-1) @ v
        return o.transpose(1, 2).reshape(3, 12, 16), o

    seen, d = _record(tmp_path, core)
    attrs = dict(d._layer(0, 0).attrs)
    mask = d.read(0, 0, "mask")
    # rows 0-3 of sample 2 see no key: in the model a uniform softmax over the keys filled with the lowest
    # value, so the mask stays additive with the model's own fill values
    assert attrs["causal"] is False and attrs["mask"] == "additive" and mask.shape == (3, 1, 12, 12)
    lowest, tril = torch.finfo(torch.float32).min, torch.ones(12, 12, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], torch.zeros(12, 12).masked_fill(~tril, lowest))
    assert torch.isneginf(mask[2, 0, :, :4]).all()
    q, k, v, o = (d.read(0, 0, n) for n in "qkvo")
    assert torch.equal(o, seen["native"].detach())
    assert torch.equal(torch.softmax(q @ k.transpose(-1, -2) * attrs["scale"] + mask, -1) @ v, o)


def test_softmax_of_a_router_is_not_attention(tmp_path):
    def core(q, k, v):  # 2-D weights and a softmax over experts: no attention chain
        logits = q.reshape(-1, 8) @ torch.ones(8, 4)
        o = (logits.softmax(-1) @ torch.ones(4, 8)).view_as(q)
        return o.transpose(1, 2).reshape(3, 12, 16), o

    with pytest.warns(fa_forensics.capture.events.CaptureWarning, match="no attention call was seen"):
        _, d = _record(tmp_path, core)
    assert d.steps == []


# -- the recipe as facts ------------------------------------------------------------------------------------
def test_the_op_sequence_is_recorded_with_dtypes_scale_softcap_and_window(tmp_path):
    """Gemma 2's eager attention written inline under CPU bf16 autocast: the ops in order with the dtypes they
    computed in, the factors with their numbers, the soft-cap, the sliding window, the softmax's dtype and the
    cast of P, the device, torch's version and the thread count."""
    def core(q, k, v):
        T_ = q.shape[2]
        i, j = torch.arange(T_).view(T_, 1), torch.arange(T_).view(1, T_)
        blocked = ~((j <= i) & (j > i - 4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s = torch.matmul(q, k.transpose(2, 3)) * 0.25
            s = torch.tanh(s / 5.0) * 5.0
            s = s + torch.zeros(T_, T_).masked_fill(blocked, torch.finfo(torch.float32).min)
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(p, v)
        return o.transpose(1, 2).reshape(o.shape[0], T_, -1).float(), o

    _, d = _record(tmp_path, core)
    attrs = dict(d._layer(0, 0).attrs)
    recipe = attrs["plain_recipe"]
    assert [(e["op"], e["out"]) for e in recipe["ops"]] == [
        ("matmul", "bfloat16"), ("mul", "bfloat16"), ("div", "bfloat16"), ("tanh", "bfloat16"), ("mul", "bfloat16"),
        ("add", "float32"), ("softmax", "float32"), ("matmul", "bfloat16")]
    assert recipe["ops"][0]["in"] == ["bfloat16", "bfloat16"] and recipe["ops"][1]["value"] == 0.25
    assert recipe["ops"][2]["value"] == 5.0 and recipe["softcap"] == 5.0 and recipe["window"] == 4
    assert recipe["scale_on"] == "scores" and recipe["mask"] == "bias" and recipe["p_cast"] == "bfloat16"
    assert recipe["softmax_dtype"] == "float32" and recipe["autocast"] == "bfloat16"
    assert recipe["device"] == "cpu" and recipe["threads"] == torch.get_num_threads()
    assert recipe["torch"] == torch.__version__ and attrs["scale"] == pytest.approx(0.25)
    assert d.layer_info(0, 0).call["plain_recipe"] == recipe


def test_a_scale_on_q_is_recorded_as_such(tmp_path):
    def core(q, k, v):
        o = (q * 0.5 @ k.transpose(-2, -1)).softmax(-1) @ v
        return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1), o

    _, d = _record(tmp_path, core)
    recipe = dict(d._layer(0, 0).attrs)["plain_recipe"]
    assert recipe["scale_on"] == "q" and recipe["mask"] == "none" and recipe["softcap"] == "none"
    assert [e["op"] for e in recipe["ops"]] == ["matmul", "softmax", "matmul"] and recipe["window"] == "none"
