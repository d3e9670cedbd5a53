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


def test_a_named_layout_the_shapes_contradict_is_stored_as_they_show_and_said_once(tmp_path):
    out, js = tmp_path / "run.zarr", tmp_path / "cli.json"  # BlockedAttention takes (B, H, T, D): named as BTHD
    run = _cli(["capture", "--out", str(out), "--steps", "1", "--attention",
                "blocked_attention:BlockedAttention,layout=BTHD", "--softmax", "standard", "--json", str(js), "--",
                sys.executable, str(SCRIPT), "3", str(tmp_path / "losses.json")], cwd=tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    said = [w for w in json.loads(js.read_text())["warnings"] if "read as" in w]
    assert len(said) == 1 and "q (2, 2, 20, 16) read as BTHD has batch 2, 20 heads, length 2" in said[0]
    assert "read as BHTD (batch 2, 2 heads, length 20) it fits" in said[0]
    d = open_dump(out)
    for layer in (0, 1):
        attrs = dict(d._layer(1, layer).attrs)
        assert attrs["layout"] == "BHTD" and attrs["first_call_check"]["checked"] is True
        q, k, v = (d.read(1, layer, n).double() for n in "qkv")
        assert q.shape == (2, 2, 20, 16)
        s = (q @ k.transpose(-1, -2) * attrs["scale"]).masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1),
                                                                    float("-inf"))
        assert torch.allclose(d.read(1, layer, "o").double(), torch.softmax(s, -1) @ v, atol=1e-6)


EDGE = Path(__file__).resolve().parents[1] / "data" / "plain_attention" / "edge_cases.py"


def _capture_edge(tmp_path, form, *extra, steps="1", out="run.zarr"):
    """The plain run and the captured run of tests/data/plain_attention/edge_cases.py in `form`."""
    plain = _run([sys.executable, str(EDGE), form, "3", str(tmp_path / "plain.json"), *extra])
    assert plain.returncode == 0, plain.stderr
    run = _cli(["capture", "--out", str(tmp_path / out), "--steps", steps, "--json", str(tmp_path / "cli.json"),
                "--", sys.executable, str(EDGE), form, "3", str(tmp_path / "captured.json"), *extra])
    return run, json.loads((tmp_path / "plain.json").read_text())


def test_heads_first_layout_in_torch_ops_is_stored_as_bhtd_and_said_in_info(tmp_path):
    run, plain = _capture_edge(tmp_path, "hbtd")
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "captured.json").read_text()) == plain  # training ran as without capture
    assert json.loads((tmp_path / "cli.json").read_text())["warnings"] == []
    d = open_dump(tmp_path / "run.zarr")
    for layer in (0, 1):
        attrs = dict(d._layer(1, layer).attrs)
        assert attrs["layout"] == "HBTD" and attrs["source"] == "torch_ops"
        assert d.read(1, layer, "q").shape == (3, 4, 16, 8) and d.read(1, layer, "do").shape == (3, 4, 16, 8)
        assert d.read(1, layer, "x").shape == (3, 16, 32)
    info = _cli(["info", str(tmp_path / "run.zarr"), "--json", str(tmp_path / "info.json")])
    assert info.returncode == 0 and "HBTD → BHTD" in info.stdout, info.stdout


def test_inline_softcap_is_recorded_as_a_fact_and_replayed(tmp_path):
    run, plain = _capture_edge(tmp_path, "softcap")
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "captured.json").read_text()) == plain
    d = open_dump(tmp_path / "run.zarr")
    attrs = dict(d._layer(1, 0).attrs)
    assert attrs["softcap"] == 5.0 and attrs["scale"] == pytest.approx(8 ** -0.5) and attrs["causal"] is True
    assert "tanh" in attrs["chain"]
    q, k, v = (d.read(1, 0, n).double() for n in "qkv")
    s = 5.0 * torch.tanh(q @ k.transpose(-1, -2) * attrs["scale"] / 5.0)
    s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(d.read(1, 0, "o").double(), torch.softmax(s, -1) @ v, atol=1e-6)
    match = _cli(["match", str(tmp_path / "run.zarr"), "--step", "1", "--layer", "0", "--match-cache", "off",
                  "--json", str(tmp_path / "match.json")])
    assert match.returncode == 0, match.stderr
    best = json.loads((tmp_path / "match.json").read_text())["layers"][0]["candidates"][0]
    assert best["max_abs_err"] < 1e-6  # the replay applies the cap (without it O misses by far more)


def test_alibi_under_bf16_autocast_matches_and_every_analysis_runs(tmp_path):
    run, plain = _capture_edge(tmp_path, "alibi", "bf16")
    assert run.returncode == 0, run.stderr
    d = open_dump(tmp_path / "run.zarr")
    assert dict(d._layer(1, 0).attrs)["mask"] == "additive"
    report = _cli(["report", str(tmp_path / "run.zarr"), "--step", "1", "--layer", "0", "--out",
                   str(tmp_path / "report"), "--match-cache", "off", "--json", str(tmp_path / "report.json")])
    assert report.returncode == 0, report.stderr
    sections = json.loads((tmp_path / "report.json").read_text())["sections"]
    assert len(sections) >= 6 and all(s["exit_code"] == 0 for s in sections), sections
    for preset in ("flash-attn-2", "sdpa-flash"):  # the exp2 kernel models take the bias, chosen by no one
        isolate = _cli(["isolate", str(tmp_path / "run.zarr"), "--step", "1", "--layer", "0", "--preset", preset])
        assert isolate.returncode == 0, (preset, isolate.stderr)


ATTEND = """
import torch


def attend(q, k, v, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    T = q.shape[-2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v
"""

ATTEND_TRAIN = """
import json, sys
import torch
import torch.nn as nn
from myattn import attend


class Attn(nn.Module):
    def __init__(self, c=32, h=4):
        super().__init__()
        self.qkv, self.proj, self.h = nn.Linear(c, 3 * c), nn.Linear(c, c), h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        return self.proj(attend(q, k, v, (C // self.h) ** -0.5).transpose(1, 2).reshape(B, T, C))


torch.manual_seed(0)
emb, head = nn.Embedding(64, 32), nn.Linear(32, 64)
layers = nn.ModuleList([Attn() for _ in range(2)])
opt = torch.optim.SGD([*emb.parameters(), *layers.parameters(), *head.parameters()], lr=0.1)
ids = torch.randint(0, 64, (2, 13))
losses = []
for step in range(3):
    x = emb(ids[:, :-1])
    for layer in layers:
        x = x + layer(x)
    loss = nn.functional.cross_entropy(head(x).reshape(-1, 64), ids[:, 1:].reshape(-1))
    loss.backward(); opt.step(); opt.zero_grad()
    losses.append(loss.item())
json.dump(losses, open(sys.argv[1], "w"))
"""


def test_a_mapping_that_swaps_q_and_k_is_refused_with_its_numbers_and_training_goes_on(tmp_path):
    (tmp_path / "myattn.py").write_text(ATTEND)
    (tmp_path / "train.py").write_text(ATTEND_TRAIN)
    right = _cli(["capture", "--out", str(tmp_path / "right.zarr"), "--steps", "1", "--softmax", "standard",
                  "--attention", "myattn:attend", "--", sys.executable, "train.py", "right.json"], cwd=tmp_path)
    assert right.returncode == 0, right.stderr
    check = dict(open_dump(tmp_path / "right.zarr")._layer(1, 0).attrs)["first_call_check"]
    assert check["checked"] is True and check["error"] <= check["tolerance"] < 1e-5
    js = tmp_path / "cli.json"
    swapped = _cli(["capture", "--out", str(tmp_path / "swapped.zarr"), "--steps", "1", "--softmax", "standard",
                    "--attention", "myattn:attend,q=k,k=q", "--json", str(js), "--", sys.executable, "train.py",
                    "swapped.json"], cwd=tmp_path)
    assert "Traceback" not in swapped.stderr, swapped.stderr
    said = [w for w in json.loads(js.read_text())["warnings"] if "does not follow" in w]
    assert len(said) == 1, swapped.stderr
    assert "myattn:attend,layout=BHTD,q=k,k=q: its O does not follow from the Q, K, V" in said[0]
    error = float(said[0].split("·V| = ")[1].split(" ")[0])
    allowed = float(said[0].split("allows ")[1].split(" ")[0])
    assert error > 0.1 and allowed < 1e-5 and "q=, k=, v= in --attention" in said[0]
    assert len(json.loads((tmp_path / "swapped.json").read_text())) == 3  # training went on to its end
    d = open_dump(tmp_path / "swapped.zarr")
    assert d.steps == []  # the layer is not stored as right
    skipped = d.attrs["capture"]["skipped_calls"]
    assert skipped[0]["source"] == "myattn:attend,layout=BHTD,q=k,k=q" and "does not follow" in skipped[0]["why"]


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
