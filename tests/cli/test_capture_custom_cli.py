"""`fa-forensics capture --attention MODULE:QUALNAME -- python train.py` on an unmodified script whose
attention is an autograd Function in the style of the paper's pure-PyTorch FlashAttention-2
(tests/data/custom_attention), and what a capture that sees no attention call says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fa_forensics.dump import open_dump

pytestmark = pytest.mark.slow  # starts training scripts under capture

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "custom_attention" / "train_tiny.py"


def _run(args, env=None, cwd=None):
    return subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=cwd, env={**os.environ, **(env or {})})


def _cli(args, **kw):
    return _run([sys.executable, "-m", "fa_forensics.cli", *args], **kw)


def test_named_function_captured_through_the_cli_with_bit_equal_losses(tmp_path):
    stable = {"TINY_STABLE": "1"}
    plain = _run([sys.executable, str(SCRIPT), "4", str(tmp_path / "plain.json")], env=stable)
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "run.zarr"
    run = _cli(["capture", "--out", str(out), "--steps", "1,2", "--attention", "blocked_attention:BlockedAttention",
                "--softmax", "TINY_STABLE=1", "--json", str(tmp_path / "cli.json"), "--",
                sys.executable, str(SCRIPT), "4", str(tmp_path / "captured.json")], env=stable, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    losses = json.loads((tmp_path / "captured.json").read_text())
    assert losses == json.loads((tmp_path / "plain.json").read_text())  # capture changes nothing training computes
    d = open_dump(out)
    assert d.steps == [1, 2] and d.layers() == [0, 1]
    for step in (1, 2):
        assert d.step_attrs(step)["loss"] == losses[step]
        for layer in (0, 1):
            assert sorted(d._array_names(step, layer)) == ["do", "k", "o", "q", "v", "x"]
            attrs = dict(d._layer(step, layer).attrs)
            assert attrs["softmax"] == "stabilized" and attrs["module"] == f"h.{layer}.attn" and attrs["causal"] is True
            q, k, v = (d.read(step, layer, n).double() for n in "qkv")
            future = torch.ones(20, 20, dtype=torch.bool).triu(1)
            s = (q @ k.transpose(-1, -2) * attrs["scale"]).masked_fill(future, float("-inf"))
            assert torch.allclose(d.read(step, layer, "o").double(), torch.softmax(s, -1) @ v, atol=1e-6)
    assert d.attrs["capture"]["attention"] == ["blocked_attention:BlockedAttention,layout=BHTD"]
    assert json.loads((tmp_path / "cli.json").read_text())["warnings"] == []


def test_no_attention_call_seen_is_one_line_and_the_empty_dump_says_so(tmp_path):
    out, js = tmp_path / "empty.zarr", tmp_path / "cli.json"
    run = _cli(["capture", "--out", str(out), "--steps", "1,2", "--json", str(js), "--",
                sys.executable, str(SCRIPT), "3", str(tmp_path / "losses.json")], cwd=tmp_path)
    assert run.returncode == 1
    said = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "step 1 ran but no attention call was seen" in said[0], run.stderr
    assert "--attention MODULE:QUALNAME" in said[0] and "flash_attn" in said[0] and "never reached" not in run.stderr
    summary = json.loads(js.read_text())
    assert summary["never_reached"] == [] and summary["ran_without_attention"] == [1, 2] and summary["steps_run"] == 3
    assert summary["warnings"] == [said[0]]
    for command in ("info", "verify"):
        result = _cli([command, str(out)])
        assert result.returncode == 1 and "holds no recorded step" in result.stderr, (command, result.stderr)


def test_bad_attention_options_and_a_layout_that_does_not_fit_are_one_line(tmp_path):
    from typer.testing import CliRunner

    from fa_forensics.cli import app

    for option, value, said in (("--attention", "nocolon", "does not name a callable"),
                                ("--attention", "m:f,layout=HTD", "not a layout"),
                                ("--softmax", "weird", "not a softmax rule")):
        run = CliRunner().invoke(app, ["capture", "--out", str(tmp_path / "a.zarr"), "--steps", "1", option, value,
                                       "--", "python", "t.py"])
        assert run.exit_code == 2 and said in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    script = tmp_path / "swapped.py"  # (B, H, T, D) tensors reported as BTHD: heads of q and k differ
    script.write_text("import torch, fa_forensics\n"
                      "w = torch.nn.Parameter(torch.ones(()))\n"
                      "q, k = torch.randn(1, 2, 5, 4) * w, torch.randn(1, 2, 3, 4) * w\n"
                      "fa_forensics.capture.record(q, k, k, q, layout='BTHD')\n"
                      "q.sum().backward(); torch.optim.SGD([w], lr=0.1).step()\n")
    run = _cli(["capture", "--out", str(tmp_path / "b.zarr"), "--steps", "0", "--", sys.executable, str(script)])
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "layout: fa_forensics.capture.record: " in run.stderr and "read as BTHD" in run.stderr


PLAIN = Path(__file__).resolve().parents[1] / "data" / "plain_attention" / "nanogpt_manual.py"


def test_nanogpt_manual_attention_is_captured_without_flags_and_losses_are_bit_equal(tmp_path):
    plain = _run([sys.executable, str(PLAIN), "3", str(tmp_path / "plain.json"), "0.1"])
    assert plain.returncode == 0, plain.stderr
    out, js = tmp_path / "run.zarr", tmp_path / "cli.json"
    run = _cli(["capture", "--out", str(out), "--steps", "1", "--json", str(js), "--",
                sys.executable, str(PLAIN), "3", str(tmp_path / "captured.json"), "0.1"])
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "captured.json").read_text()) == json.loads((tmp_path / "plain.json").read_text())
    d = open_dump(out)
    assert d.steps == [1] and d.layers() == [0, 1]
    attrs = dict(d._layer(1, 0).attrs)
    assert attrs["source"] == "torch_ops" and attrs["causal"] is True and attrs["dropout_p"] == 0.1
    summary = json.loads(js.read_text())
    assert summary["warnings"] == [] and summary["do_missing"] == {}


def test_a_transposed_layout_is_refused_with_one_line_and_nothing_stored(tmp_path):
    out = tmp_path / "run.zarr"  # BlockedAttention takes (B, H, T, D): named as BTHD, X's length shows it
    run = _cli(["capture", "--out", str(out), "--steps", "1", "--attention",
                "blocked_attention:BlockedAttention,layout=BTHD", "--softmax", "standard", "--",
                sys.executable, str(SCRIPT), "3", str(tmp_path / "losses.json")], cwd=tmp_path)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(lines) == 1, run.stderr
    assert "read as BTHD has batch 2, 20 heads, length 2" in lines[0] and "read as BHTD" in lines[0]
    assert "name it with layout=BHTD in --attention" in lines[0]
    assert not out.exists() or open_dump(out).steps == []


GPT2_EAGER = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
cfg._attn_implementation = "eager"
model = GPT2LMHeadModel(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 64, (2, 16))
for step in range(2):
    model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()
"""


def test_hf_eager_function_named_with_its_output_layout(tmp_path):
    script, out = tmp_path / "train.py", tmp_path / "run.zarr"
    script.write_text(GPT2_EAGER)
    target = "transformers.models.gpt2.modeling_gpt2:eager_attention_forward"
    refused = _cli(["capture", "--out", str(out), "--steps", "1", "--attention", target, "--",
                    sys.executable, str(script)])
    assert refused.returncode == 2 and "o fits BTHD: name it with o_layout=BTHD" in refused.stderr, refused.stderr
    run = _cli(["capture", "--out", str(out), "--steps", "1", "--attention", f"{target},o_layout=BTHD",
                "--softmax", "standard", "--", sys.executable, str(script)])
    assert run.returncode == 0, run.stderr
    attrs = dict(open_dump(out)._layer(1, 0).attrs)
    assert attrs["source"] == f"{target},layout=BHTD,o_layout=BTHD" and attrs["hf_attention"] == "eager"
    assert attrs["causal"] is False and attrs["mask"] == "bool"  # HF's eager mask, read as `attention_mask`
