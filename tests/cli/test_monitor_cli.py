"""`fa-forensics capture --monitor-every / --alarm / --ring` on an unmodified training script."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fa_forensics.dump import open_dump

pytestmark = pytest.mark.slow  # starts monitored training scripts

# An unmodified training script (nothing in it knows about fa-forensics): a 2-layer attention
# model on a copy task, bf16 autocast, SDPA. From step TIE_FROM on, every odd key is replaced by
# the key before it, so many rows attain their maximum twice (the paper's trigger, App. E.1).
# The script writes the losses it computed, one per line.
SCRIPT = textwrap.dedent('''
    import sys, torch, torch.nn as nn, torch.nn.functional as F

    steps, losses_path, tie_from = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    state = {"step": 0}

    class Attn(nn.Module):
        def __init__(s, C, H):
            super().__init__(); s.H = H; s.c_attn = nn.Linear(C, 3 * C); s.c_proj = nn.Linear(C, C)
        def forward(s, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, s.H, C // s.H).transpose(1, 2) for t in s.c_attn(x).split(C, 2))
            if 0 <= tie_from <= state["step"]:
                k = torch.repeat_interleave(k[:, :, 0::2], 2, dim=2)  # keys 2j and 2j+1 equal
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return s.c_proj(o.transpose(1, 2).reshape(B, T, C))

    class Block(nn.Module):
        def __init__(s, C, H):
            super().__init__(); s.ln = nn.LayerNorm(C); s.attn = Attn(C, H)
        def forward(s, x):
            return x + s.attn(s.ln(x))

    class Net(nn.Module):
        def __init__(s, C=32, H=2, L=2):
            super().__init__(); s.emb = nn.Embedding(64, C); s.out = nn.Linear(C, 64)
            s.h = nn.ModuleList([Block(C, H) for _ in range(L)])
        def forward(s, idx):
            x = s.emb(idx)
            for b in s.h:
                x = b(x)
            return s.out(x)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = Net(); opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for it in range(steps):
        state["step"] = it
        idx = torch.randint(0, 64, (3, 32))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(idx).float().view(-1, 64), idx.view(-1))
        loss.backward()
        opt.step(); opt.zero_grad()
        losses.append(loss.item())
    with open(losses_path, "w") as f:
        f.write("\\n".join(repr(x) for x in losses))
''')


def _capture(tmp_path, name, options, steps, tie_from=-1):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out, losses, js = tmp_path / f"{name}.zarr", tmp_path / f"{name}_losses.txt", tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, "-m", "fa_forensics.cli", "capture", "--out", str(out), *options, "--json", str(js),
         "--", sys.executable, str(script), str(steps), str(losses), str(tie_from)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    computed = [float(line) for line in losses.read_text().split()]
    return open_dump(out), computed, json.loads(js.read_text()), result.stderr


def test_timeline_has_one_row_per_step_with_the_losses_the_script_computed(tmp_path):
    dump, computed, summary, stderr = _capture(tmp_path, "plain", ["--monitor-every", "1"], steps=12)
    tl = dump.timeline
    assert tl["step"].tolist() == list(range(12))
    assert tl["loss"].tolist() == computed  # the scalar backward() was called on, bit for bit
    for metric in ("max_logit", "near_max_ties", "p_one_extra", "top1_prob", "wq_sigma"):
        assert tl[metric].shape == (12, 2, 2) and np.isfinite(tl[metric]).all(), metric
    assert ((tl["top1_prob"] > 0) & (tl["top1_prob"] <= 1)).all()
    assert dump.steps == [] and summary["monitored_steps"] == 12 and summary["alarm_steps"] == []
    assert "alarm" not in stderr
    # every 5th step: rows at 0, 5, 10 only
    dump5, computed5, _, _ = _capture(tmp_path, "every5", ["--monitor-every", "5", "--steps", "7"], steps=12)
    assert dump5.timeline["step"].tolist() == [0, 5, 10]
    assert dump5.timeline["loss"].tolist() == [computed5[0], computed5[5], computed5[10]]
    assert dump5.steps == [7]


@pytest.mark.parametrize("ring", [0, 4])
def test_planted_ties_raise_one_alarm_and_dump_the_steps_after_and_with_ring_before(tmp_path, ring):
    tie_from = 55  # after the rule's warmup (50 monitored steps)
    options = ["--monitor-every", "1", "--alarm", "--alarm-steps", "3", "--layers", "1", "--batch", "0:2"]
    if ring:
        options += ["--ring", str(ring)]
    dump, computed, summary, stderr = _capture(tmp_path, f"ring{ring}", options, steps=62, tie_from=tie_from)
    alarm_lines = [line for line in stderr.splitlines() if "fa-forensics alarm" in line]
    # persist 3: the tie count is out at steps 55, 56, 57 → one alarm at 57, naming layer and head
    assert len(alarm_lines) == 1, stderr
    assert re.search(r"alarm: step 57 layer \d head \d: near_max_ties = \d+", alarm_lines[0]), alarm_lines[0]
    assert summary["alarm_steps"] == [57]
    total = dump.timeline["near_max_ties"].sum(axis=(1, 2))  # (S,) tied rows over every layer and head
    assert total[tie_from:].min() > 2 * total[40:tie_from].max()  # the planted drift is what the timeline shows
    expected = [58, 59, 60] if not ring else [54, 55, 56, 57, 58, 59, 60]
    assert dump.steps == expected and dump.incomplete_steps == []
    for step in expected:
        assert dump.layers(step) == [1]
        attrs = dump.step_attrs(step)
        assert attrs["recorded_by"] == ("ring" if step <= 57 else "alarm")
        assert attrs["loss"] == pytest.approx(computed[step], rel=1e-6)
        q, k = dump.read(step, 1, "q"), dump.read(step, 1, "k")
        assert q.shape == (2, 2, 32, 16) and dump.read(step, 1, "do").shape == (2, 2, 32, 16)
        planted = step >= tie_from
        assert torch_equal(k[:, :, 0::2], k[:, :, 1::2]) == planted  # the dump holds the tensors of that very step


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_monitor_option_errors_are_one_line(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print('never runs')\n")
    for options, text in ((["--alarm", "--steps", "1"], "--monitor-every"), (["--monitor-every", "1", "--ring", "3"],
                                                                             "--alarm"),
                          ([], "--steps"), (["--monitor-every", "0"], "--monitor-every: must be a step interval >= 1")):
        result = subprocess.run([sys.executable, "-m", "fa_forensics.cli", "capture", "--out", str(tmp_path / "x.zarr"),
                                 *options,
                                 "--", sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and text in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "never runs" not in result.stdout
