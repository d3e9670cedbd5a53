"""Capture during real training steps: the store must hold what training computed."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import fa_forensics
from fa_forensics.capture import CaptureError, parse_batch, parse_steps, sdpa
from fa_forensics.capture.events import CaptureWarning
from fa_forensics.demo.model import GPT, GPTConfig, flash_attention_bf16
from fa_forensics.dump import open_dump
from fa_forensics.errors import UserError

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def _attn_modules(model):
    return [block.attn for block in model.transformer.h]


def _train(model, n_steps, cap=None, micro_batches=1, B=3, T=32, seed=1):
    """Real training steps under bf16 autocast; returns per step and layer what training saw:
    O (retained, with its gradient dO) and X (the attention module's input), per micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen_x = []
    hooks = [m.register_forward_pre_hook(lambda mod,
                                         args: seen_x.append(args[0].detach().clone())) for m in _attn_modules(model)]
    history = []
    for _step in range(n_steps):
        per_micro = []
        for _ in range(micro_batches):
            seen_x.clear()
            idx = torch.randint(0, 256, (B, T), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(idx, idx)
            outs = [m.last_o for m in _attn_modules(model)]
            for o in outs:
                o.retain_grad()
            xs = list(seen_x)
            (loss / micro_batches).backward()
            per_micro.append([(o.detach().clone(), o.grad.detach().clone(), x) for o, x in zip(outs, xs)])
        opt.step()
        opt.zero_grad()
        if cap is not None:
            cap.step(loss)
        history.append((float(loss.detach()), per_micro))
    for h in hooks:
        h.remove()
    return history


def test_sdpa_capture_matches_what_training_computed(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, attention="sdpa"))
    out = tmp_path / "run.zarr"
    with fa_forensics.capture(model, out=out, steps=[1, 3], batch=slice(0, 2)) as cap:
        history = _train(model, 4, cap)
    dump = open_dump(out)
    assert dump.steps == [1, 3] and dump.incomplete_steps == []
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_000000001", "step_000000003"]
    for step in (1, 3):
        loss, per_micro = history[step]
        per_layer = per_micro[0]
        assert dump.step_attrs(step)["loss"] == pytest.approx(loss)
        assert dump.layers(step) == [0, 1]
        for layer, (o_train, do_train, x_train) in enumerate(per_layer):
            info = dump.layer_info(step, layer)
            assert info.module == f"transformer.h.{layer}.attn" and info.causal is True
            assert info.scale == pytest.approx(1 / math.sqrt(16)) and info.dtype == "bfloat16"
            q, k, v, o, do = (dump.read(step, layer, n) for n in ("q", "k", "v", "o", "do"))
            assert q.dtype == torch.bfloat16 and q.shape == (2, 2, 32, 16)
            # O stored = O training computed = attention recomputed from the stored Q, K, V
            assert torch.equal(o, o_train[:2])
            o_re = sdpa.original_sdpa()(q, k, v, is_causal=True)
            torch.testing.assert_close(o_re.float(), o.float(), atol=1e-2, rtol=1e-2)
            o_ref = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / 4 + torch.full((32, 32),
                                                                                             -math.inf).triu(1),
                                  -1) @ v.float()
            torch.testing.assert_close(o.float(), o_ref, atol=2e-2, rtol=2e-2)
            # dO = autograd's dLoss/dO; X = the attention module's input
            assert torch.equal(do, do_train[:2])
            assert torch.equal(dump.read(step, layer, "x"), x_train[:2])


def test_record_path_flash_model_and_layer_head_selection(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, attention="flash-bf16", flash_block=16))
    out = tmp_path / "run.zarr"
    with fa_forensics.capture(model, out=out, steps="2", layers=[1], heads=[1], batch=None) as cap:
        history = _train(model, 3, cap)
    dump = open_dump(out)
    assert dump.steps == [2] and dump.layers(2) == [1]
    o_train, do_train, x_train = history[2][1][0][1]
    q, k, v, o = (dump.read(2, 1, n) for n in ("q", "k", "v", "o"))
    assert q.shape == (3, 1, 32, 16)
    assert torch.equal(o, o_train[:, 1:2])
    # the forward is deterministic: recomputing from the stored Q, K, V gives the same bits
    assert torch.equal(flash_attention_bf16(q, k, v, 0.25, causal=True, block=16), o)
    assert torch.equal(dump.read(2, 1, "do"), do_train[:, 1:2])
    assert torch.equal(dump.read(2, 1, "x"), x_train)
    assert dump.attrs["capture"]["heads"] == [1]
    assert dump.heads(2, 1) == [1]  # the model's head number, not the storage position
    assert torch.equal(dump.read(2, 1, "q", heads=1), q)


def test_gradient_accumulation_records_the_chosen_micro_batch(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, attention="sdpa"))
    out = tmp_path / "run.zarr"
    with fa_forensics.capture(model, out=out, steps=[1], layers=[0], micro_batch=1, batch=None) as cap:
        history = _train(model, 2, cap, micro_batches=2)
    o_train, do_train, _ = history[1][1][1][0]  # step 1, micro-batch 1, layer 0
    assert torch.equal(open_dump(out).read(1, 0, "o"), o_train)
    assert torch.equal(open_dump(out).read(1, 0, "do"), do_train)


def test_unselected_steps_do_no_work(tmp_path, monkeypatch):
    calls = []
    import fa_forensics.capture.session as session_module

    real = session_module.offload
    monkeypatch.setattr(session_module, "offload", lambda t: calls.append(1) or real(t))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, attention="sdpa"))
    out = tmp_path / "run.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fa_forensics.capture(model, out=out, steps=[50]) as cap:
            _train(model, 3, cap)
            assert cap.busy is False
    assert calls == []
    assert not [p for p in out.iterdir() if p.name.startswith("step_")]


def test_hooks_and_patch_removed_on_error_and_cut_step_not_complete(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, attention="sdpa"))
    original = F.scaled_dot_product_attention
    out = tmp_path / "run.zarr"
    with pytest.raises(RuntimeError, match="boom"):
        with fa_forensics.capture(model, out=out, steps=[0, 1]) as cap:
            _train(model, 1, cap)  # step 0 ends normally
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.zeros(2, 32, dtype=torch.long))  # step 1 starts ...
            raise RuntimeError("boom")  # ... and is cut
    assert F.scaled_dot_product_attention is original
    assert sdpa.active_session() is None and fa_forensics.capture.active() is None
    assert all(not m._forward_pre_hooks for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = open_dump(out)
    assert dump.steps == [0] and dump.incomplete_steps == [1]


def test_manual_steps_and_custom_record(tmp_path):
    out = tmp_path / "run.zarr"
    q, k, v = (torch.randn(2, 3, 8, 4, requires_grad=True) for _ in range(3))
    with fa_forensics.capture(None, out=out, steps=[1], step_by="manual", batch=None) as cap:
        for step in range(2):
            o = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v  # custom attention (its O is checked)
            fa_forensics.capture.record(q, k, v, o, scale=0.5, causal=False)
            o.sum().backward()
            cap.step(loss=float(step))
    dump = open_dump(out)
    assert dump.steps == [1] and dump.step_attrs(1)["loss"] == 1.0
    assert dump.layer_info(1, 0).causal is False and dump.layer_info(1, 0).scale == 0.5
    assert torch.equal(dump.read(1, 0, "do"), torch.ones(2, 3, 8, 4))


def test_selection_parsing_and_errors(tmp_path):
    assert parse_steps("5,10:13,20:30:5") == {5, 10, 11, 12, 20, 25}
    assert parse_batch("0:2") == slice(0, 2) and parse_batch("3") == slice(3, 4) and parse_batch(None) is None
    for bad in ("", "a", "5:", "-1", "3:1:0"):
        with pytest.raises(CaptureError):
            parse_steps(bad)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(UserError):
        fa_forensics.capture(None, out=tmp_path / "file.txt", steps=[0]).__enter__()
    assert sdpa.active_session() is None
    with fa_forensics.capture(None, out=tmp_path / "a.zarr", steps=[0]):
        with pytest.raises(CaptureError, match="already active"):
            fa_forensics.capture(None, out=tmp_path / "b.zarr", steps=[0]).__enter__()


def test_record_of_an_o_that_is_not_attention_of_its_q_k_v_is_refused_and_training_goes_on(tmp_path):
    out = tmp_path / "run.zarr"
    q, k, v = (torch.randn(2, 3, 8, 4, requires_grad=True) for _ in range(3))
    with pytest.warns(CaptureWarning, match=r"fa_forensics.capture.record: its O does not follow from the Q, K, V"):
        with fa_forensics.capture(None, out=out, steps=[0, 1], step_by="manual", batch=None) as cap:
            for step in range(2):
                o = q * 2 + k + v  # not attention of q, k, v
                fa_forensics.capture.record(q, k, v, o, scale=0.5, causal=False)
                o.sum().backward()
                cap.step(loss=float(step))
    dump = open_dump(out)
    assert dump.steps == []
    assert [c["step"] for c in dump.attrs["capture"]["skipped_calls"]] == [0]
