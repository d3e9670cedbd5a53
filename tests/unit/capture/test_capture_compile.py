"""Capture on a torch.compile'd nanoGPT-shaped model: the run computes the same bits with and without capture,
and recording a step compiles nothing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from toolchain import NEEDS_CXX

import fa_forensics
from fa_forensics.demo.model import GPT, GPTConfig
from fa_forensics.dump import open_dump
from tiny_training import train_step

TINY = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, attention="sdpa")


def _compile_work() -> dict:
    """What dynamo and inductor have compiled so far: frames traced, graphs, inductor graphs (forward and the
    backward compiled at its first run), from torch's own counters."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "inductor_graphs": sum(inductor[k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                                         "fxgraph_cache_bypass"))}


def _compiled_run(schedule, tmp_path=None):
    """Real AdamW steps of torch.compile(GPT) under bf16 autocast, in blocks: each (n_steps, capture options or
    None). Returns (losses, compile work after each step, graph breaks, sessions)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses, work, sessions = [], [], []
    for block, (n_steps, options) in enumerate(schedule):
        session = None
        if options is not None:
            session = fa_forensics.capture(compiled, out=tmp_path / f"run{block}.zarr", batch=None, **options)
            session.start()
            sessions.append(session)
        try:
            for _ in range(n_steps):
                loss = train_step(compiled, opt, gen, seq=16)
                losses.append(loss.detach().clone())
                work.append(_compile_work())
                if session is not None:
                    session.step(loss)
        finally:
            if session is not None:
                session.stop()
    return losses, work, dict(counters["graph_break"]), sessions


@pytest.fixture(scope="module")
def plain_run():
    """The run without capture: 7 steps."""
    losses, work, breaks, _ = _compiled_run([(7, None)])
    return losses, work, breaks


def _check_recorded_step(dump, step: int, loss: torch.Tensor) -> None:
    assert dump.step_attrs(step)["loss"] == pytest.approx(float(loss))
    for layer in (0, 1):
        info = dump.layer_info(step, layer)
        assert info.module == f"_orig_mod.transformer.h.{layer}.attn"
        assert info.dtype == "bfloat16" and info.autocast is True and info.dropout_p == 0.0
        q, k, v, o, do, x = (dump.read(step, layer, n) for n in ("q", "k", "v", "o", "do", "x"))
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), o)
        assert do.shape == o.shape and do.abs().sum() > 0 and x.shape == (2, 16, 32)


@NEEDS_CXX
@pytest.mark.slow
def test_compiled_under_capture_is_bit_equal_and_compiles_the_graphs_of_the_run_without_capture(tmp_path, plain_run):
    """The session starts before the model's first compiled call (as under the launcher)."""
    plain, plain_work, plain_breaks = plain_run
    captured, work, breaks, _ = _compiled_run([(4, dict(steps=[1, 2]))], tmp_path)
    # the losses of every step (selected 1, 2; unselected 0, 3) are bit-equal to the run without capture
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))
    assert not breaks and not plain_breaks
    # exactly the compile work of the run without capture: one graph, nothing recompiled at the recorded steps
    assert work[-1] == plain_work[3] and work[0] == work[-1] and work[0]["graphs"] == 1
    dump = open_dump(tmp_path / "run0.zarr")
    assert dump.steps == [1, 2] and dump.layers() == [0, 1]
    for step in (1, 2):
        _check_recorded_step(dump, step, captured[step])


@NEEDS_CXX
@pytest.mark.slow
def test_capture_of_a_model_compiled_before_it_recompiles_nothing_at_recorded_or_monitored_steps(tmp_path, plain_run):
    """2 steps without capture, a session that monitors every 2nd step and records its step 1, then a second
    session recording its step 0: the first session's first step compiles its graph (the SDPA patch and the
    hooks are new code to dynamo); after it, nothing is compiled, in either session."""
    plain = plain_run[0]
    schedule = [(2, None), (3, dict(steps=[1], monitor_every=2)), (2, dict(steps=[0]))]
    captured, work, breaks, (first, second) = _compiled_run(schedule, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))
    assert not breaks
    warm = work[2]  # after the first session's first step
    assert warm["graphs"] == work[1]["graphs"] + 1  # the one compile: the session's graph, taps included
    assert all(w == warm for w in work[3:])
    assert first.recorded_steps == [1] and first.monitored_steps == [0, 2] and second.recorded_steps == [0]
    _check_recorded_step(open_dump(tmp_path / "run1.zarr"), 1, captured[3])
    _check_recorded_step(open_dump(tmp_path / "run2.zarr"), 0, captured[5])
