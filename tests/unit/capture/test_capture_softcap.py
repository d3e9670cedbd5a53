"""A soft-cap written inline in torch ops (cap·tanh(S / cap)) is recorded as the layer's `softcap`: hand-written
forms and Hugging Face's Gemma 2 eager attention; a form replays cannot apply is said, never recorded wrong."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fa_forensics
from fa_forensics.capture.events import CaptureWarning
from fa_forensics.dump import open_dump

CAP = 4.0
FORMS = {
    "cap * tanh(s / cap)": lambda s: CAP * torch.tanh(s / CAP),
    "tanh(s / cap) * cap": lambda s: torch.tanh(s / CAP) * CAP,
    "F.tanh(s * (1 / cap)) * cap": lambda s: F.tanh(s * (1 / CAP)) * CAP,
    "(s / cap).tanh() then *= cap": lambda s: (s / CAP).tanh().mul(CAP),
}


class Attn(nn.Module):
    def __init__(self, cap, C=32, H=4):
        super().__init__()
        self.cap, self.H, self.qkv, self.proj = cap, H, nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.num_heads = H

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        s = self.cap(q @ k.transpose(-1, -2) * 3.0 / math.sqrt(C // self.H))  # large scores: the cap matters
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(s, -1) @ v
        return self.proj(o.transpose(1, 2).reshape(B, T, C))


def _train(tmp_path, cap):
    torch.manual_seed(0)
    net = nn.ModuleDict({"h": nn.ModuleList([nn.ModuleDict({"attn": Attn(cap)}) for _ in range(2)])})

    def forward(x):
        for block in net["h"]:
            x = x + block["attn"](x)
        return x

    net.forward = forward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fa_forensics.capture(net, out=tmp_path / "run.zarr", steps=[0], batch=None, step_by="manual") as c:
            net(torch.randn(2, 10, 32)).square().mean().backward()
            c.step()
    return open_dump(tmp_path / "run.zarr"), [str(w.message) for w in caught if isinstance(w.message, CaptureWarning)]


def _capped_o(d, step, layer):
    attrs = dict(d._layer(step, layer).attrs)
    q, k, v = (d.read(step, layer, n).double() for n in "qkv")
    s = q @ k.transpose(-1, -2) * attrs["scale"]
    s = attrs["softcap"] * torch.tanh(s / attrs["softcap"])
    if "mask" in d._array_names(step, layer):
        m = d.read(step, layer, "mask")
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    if attrs["causal"]:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, attrs


@pytest.mark.parametrize("form", list(FORMS))
def test_inline_softcap_forms_are_recorded_as_cap_and_scale(tmp_path, form):
    d, said = _train(tmp_path, FORMS[form])
    assert said == [] and d.layers(0) == [0, 1]
    for layer in (0, 1):
        ref, attrs = _capped_o(d, 0, layer)
        assert attrs["softcap"] == pytest.approx(CAP) and attrs["scale"] == pytest.approx(3.0 / math.sqrt(8))
        assert "tanh" in attrs["chain"] and attrs["first_call_check"]["checked"] is True
        assert torch.allclose(d.read(0, layer, "o").double(), ref, atol=1e-6)
        plain = torch.softmax((d.read(0, layer, "q").double() @ d.read(0, layer, "k").double().transpose(-1, -2)
                               * attrs["scale"]).masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1),
                                                             float("-inf")), -1) @ d.read(0, layer, "v").double()
        assert (plain - ref).abs().max() > 1e-3  # without the cap O would be another


def test_a_tanh_after_a_bias_is_said_and_not_recorded(tmp_path):
    bias = torch.randn(10, 10)
    d, said = _train(tmp_path, lambda s: CAP * torch.tanh((s + bias) / CAP))
    assert d.steps == []
    assert any("soft-cap (tanh) is applied after a bias term" in line and "apply the mask after" in line
               for line in said), said


def test_gemma2_eager_softcap_is_recorded_and_o_follows_from_it(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
                       sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                       query_pre_attn_scalar=8, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = Gemma2ForCausalLM(cfg)
    ids = torch.randint(2, 64, (2, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fa_forensics.capture(model, out=tmp_path / "run.zarr", steps=[0], batch=None):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    d = open_dump(tmp_path / "run.zarr")
    assert d.layers(0) == [0, 1]
    for layer in (0, 1):
        ref, attrs = _capped_o(d, 0, layer)
        assert attrs["softcap"] == pytest.approx(2.0) and attrs["hf_attention"] == "eager"
        assert attrs["scale"] == pytest.approx(8 ** -0.5) and attrs["first_call_check"]["checked"] is True
        assert torch.allclose(d.read(0, layer, "o").double(), ref, atol=1e-5)
