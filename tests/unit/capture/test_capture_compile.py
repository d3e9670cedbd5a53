"""Capture on a torch.compile'd nanoGPT-shaped model: the run computes the same bits with and without capture."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from toolchain import NEEDS_CXX

import fa_forensics
from fa_forensics.demo.model import GPT, GPTConfig
from fa_forensics.dump import open_dump

TINY = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, attention="sdpa")



def _compiled_run(out=None, steps=(1, 2), n_steps=4):
    """n_steps real AdamW steps of torch.compile(GPT) under bf16 autocast; (losses, dynamo counters)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    session = fa_forensics.capture(compiled, out=out, steps=list(steps), batch=None) if out is not None else None
    if session is not None:
        session.start()
    try:
        for _ in range(n_steps):
            idx = torch.randint(0, 256, (2, 16), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = compiled(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
            if session is not None:
                session.step(loss)
    finally:
        if session is not None:
            session.stop()
    return losses, {k: dict(v) for k, v in counters.items()}


@NEEDS_CXX
@pytest.mark.slow
def test_compiled_training_is_bit_equal_with_capture_and_stores_what_sdpa_computed(tmp_path):
    plain, plain_counters = _compiled_run()
    out = tmp_path / "run.zarr"
    captured, counters = _compiled_run(out)
    # the losses of every step (selected 1, 2; unselected 0, 3) are bit-equal to the run without capture
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))
    assert not counters.get("graph_break")
    # one graph for steps that are not busy (the graph of the run without capture), one for busy steps
    assert plain_counters["stats"]["unique_graphs"] == 1 and counters["stats"]["unique_graphs"] == 2
    dump = open_dump(out)
    assert dump.steps == [1, 2] and dump.layers() == [0, 1]
    for step in (1, 2):
        assert dump.step_attrs(step)["loss"] == pytest.approx(float(captured[step]))
        for layer in (0, 1):
            info = dump.layer_info(step, layer)
            assert info.module == f"_orig_mod.transformer.h.{layer}.attn"
            assert info.dtype == "bfloat16" and info.autocast is True and info.dropout_p == 0.0
            q, k, v, o, do, x = (dump.read(step, layer, n) for n in ("q", "k", "v", "o", "do", "x"))
            assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), o)
            assert do.shape == o.shape and do.abs().sum() > 0 and x.shape == (2, 16, 32)
