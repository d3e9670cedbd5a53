"""Hugging Face transformers' attention registry as a built-in adapter (small configs, no download): a model
is captured whatever its attn_implementation; the call inside HF's function (torch's SDPA for "sdpa", the
torch ops of "eager") is recorded once, named with the function; a registered function whose inside is
not watched is read from its own arguments and result in HF's layouts (query (B, H, T, D), output
(B, T, H, D)), checked."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import tiny_llama

import fa_forensics
from fa_forensics.capture import InvalidCaptureSetting
from fa_forensics.dump import open_dump

T = 16


def _one_step(tmp_path, model, ids=None):
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1)) if ids is None else ids
    with fa_forensics.capture(model, out=tmp_path / "run.zarr", steps=[0], batch=None, step_by="manual") as cap:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        cap.step(loss)
    return open_dump(tmp_path / "run.zarr")


@pytest.fixture
def registered():
    """Register attention functions with HF's registry for one test (removed afterwards)."""
    from transformers import AttentionInterface

    names = []

    def register(name, fn):
        AttentionInterface.register(name, fn)
        names.append(name)

    yield register
    for name in names:
        AttentionInterface._global_mapping.pop(name, None)


def test_sdpa_through_the_registry_is_recorded_once_with_its_name(tmp_path):
    d = _one_step(tmp_path, tiny_llama(T, implementation="sdpa"))
    assert d.layers(0) == [0, 1]  # one call per layer: HF's function and the SDPA call inside it are one
    for layer in (0, 1):
        attrs = dict(d._layer(0, layer).attrs)
        assert attrs["source"] == "sdpa" and attrs["hf_attention"] == "sdpa" and attrs["causal"] is True
        q, k, v, o = (d.read(0, layer, n) for n in "qkvo")
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attrs["scale"]), o)


def _manual_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention function in HF's convention that fa-forensics does not watch inside (no softmax call)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    s = query @ key.transpose(-1, -2) * scaling
    if attention_mask is not None:
        s = s + attention_mask
    elif module.is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    p = (s - s.amax(-1, keepdim=True)).exp()
    out = (p / p.sum(-1, keepdim=True)) @ value
    return out.transpose(1, 2).contiguous(), None


def test_a_registered_function_is_read_in_hf_layouts(tmp_path, registered):
    seen = []

    def manual(module, query, key, value, attention_mask, **kwargs):
        out, w = _manual_attention(module, query, key, value, attention_mask, **kwargs)
        entry = {"q": query.detach(), "k": key.detach(), "o": out.detach()}
        out.register_hook(lambda g: entry.__setitem__("do", g))
        seen.append(entry)
        return out, w

    registered("manual_attention", manual)
    d = _one_step(tmp_path, tiny_llama(T, implementation="manual_attention"))
    assert d.layers(0) == [0, 1]
    for layer, s in enumerate(seen):
        attrs = dict(d._layer(0, layer).attrs)
        assert attrs["source"] == "transformers:manual_attention" and attrs["hf_attention"] == "manual_attention"
        assert attrs["layout"] == "BHTD" and attrs["o_layout"] == "BTHD" and attrs["causal"] is True
        q, k, v, o = (d.read(0, layer, n) for n in "qkvo")
        assert torch.equal(q, s["q"]) and torch.equal(k[:, ::2], s["k"])  # 2 K/V heads stored per query head
        assert torch.equal(o, s["o"].transpose(1, 2)) and torch.equal(d.read(0, layer, "do"), s["do"].transpose(1, 2))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attrs["scale"])
        torch.testing.assert_close(ref, o, atol=1e-6, rtol=1e-5)


def test_a_registered_function_that_returns_bhtd_is_refused_before_anything_is_stored(tmp_path, registered):
    def wrong_layout(module, query, key, value, attention_mask, **kwargs):
        out, w = _manual_attention(module, query, key, value, attention_mask, **kwargs)
        return out.transpose(1, 2), w  # (B, H, T, D): not HF's output layout

    registered("wrong_layout", wrong_layout)
    with pytest.raises(InvalidCaptureSetting, match=r"wrong_layout.*o is not \(B, heads of q, T of q"):
        _one_step(tmp_path, tiny_llama(T, implementation="wrong_layout"))
    assert not (tmp_path / "run.zarr").exists()


def test_the_registry_is_restored_and_unselected_steps_get_the_function_itself(tmp_path):
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    get_interface, sdpa = AttentionInterface.get_interface, ALL_ATTENTION_FUNCTIONS["sdpa"]
    with fa_forensics.capture(None, out=tmp_path / "run.zarr", steps=[5]):
        assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is sdpa  # step 0 is not recorded
    assert AttentionInterface.get_interface is get_interface and "__getitem__" not in vars(AttentionInterface)
