"""Capture of attention that does not go through SDPA: record() with an explicit layout, a named
autograd Function (--attention), and the built-in adapters for flash_attn, xformers (stand-ins with the
real signatures and layouts, tests/data/attention_standins) and torch's real flex_attention."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fa_forensics
from fa_forensics.capture import InvalidCaptureSetting
from fa_forensics.capture.targets import TargetSpec
from fa_forensics.dump import open_dump

DATA = Path(__file__).resolve().parents[2] / "data"
STANDINS = DATA / "attention_standins"
CUSTOM = DATA / "custom_attention"
_STANDIN_MODULES = ("flash_attn", "xformers", "_reference", "blocked_attention")


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.syspath_prepend(str(CUSTOM))
    yield
    for name in [n for n in sys.modules if n.split(".")[0] in _STANDIN_MODULES]:
        del sys.modules[name]


class Attn(nn.Module):
    """q, k, v (B, H, T, D) from X; `call(q, k, v)` returns O (B, H, T, D) and the O autograd saw."""

    def __init__(self, call, C=16, H=2):
        super().__init__()
        self.call, self.H, self.qkv, self.proj = call, H, nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.seen = {}

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        o, native = self.call(q, k, v)
        if native.requires_grad:
            native.retain_grad()
        self.seen = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "native": native}
        return self.proj(o.transpose(1, 2).reshape(B, T, C))


class Net(nn.Module):
    def __init__(self, call, L=2):
        super().__init__()
        self.h = nn.ModuleList([nn.ModuleDict({"attn": Attn(call)}) for _ in range(L)])

    def forward(self, x):
        for block in self.h:
            x = x + block["attn"](x)
        return x


def train(tmp_path, call, steps=(1,), n_steps=2, T=12, **options):
    """Two tiny training steps under capture; the model's tensors of the recorded step and the dump."""
    torch.manual_seed(0)
    net = Net(call)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = {}
    with fa_forensics.capture(net, out=tmp_path / "run.zarr", steps=steps, batch=None, **options):
        for it in range(n_steps):
            net(torch.randn(2, T, 16)).square().mean().backward()
            if it in steps:
                seen = {i: dict(b["attn"].seen) for i, b in enumerate(net.h)}
            opt.step()
            opt.zero_grad()
    return seen, open_dump(tmp_path / "run.zarr")


def reference(d, step, layer):
    """Attention of the stored Q, K, V with the stored scale, causal flag and mask, in fp64."""
    info = dict(d._layer(step, layer).attrs)
    q, k, v = (d.read(step, layer, n).double() for n in "qkv")
    s = q @ k.transpose(-1, -2) * info["scale"]
    if info["causal"]:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if "mask" in d._array_names(step, layer):
        m = d.read(step, layer, "mask")
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    return torch.softmax(s, -1) @ v, info


def check_layers(d, seen, step=1, layout="BHTD"):
    """Stored Q, K, V are the model's (B, H, T, D) ones, O is their attention, dO the gradient of O."""
    for layer, s in seen.items():
        ref, info = reference(d, step, layer)
        assert info["layout"] == layout
        for n in "qkv":
            assert torch.equal(d.read(step, layer, n), s[n].reshape(d.read(step, layer, n).shape)), (layer, n)
        assert torch.allclose(d.read(step, layer, "o").double(), ref, atol=1e-6), layer
        grad = s["native"].grad
        do = grad.transpose(1, 2) if layout == "BTHD" and grad.dim() == 4 else grad
        if grad.dim() == 3:  # varlen (N, H, D)
            do = grad.transpose(0, 1).unsqueeze(0)
        assert torch.equal(d.read(step, layer, "do"), do), layer


# -- record(): an explicit layout -------------------------------------------------------------------
def _recording(layout):
    def call(q, k, v):
        o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v
        if layout == "BTHD":
            q, k, v, native = (t.transpose(1, 2) for t in (q, k, v, o))
            native = native.contiguous()
            fa_forensics.capture.record(q, k, v, native, causal=False, layout="BTHD")
            return native.transpose(1, 2), native
        fa_forensics.capture.record(q, k, v, o, causal=False)
        return o, o
    return call


def test_record_bthd_is_stored_as_bhtd(tmp_path):
    seen, d = train(tmp_path, _recording("BTHD"))
    assert d.steps == [1] and d.layers() == [0, 1]
    check_layers(d, seen, layout="BTHD")


def test_record_rejects_shapes_that_do_not_fit_the_layout(tmp_path):
    def bad(q, k, v):  # (B, H, T, D) passed as BTHD: k has other "heads" than q
        o = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        fa_forensics.capture.record(q[:, :, :5], k, v, o[:, :, :5], layout="BTHD")
        return o, o

    with pytest.raises(InvalidCaptureSetting, match=r"layout: fa_forensics.capture.record: .*\(q \(2, 2, 5, 8\)"):
        train(tmp_path, bad)
    with pytest.raises(InvalidCaptureSetting, match="not a layout"):
        train(tmp_path / "b", lambda q, k, v: (fa_forensics.capture.record(q, k, v, q, layout="THD"), (q, q))[1])


# -- a named autograd Function ----------------------------------------------------------------------
def test_named_autograd_function_is_captured_with_its_softmax_variant(tmp_path, standins, monkeypatch):
    monkeypatch.setenv("TINY_STABLE", "1")

    def call(q, k, v):
        from blocked_attention import BlockedAttention  # imported after the session started: patched on import

        o = BlockedAttention.apply(q, k, v, None, True, 4)
        return o, o

    seen, d = train(tmp_path, call, attention=["blocked_attention:BlockedAttention"], softmax="TINY_STABLE=1")
    check_layers(d, seen)
    info = dict(d._layer(1, 0).attrs)
    assert info["softmax"] == "stabilized" and info["softmax_rule"] == "TINY_STABLE=1" and info["causal"] is True
    assert info["source"] == "blocked_attention:BlockedAttention,layout=BHTD"
    assert info["device_type"] == "cpu" and info["autocast"] is False and info["autocast_dtype"] == "none"
    call = d.layer_info(1, 0).call  # the same facts through the reader
    assert call["softmax"] == "stabilized" and call["device_type"] == "cpu" and call["layout"] == "BHTD"
    from blocked_attention import BlockedAttention
    assert "apply" not in BlockedAttention.__dict__  # restored on exit


def test_target_spec_parses_options_and_rejects_bad_text():
    spec = TargetSpec.parse("pkg.mod:Fn.apply_fn,layout=bthd,causal=false,scale=0.125")
    parsed = (spec.module, spec.qualname, spec.layout, spec.causal, spec.scale)
    assert parsed == ("pkg.mod", "Fn.apply_fn", "BTHD", False, 0.125)
    for text in ("attention", "attention:", "a:b,layout=HTD", "a:b,size=3", "a:b,scale=-1"):
        with pytest.raises(InvalidCaptureSetting):
            TargetSpec.parse(text)


# -- flash_attn (stand-in) -----------------------------------------------------------------------------
def _bthd(t):
    return t.transpose(1, 2)


@pytest.mark.parametrize("form", ["func", "qkvpacked", "kvpacked"])
def test_flash_attn_dense_forms(tmp_path, standins, form):
    def call(q, k, v):
        import flash_attn

        q, k, v = (_bthd(t) for t in (q, k, v))
        if form == "func":
            o = flash_attn.flash_attn_func(q, k, v, causal=True, softmax_scale=0.3)
        elif form == "qkvpacked":
            o = flash_attn.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), 0.0, 0.3, True)
        else:
            o = flash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), causal=True, softmax_scale=0.3)
        return _bthd(o), o

    seen, d = train(tmp_path, call)
    check_layers(d, seen, layout="BTHD")
    info = dict(d._layer(1, 0).attrs)
    assert info["causal"] is True and info["scale"] == 0.3
    assert info["source"] == "flash_attn.flash_attn_" + ("func" if form == "func" else f"{form}_func")


def test_built_in_adapters_read_a_call_that_returned_no_tensor_as_unread():
    """A watched function that returned no tensor for O: each built-in adapter says the call was not read (None,
    which the session reports as such) instead of failing inside the training step."""
    from fa_forensics.capture.adapters import (flash_attn_func, flash_attn_varlen_func, flex_attention,
                                               memory_efficient_attention)

    q = torch.randn(1, 6, 2, 8)  # (B, T, H, D); (B, H, T, D) for flex_attention
    cu = torch.tensor([0, 6], dtype=torch.int32)
    for adapter, args in ((flash_attn_func, (q, q, q)), (flash_attn_varlen_func, (q[0], q[0], q[0], cu, cu, 6, 6)),
                          (memory_efficient_attention, (q, q, q)), (flex_attention, (q, q, q))):
        o = q[0] if adapter is flash_attn_varlen_func else q
        assert adapter(args, {}, o) is not None
        assert adapter(args, {}, None) is None
        assert adapter(args, {}, ("not a tensor", None)) is None


@pytest.mark.parametrize("form", ["varlen", "varlen_qkvpacked", "varlen_kvpacked"])
def test_flash_attn_varlen_forms_store_a_block_diagonal_mask(tmp_path, standins, form):
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def call(q, k, v):
        from flash_attn import flash_attn_interface as fi

        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # batch row 0 as packed (N, H, D)
        if form == "varlen":
            o = fi.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
        elif form == "varlen_qkvpacked":
            o = fi.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], dim=1), cu, 7, causal=True)
        else:
            o = fi.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], dim=1), cu, cu, 7, 7, causal=True)
        full = o.transpose(0, 1).unsqueeze(0)
        return torch.cat([full, full.detach()]), o

    seen, d = train(tmp_path, call)
    for layer, s in seen.items():
        ref, info = reference(d, 1, layer)
        assert info["varlen"] is True and info["causal"] is False and info["mask"] == "bool"
        mask = d.read(1, layer, "mask")[0, 0]
        assert mask.shape == (12, 12) and not mask[:5, 5:].any() and not mask[5:, :5].any()
        assert torch.equal(mask[5:, 5:], torch.ones(7, 7, dtype=torch.bool).tril())
        assert torch.allclose(d.read(1, layer, "o").double(), ref, atol=1e-6)
        assert torch.equal(d.read(1, layer, "do"), s["native"].grad.transpose(0, 1).unsqueeze(0))


def test_flash_attn_options_that_replays_do_not_model_are_warned_about(tmp_path, standins):
    def call(q, k, v):
        from flash_attn import flash_attn_func

        o = flash_attn_func(_bthd(q), _bthd(k), _bthd(v), window_size=(4, 0))
        return _bthd(o), o

    with pytest.warns(fa_forensics.capture.events.CaptureWarning, match="window_size"):
        _, d = train(tmp_path, call)
    assert d._layer(1, 0).attrs["not_replayed"] == ["window_size"]


# -- xformers (stand-in) -------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", ["none", "lower", "block_causal", "tensor"])
def test_xformers_attn_bias_kinds(tmp_path, standins, bias):
    import xformers.ops as xops  # imported before the session: patched at its start
    from xformers.ops.fmha.attn_bias import BlockDiagonalMask

    def call(q, k, v):
        B, H, T, _ = q.shape
        kinds = {"none": None, "lower": xops.LowerTriangularMask(),
                 "block_causal": BlockDiagonalMask.from_seqlens([4, 8]).make_causal(),
                 "tensor": torch.linspace(-1, 1, B * H * T * T).view(B, H, T, T)}
        o = xops.memory_efficient_attention(_bthd(q), _bthd(k), _bthd(v), attn_bias=kinds[bias])
        return _bthd(o), o

    seen, d = train(tmp_path, call)
    check_layers(d, seen, layout="BTHD")
    info = dict(d._layer(1, 0).attrs)
    assert info["causal"] is (bias == "lower")
    assert info.get("mask") == {"none": None, "lower": None, "block_causal": "bool", "tensor": "additive"}[bias]


# -- flex_attention (torch's own; its backward does not run on CPU: forward-only calls) -----------------
@pytest.mark.slow  # about 3 s of CPU or more
def test_real_flex_attention_block_mask_and_score_mod(tmp_path):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def bump(score, b, h, q_idx, kv_idx):
        return score + 1.0

    mask = create_block_mask(causal, None, None, 12, 12, device="cpu")

    def call(q, k, v):
        import torch.nn.attention.flex_attention as fa

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            o = fa.flex_attention(q.detach(), k.detach(), v.detach(), block_mask=mask)
        return o + 0 * q, o

    seen, d = train(tmp_path, call)
    for layer in seen:
        ref, info = reference(d, 1, layer)
        assert info["block_mask"] == "causal" and info["mask"] == "bool"
        assert torch.equal(d.read(1, layer, "mask")[0, 0], torch.ones(12, 12, dtype=torch.bool).tril())
        assert torch.allclose(d.read(1, layer, "o").double(), ref, atol=1e-5)
    assert flex_attention is torch.nn.attention.flex_attention.flex_attention  # restored

    def call_mod(q, k, v):
        import torch.nn.attention.flex_attention as fa

        o = fa.flex_attention(q.detach(), k.detach(), v.detach(), score_mod=bump)
        return o + 0 * q, o

    with pytest.warns(fa_forensics.capture.events.CaptureWarning, match="score_mod 'bump'.*will not reproduce O"):
        _, d = train(tmp_path / "mod", call_mod)
    assert d._layer(1, 0).attrs["score_mod"] == "bump"


def test_sdpa_inside_a_watched_callable_is_recorded_once_and_unresolved_names_are_said(tmp_path, standins):
    def call(q, k, v):
        import _reference

        o = _reference.attention(q, k, v)  # patched on import below; it calls nothing else
        return o, o

    def sdpa_inside(q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o

    import _reference
    monkey = _reference.attention
    _reference.attention = lambda q, k, v, *a, **kw: sdpa_inside(q, k, v)
    try:
        never = "--attention nowhere:attn,layout=BHTD was never patched"
        with pytest.warns(fa_forensics.capture.events.CaptureWarning, match=never):
            seen, d = train(tmp_path, call, attention=["_reference:attention,causal=true", "nowhere:attn"])
    finally:
        _reference.attention = monkey
    assert d.layers() == [0, 1]  # one call per layer: the SDPA call inside the watched one is its own
    assert d._layer(1, 0).attrs["source"] == "_reference:attention,layout=BHTD,causal=true"
    check_layers(d, seen)


def test_launcher_binds_a_compiled_model_without_a_global_hook_alive_at_compile(tmp_path):
    from fa_forensics.capture.launched import auto_binder as _auto_binder
    from fa_forensics.capture.session import CaptureSession
    from fa_forensics.capture.settings import CaptureSettings

    session = CaptureSession(None, CaptureSettings(tmp_path / "run.zarr", [0]))
    session.start()
    original = torch.compile
    binder = _auto_binder(session)
    try:
        net = Net(lambda q, k, v: (q, q))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            compiled = torch.compile(net, backend="eager")
            compiled(torch.randn(1, 4, 16))  # torch warns at the call when a global module hook is alive
        assert session._root is compiled and not [w for w in said if "global hooks" in str(w.message)]
        assert session.attention_module_names == ["_orig_mod.h.0.attn", "_orig_mod.h.1.attn"]
    finally:
        binder.remove()
        session.stop()
    assert torch.compile is original


def test_a_binding_made_during_an_earlier_session_reports_to_the_current_one(tmp_path, standins):
    bound = {}

    def call(q, k, v):
        if "f" not in bound:  # `from flash_attn import flash_attn_func` once, during the first session
            from flash_attn import flash_attn_func
            bound["f"] = flash_attn_func
        o = bound["f"](_bthd(q), _bthd(k), _bthd(v), causal=True)
        return _bthd(o), o

    train(tmp_path / "first", call)
    seen, d = train(tmp_path / "second", call)
    assert d.steps == [1]
    check_layers(d, seen, layout="BTHD")


def test_a_step_whose_calls_were_all_filtered_out_says_so(tmp_path):
    with pytest.warns(fa_forensics.capture.events.CaptureWarning,
                      match="step 1 ran 2 attention call.* none was selected"):
        train(tmp_path, _recording("BHTD"), layers=[5])


# -- arguments and results mapped by --attention -------------------------------------------------------------
def _module_first(module, query, key, value, attention_mask, scaling=None, dropout=0.0):
    """Hugging Face's convention: module first, O returned in (B, T, H, D) with the weights."""
    p = torch.softmax(query @ key.transpose(-1, -2) * scaling, -1)
    return (p @ value).transpose(1, 2), p


@pytest.mark.parametrize("spec", [
    "attn_fns:module_first,o_layout=BTHD,causal=false",  # q, k, v found by their names, scale as `scaling`
    "attn_fns:module_first,q=1,k=2,v=3,out=0,o_layout=BTHD,scale=scaling,causal=false",
    "attn_fns:module_first,q=query,k=key,v=value,mask=attention_mask,o_layout=BTHD,scale=0.125,causal=false",
])
def test_attention_maps_arguments_and_results(tmp_path, monkeypatch, spec):
    fns = type(sys)("attn_fns")
    fns.module_first = _module_first
    monkeypatch.setitem(sys.modules, "attn_fns", fns)

    def call(q, k, v):
        o, _ = sys.modules["attn_fns"].module_first(None, q, k, v, None, scaling=0.125)
        native = o
        return o.transpose(1, 2), native

    seen, d = train(tmp_path, call, attention=[spec])
    for layer, s in seen.items():
        info = dict(d._layer(1, layer).attrs)
        assert info["o_layout"] == "BTHD" and info["scale"] == 0.125 and info["causal"] is False
        ref = torch.softmax(s["q"] @ s["k"].transpose(-1, -2) * 0.125, -1) @ s["v"]
        assert torch.equal(d.read(1, layer, "o"), ref)
        assert torch.equal(d.read(1, layer, "do"), s["native"].grad.transpose(1, 2))
    assert d.attrs["capture"]["attention"] == [TargetSpec.parse(spec).to_text()]


def test_an_output_in_another_layout_is_refused_with_the_option_that_fits(tmp_path, monkeypatch):
    fns = type(sys)("attn_fns")
    fns.module_first = _module_first
    monkeypatch.setitem(sys.modules, "attn_fns", fns)

    def call(q, k, v):
        o, _ = sys.modules["attn_fns"].module_first(None, q, k, v, None, scaling=0.125)
        return o.transpose(1, 2), o

    with pytest.raises(InvalidCaptureSetting, match="o fits BTHD: name it with o_layout=BTHD"):
        train(tmp_path, call, attention=["attn_fns:module_first"])
    assert not (tmp_path / "run.zarr").exists()


def test_target_spec_options_are_checked():
    spec = TargetSpec.parse("m:f,q=query,k=2,v=value,out=1,o_layout=bthd,mask=attn,scale=sm,causal=is_causal")
    assert (spec.q, spec.k, spec.v, spec.out, spec.o_layout, spec.mask) == ("query", 2, "value", 1, "BTHD", "attn")
    assert (spec.scale, spec.scale_arg, spec.causal, spec.causal_arg) == (None, "sm", None, "is_causal")
    assert TargetSpec.parse(spec.to_text()) == spec
    for text, said in (("m:f,q=query,k=query", "name the same argument"), ("m:f,out=first", "index of O"),
                       ("m:f,q=1.5", "name a parameter"), ("m:f,scale=0", "positive number"),
                       ("m:f,o_layout=THD", "not a layout"), ("m:f,scale=2,scale=3", "given twice")):
        with pytest.raises(InvalidCaptureSetting, match=said):
            TargetSpec.parse(text)


# -- layouts checked against X and the module ------------------------------------------------------------------
def _transposed(kind):
    """An attention call whose (B, H, T, D) tensors go where (B, T, H, D) is taken, or the reverse: q, k, v and o
    agree with each other, only X's length (and the module's head count) show it."""
    def call(q, k, v):
        if kind == "record":
            o = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v
            fa_forensics.capture.record(q, k, v, o, layout="BTHD", scale=0.3, causal=False)
            return o, o
        if kind == "target":
            from blocked_attention import BlockedAttention

            o = BlockedAttention.apply(q, k, v, None, True, 4)
            return o, o
        if kind == "flash_attn":
            from flash_attn import flash_attn_func

            o = flash_attn_func(q, k, v)
            return o, o
        if kind == "xformers":
            import xformers.ops as xops

            o = xops.memory_efficient_attention(q, k, v)
            return o, o
        if kind == "flex_attention":
            import torch.nn.attention.flex_attention as fa

            o = fa.flex_attention(*(_bthd(t).detach() for t in (q, k, v)))
            return _bthd(o) + 0 * q, o
        if kind == "sdpa":
            o = torch.nn.functional.scaled_dot_product_attention(*(_bthd(t) for t in (q, k, v)))
            return _bthd(o), o
        qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # torch ops on (H, B, T, D)
        o = torch.softmax(qh @ kh.transpose(-1, -2), -1) @ vh
        return o.transpose(0, 1), o
    return call


def _capture_transposed(tmp_path, kind):
    """One recorded step of a model whose calls have the layout `_transposed(kind)` gives; (the model's tensors,
    the dump, the capture warnings)."""
    options = {"attention": ["blocked_attention:BlockedAttention,layout=BTHD"]} if kind == "target" else {}
    torch.manual_seed(0)
    net = Net(_transposed(kind))
    for block in net.h:
        block["attn"].num_heads = 2  # the head count the module states
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fa_forensics.capture(net, out=tmp_path / "run.zarr", steps=[0], batch=None, step_by="manual",
                                  softmax="standard", **options) as cap:
            net(torch.randn(3, 12, 16)).square().mean().backward()
            seen = {i: dict(b["attn"].seen) for i, b in enumerate(net.h)}
            cap.step()
    said = [str(w.message) for w in caught if isinstance(w.message, fa_forensics.capture.events.CaptureWarning)]
    return seen, open_dump(tmp_path / "run.zarr"), said


@pytest.mark.parametrize("kind", ["record", "target", "torch_ops"])
def test_a_layout_the_shapes_make_unambiguous_is_stored_as_bhtd_and_training_goes_on(tmp_path, standins, kind):
    seen, d, said = _capture_transposed(tmp_path, kind)
    assert d.steps == [0] and d.layers() == [0, 1]
    layout = "HBTD" if kind == "torch_ops" else "BHTD"  # named BTHD, the shapes show BHTD
    for layer, s in seen.items():
        attrs = dict(d._layer(0, layer).attrs)
        assert attrs["layout"] == layout and attrs["first_call_check"]["checked"] is True
        for n in "qkv":  # the model's (B, H, T, D) tensors, whichever way the call held them
            assert torch.equal(d.read(0, layer, n), s[n]), (kind, layer, n)
        ref, _ = reference(d, 0, layer)
        assert torch.allclose(d.read(0, layer, "o").double(), ref, atol=1e-6)
        assert d.read(0, layer, "do").shape == s["q"].shape
    lines = [line for line in said if "read as" in line]
    if kind == "torch_ops":  # a layout the code is free to use: said in `info`, not warned about
        assert lines == []
    else:  # the layout named was wrong: said once, with q's shape as the call passed it
        assert len(lines) == 1 and "q (3, 2, 12, 8) read as BTHD" in lines[0] and "read as BHTD" in lines[0]


@pytest.mark.parametrize("kind", ["flash_attn", "xformers", "flex_attention", "sdpa"])
def test_a_library_given_the_other_layout_is_recorded_as_it_computed_and_the_model_is_named(tmp_path, standins, kind):
    _, d, said = _capture_transposed(tmp_path, kind)
    assert d.steps == [0]
    lines = [line for line in said if "read as" in line]
    assert len(lines) == 1 and "it fits: the model passes" in lines[0] and "fix the call in the model" in lines[0]
    passed = "(3, 2, 12, 8)" if kind in ("flash_attn", "xformers") else "(3, 12, 2, 8)"  # as the call passed q
    assert f"q {passed} read as" in lines[0]
    for layer in (0, 1):
        ref, _ = reference(d, 0, layer)  # the kernel's own reading reproduces its O
        assert torch.allclose(d.read(0, layer, "o").double(), ref, atol=1e-5)


def test_check_call_context_uses_the_module_heads_and_the_width_only_to_break_a_tie():
    from fa_forensics.capture.layouts import Reading, check_call_context

    q = torch.zeros(2, 4, 8, 16)
    as_bthd, as_bhtd = Reading("BTHD", 2, 8, 4, 16), Reading("BHTD", 2, 4, 8, 16, swap=(1, 2))
    verdict = check_call_context(q.shape, (as_bthd, as_bhtd), "f", None, "attn", 4, fixed=False)
    assert verdict.reading is as_bhtd and "attn states 4 heads; read as BHTD" in verdict.line
    fixed = check_call_context(q.shape, (as_bthd, as_bhtd), "f", None, "attn", 4, fixed=True, advice="fix it")
    assert fixed.reading is as_bthd and "fix it" in fixed.line
    assert check_call_context(q.shape, (as_bhtd, as_bthd), "f", None, "attn", 8, fixed=False).line is None  # a shard
    # length equals heads (8 = 8): X's width (heads × head_dim) decides
    q = torch.zeros(2, 8, 8, 16)
    wide = torch.zeros(2, 8, 8 * 16)
    verdict = check_call_context(q.shape, (Reading("BHTD", 2, 8, 8, 16), Reading("BTHD", 2, 8, 8, 16)), "f", wide,
                                 "attn", None, fixed=False)
    assert verdict.line is None and verdict.skip is None
    # X not matching either reading (attention over a part of the tokens): said, stored as read
    verdict = check_call_context(q.shape, (Reading("BHTD", 2, 8, 8, 16), Reading("BTHD", 2, 8, 8, 16)), "f",
                                 torch.zeros(2, 5, 128), "attn", None, fixed=False)
    assert "could not be checked" in verdict.line and not verdict.checked and verdict.skip is None


def test_a_layout_nothing_decides_is_skipped_with_its_reason():
    from fa_forensics.capture.layouts import Reading, check_call_context

    # q (2, 3, 2, 8) read as BHTD has batch 2, length 2: X (2, 3, 16) contradicts it; read as BTHD (batch 2,
    # length 3) and as HBTD (batch 3, length 2, X read as (T, B, C)) both fit X's length and width: nothing decides
    readings = (Reading("BHTD", 2, 3, 2, 8), Reading("BTHD", 2, 2, 3, 8, swap=(1, 2)),
                Reading("HBTD", 3, 2, 2, 8, swap=(0, 1)))
    verdict = check_call_context((2, 3, 2, 8), readings, "f", torch.zeros(2, 3, 16), "attn", None, fixed=False)
    assert verdict.skip is not None and "nothing decides which" in verdict.skip and "q (2, 3, 2, 8)" in verdict.skip
    assert "BTHD or HBTD" in verdict.skip


# -- what a capture says ----------------------------------------------------------------------------------
def test_softmax_unknown_is_said_once_and_record_can_name_it(tmp_path):
    def said(call, **options):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(tmp_path / str(len(list(tmp_path.iterdir()))), call, steps=(0, 1), **options)
        return [str(w.message) for w in caught if "recorded as unknown" in str(w.message)]

    lines = said(_recording("BHTD"))
    assert len(lines) == 1 and "fa_forensics.capture.record" in lines[0] and "--softmax standard" in lines[0]
    assert said(_recording("BHTD"), softmax="standard") == []

    def named(q, k, v):
        o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v
        fa_forensics.capture.record(q, k, v, o, causal=False, softmax="stabilized")
        return o, o

    assert said(named) == []
    seen, d = train(tmp_path / "named", named)
    assert d._layer(1, 0).attrs["softmax"] == "stabilized"


def test_layers_whose_o_has_no_gradient_are_said_and_info_lists_them(tmp_path):
    from typer.testing import CliRunner

    from fa_forensics.cli import app

    def half_detached(q, k, v):
        o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v
        fa_forensics.capture.record(q.detach(), k.detach(), v.detach(), o.detach(), causal=False, softmax="standard")
        return o, o

    with pytest.warns(fa_forensics.capture.events.CaptureWarning,
                      match=r"no dO recorded for layers 0, 1 of step 0 .*its O had no gradient"):
        _, d = train(tmp_path, half_detached, steps=(0, 1))
    assert d.steps == [0, 1] and not d.has(0, 0, "do") and d.has(0, 0, "o")
    js = tmp_path / "info.json"
    assert CliRunner().invoke(app, ["info", str(tmp_path / "run.zarr"), "--json", str(js)]).exit_code == 0
    info = __import__("json").loads(js.read_text())
    assert info["do_missing"] == {"0": [0, 1], "1": [0, 1]} and "no dO recorded for layer 0" in info["warnings"][0]


def test_the_no_attention_hint_lists_what_is_watched_readably(tmp_path):
    from fa_forensics.capture.session import CaptureSession
    from fa_forensics.capture.settings import CaptureSettings

    session = CaptureSession(None, CaptureSettings(tmp_path / "run.zarr", [0],
                                                   attention=["attentionx:FlashAttentionFunction"]))
    line = session.no_attention_message(3)
    assert "Watched: torch's scaled_dot_product_attention; flash_attn" in line
    assert "; fa_forensics.capture.record; and --attention attentionx:FlashAttentionFunction,layout=BHTD." in line
    assert "No model was bound, so attention written in torch ops was not followed" in line
