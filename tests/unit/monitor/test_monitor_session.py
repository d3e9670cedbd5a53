"""The monitor inside a capture session: its statistics are those of the tensors training used."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import fa_forensics
from fa_forensics.capture import CaptureError
from fa_forensics.demo.model import GPT, GPTConfig
from fa_forensics.dump import open_dump
from fa_forensics.monitor import find_query_weights, head_statistics
from tiny_training import train_step

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def _train(model, cap, n_steps, report_loss=False, seed=1):
    """Real steps under bf16 autocast; returns the losses and the exact W_Q norms each step's forward used."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for _ in range(n_steps):
        w_q = [find_query_weights(b.attn, 2) for b in model.transformer.h]  # (H, D, C) or None
        norms.append([None if w is None else torch.linalg.matrix_norm(w.float(), ord=2) for w in w_q])
        loss = train_step(model, opt, gen, batch=3)
        if report_loss:
            cap.step(loss * 0 + 7.0)  # a reported loss wins over the tapped one
        losses.append(loss.item())
    return losses, norms


def test_monitor_statistics_are_those_of_the_recorded_tensors(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))  # pure-PyTorch flash attention reporting through capture.record
    out = tmp_path / "run.zarr"
    with fa_forensics.capture(model, out=out, steps=[6], batch=slice(0, 2), monitor_every=2) as cap:
        losses, norms = _train(model, cap, 9)
    dump = open_dump(out)
    tl = dump.timeline
    assert tl["step"].tolist() == [0, 2, 4, 6, 8] and cap.monitored_steps == [0, 2, 4, 6, 8]
    assert tl["loss"].tolist() == [losses[s] for s in (0, 2, 4, 6, 8)]
    assert dump.steps == [6] and dump.step_attrs(6)["loss"] == pytest.approx(losses[6])
    row = 3  # step 6, also dumped in full: the monitor saw exactly the stored Q, K (batch slice 0:2)
    for layer in (0, 1):
        q, k = dump.read(6, layer, "q"), dump.read(6, layer, "k")
        # a bf16 (autocast) kernel forms bf16 scores: the monitor counts in that precision by default
        ref = head_statistics(q, k, scale=dump.layer_info(6, layer).scale, causal=True, score_dtype=torch.bfloat16)
        np.testing.assert_array_equal(tl["near_max_ties"][row, layer], ref.near_max_ties.numpy())
        np.testing.assert_array_equal(tl["p_one_extra"][row, layer], ref.p_one_extra.numpy())
        np.testing.assert_allclose(tl["max_logit"][row, layer], ref.max_logit.numpy(), rtol=1e-6)
        np.testing.assert_allclose(tl["top1_prob"][row, layer], ref.top1_prob.numpy(), rtol=1e-5)
    # W_Q norm of the weights each step's forward used, exact from the first monitored step on
    exact = np.array([[n.numpy() for n in norms[s]] for s in (0, 2, 4, 6, 8)])  # (S, L, H)
    np.testing.assert_allclose(tl["wq_sigma"], exact, rtol=1e-6)
    assert not np.allclose(exact[0], exact[-1], rtol=1e-2)  # the weights did move


def test_reported_loss_wins_and_missing_query_weights_give_nan_with_one_warning(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    for block in model.transformer.h:  # a layout the documented name patterns do not know
        block.attn.fused = block.attn.c_attn
        del block.attn.c_attn
        block.attn.forward = _forward_with(block.attn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fa_forensics.capture(model, out=tmp_path / "r.zarr", steps=None, monitor_every=1) as cap:
            _train(model, cap, 3, report_loss=True)
    tl = open_dump(tmp_path / "r.zarr").timeline
    assert tl["loss"].tolist() == [7.0, 7.0, 7.0]
    assert np.isnan(tl["wq_sigma"]).all() and np.isfinite(tl["max_logit"]).all()
    messages = [str(w.message) for w in caught if "no W_Q found" in str(w.message)]
    assert len(messages) == 2 and "transformer.h.0.attn" in messages[0]  # once per module, not per step


def _forward_with(attn):
    import math

    from fa_forensics.capture import record
    from fa_forensics.demo.model import flash_attention_bf16

    def forward(x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in attn.fused(x).split(C, dim=2))
        o = flash_attention_bf16(q, k, v, 1 / math.sqrt(C // 2))
        record(q, k, v, o, scale=1 / math.sqrt(C // 2))
        return attn.c_proj(o.to(q.dtype).transpose(1, 2).reshape(B, T, C))

    return forward


def test_monitor_option_errors(tmp_path):
    with pytest.raises(CaptureError, match="alarm: needs monitor_every") as exc:
        fa_forensics.capture(None, out=tmp_path / "a.zarr", steps=[1], alarm=True)
    assert exc.value.setting == "alarm" and exc.value.needs == ("monitor_every",)  # the facts, for a CLI to word
    with pytest.raises(CaptureError, match="ring: needs alarm and monitor_every"):
        fa_forensics.capture(None, out=tmp_path / "a.zarr", steps=None, monitor_every=1, ring=3)
    with pytest.raises(CaptureError, match="at least one step"):
        fa_forensics.capture(None, out=tmp_path / "a.zarr", steps=None)
    with pytest.raises(CaptureError, match="timeline_flush_rows"):
        fa_forensics.capture(None, out=tmp_path / "a.zarr", steps=None, monitor_every=1, timeline_flush_rows=0)


def test_timeline_rows_are_buffered_k_at_a_time_and_flushed_at_exit_even_on_error(tmp_path):
    """Rows reach the store 4 at a time; the store then equals a row-by-row one; an exception still flushes."""
    stores = {}
    for flush in (1, 4):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY))
        out = tmp_path / f"k{flush}.zarr"
        on_disk = []
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        with pytest.raises(RuntimeError, match="boom"):
            with fa_forensics.capture(model, out=out, steps=None, monitor_every=1, timeline_flush_rows=flush) as cap:
                for _ in range(6):
                    idx = torch.randint(0, 256, (3, 32), generator=gen)
                    _, loss = model(idx, idx)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    cap.step(loss)  # the loss is known: the row is complete now
                    cap._writer.drain()  # what was queued is on disk
                    tl = open_dump(out).timeline
                    on_disk.append(0 if tl is None else len(tl["step"]))
                raise RuntimeError("boom")  # leaves the block by an exception: buffered rows are written
        stores[flush] = open_dump(out).timeline
        if flush == 4:  # steps 0..3 flushed together after step 3; steps 4, 5 wait in memory until exit
            assert on_disk[:3] == [0, 0, 0] and on_disk[3:] == [4, 4, 4]
        else:  # row by row, as soon as each step ends
            assert on_disk == [1, 2, 3, 4, 5, 6]
    assert stores[4]["step"].tolist() == stores[1]["step"].tolist() == list(range(6))
    for key in stores[1]:
        np.testing.assert_array_equal(stores[4][key], stores[1][key])


def test_append_timeline_rows_equals_row_by_row_appends_with_missing_and_new_series(tmp_path):
    from fa_forensics.dump import DumpWriter

    rows = [  # a row with only the loss (no attention call seen), a series that appears later
        (0, {"loss": 3.0, "max_logit": np.arange(4.0).reshape(2, 2)}),
        (1, {"loss": float("nan")}),
        (2, {"loss": 2.5, "max_logit": np.ones((2, 2)), "alarms": 1}),
    ]
    one, many = DumpWriter(tmp_path / "one.zarr", {}), DumpWriter(tmp_path / "many.zarr", {})
    for step, series in rows:
        one.append_timeline(step, **series)
    many.append_timeline_rows(rows[:1])
    many.append_timeline_rows(rows[1:])
    one.close(), many.close()
    a, b = open_dump(tmp_path / "one.zarr").timeline, open_dump(tmp_path / "many.zarr").timeline
    assert sorted(a) == sorted(b) == ["alarms", "loss", "max_logit", "step"]
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
        assert a[key].dtype == b[key].dtype
    assert np.isnan(b["max_logit"][1]).all() and np.isnan(b["alarms"][:2]).all() and b["alarms"][2] == 1


def test_an_alarm_puts_its_row_on_disk_while_the_run_goes_on(tmp_path, recwarn):
    """Rows are buffered 16 at a time, but an alarm flushes them: a reader sees the alarm step at once."""
    from fa_forensics.monitor import AlarmRule

    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    out = tmp_path / "alarm.zarr"
    rule = AlarmRule(window=8, min_history=4, warmup=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    with fa_forensics.capture(model, out=out, steps=None, monitor_every=1, alarm=rule, alarm_steps=0) as cap:
        for n in range(10):
            idx = torch.randint(0, 256, (3, 32), generator=gen)
            _, loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.step(100.0 if n >= 8 else 3.0 + 0.01 * n)  # a loss spike from step 8: it alarms on its second step
        cap._writer.drain()  # what was queued is on disk; nothing forces the 16-row buffer but the alarm
        tl = open_dump(out).timeline
        assert tl is not None and tl["step"].tolist() == list(range(10)) and tl["loss"][9] == 100.0
    assert [a.metric for a in cap.alarms] == ["loss"] and cap.alarms[0].step == 9
    from fa_forensics.capture.events import AlarmWarning

    alarm_lines = [str(w.message) for w in recwarn if issubclass(w.category, AlarmWarning)]  # a warning, not a print
    assert len(alarm_lines) == 1 and "alarm: step 9" in alarm_lines[0]
