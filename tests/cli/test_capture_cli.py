"""`fa-forensics capture -- python script.py` on an unmodified script, and `demo-train --capture`."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from fa_forensics.capture.command_line import rewrite_command
from fa_forensics.dump import open_dump
from fa_forensics.errors import UserError

pytestmark = pytest.mark.slow  # starts training scripts under capture

# An unmodified training script: nothing in it knows about fa-forensics. It binds SDPA at import
# time (the launcher patches before the script runs), runs an eval forward under no_grad each
# iteration (never recorded), and trains with bf16 autocast. It saves what training computed.
SCRIPT = textwrap.dedent('''
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    class Attn(nn.Module):
        def __init__(s, C, H):
            super().__init__(); s.H = H; s.qkv = nn.Linear(C, 3 * C); s.proj = nn.Linear(C, C)
        def forward(s, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, s.H, C // s.H).transpose(1, 2) for t in s.qkv(x).split(C, 2))
            s.o = sdpa(q, k, v, is_causal=True)
            if s.o.requires_grad:
                s.o.retain_grad()
            return s.proj(s.o.transpose(1, 2).reshape(B, T, C))

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

    steps, save = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    net = Net(); opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    seen = {}
    for it in range(steps):
        idx = torch.randint(0, 64, (3, 16))
        with torch.no_grad():
            net(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(idx).float().view(-1, 64), idx.view(-1))
        loss.backward()
        seen[it] = [(b.attn.o.detach(), b.attn.o.grad) for b in net.h]
        opt.step(); opt.zero_grad()
    torch.save(seen, save)
''')


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", "fa_forensics.cli", *args], capture_output=True, text=True,
                          timeout=240, **kw)


def test_unmodified_script_under_capture_records_the_selected_steps(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out, seen, js = tmp_path / "run.zarr", tmp_path / "seen.pt", tmp_path / "summary.json"
    result = _run(["capture", "--out", str(out), "--steps", "1:4:2", "--layers", "1", "--batch", "0:2", "--json",
                   str(js),
                   "--", sys.executable, str(script), "4", str(seen)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads(js.read_text())
    assert summary["steps"] == [1, 3] and summary["incomplete_steps"] == [] and summary["layers"] == [1]
    dump = open_dump(out)
    expected = torch.load(seen)
    for step in (1, 3):
        o_train, do_train = expected[step][1]
        assert dump.layer_info(step, 1).module == "h.1.attn"
        assert torch.equal(dump.read(step, 1, "o"), o_train[:2])
        assert torch.equal(dump.read(step, 1, "do"), do_train[:2])
        assert dump.read(step, 1, "x").shape == (2, 16, 32)
    assert dump.attrs["capture"]["command"][-2] == "4"


def test_capture_cli_bad_input_is_one_line(tmp_path):
    for args in (["--out", str(tmp_path / "a.zarr"), "--steps", "x", "--", "python", "t.py"],
                 ["--out", str(tmp_path / "a.zarr"), "--steps", "1", "--", "ls", "-l"]):
        result = _run(["capture", *args])
        assert result.returncode == 2
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    (tmp_path / "notadump").mkdir()
    (tmp_path / "notadump" / "f.txt").write_text("x")
    script = tmp_path / "t.py"
    script.write_text("print('should not matter')\n")
    result = _run(["capture", "--out", str(tmp_path / "notadump"), "--steps", "1", "--", sys.executable, str(script)])
    assert result.returncode == 2 and "not an fa-forensics dump" in result.stderr and "Traceback" not in result.stderr


def test_rewrite_command():
    # a bare python / python3 runs under this interpreter (not a PATH shim's); --path-python keeps the name
    assert rewrite_command(["python", "-u", "train.py", "--lr", "1"]) == [sys.executable, "-u", "-m",
                                                                          "fa_forensics.capture.launch", "train.py",
                                                                          "--lr", "1"]
    assert rewrite_command(["python3", "-m", "pkg.train", "a"], same_python=False) == ["python3", "-m",
                                                                                       "fa_forensics.capture.launch",
                                                                                       "--module", "pkg.train", "a"]
    assert rewrite_command(["/opt/py/bin/python", "t.py"])[0] == "/opt/py/bin/python"  # an explicit path is kept
    launcher = "fa_forensics.capture.launch"
    # a distributed launcher: the capture launcher goes in front of the script, found by the launcher's own parser
    # (a bare torchrun runs as this interpreter's torch.distributed.run)
    assert rewrite_command(["torchrun", "--nproc_per_node", "2", "--max-restarts", "0", "train.py", "--lr", "1"]) == [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "0", "--module",
        launcher, "train.py", "--lr", "1"]
    assert rewrite_command(["torchrun", "--nproc_per_node", "2", "train.py", "x"], same_python=False) == [
        "torchrun", "--nproc_per_node", "2", "--module", launcher, "train.py", "x"]
    assert rewrite_command(["python", "-m", "torch.distributed.launch", "--nproc_per_node=2", "--use-env", "t.py"]) == [
        sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", "--use-env", "--module", launcher,
        "t.py"]
    assert rewrite_command(["python3", "-m", "torch.distributed.run", "-m", "pkg.train", "a"], same_python=False) == [
        "python3", "-m", "torch.distributed.run", "-m", launcher, "--module", "pkg.train", "a"]
    from fa_forensics.capture.command_line import launcher_file

    assert rewrite_command(["torchrun", "--run-path", "/abs/t.py", "a"], same_python=False) == [
        "torchrun", "--run-path", launcher_file(), "/abs/t.py", "a"]
    assert rewrite_command(["torchrun", "--no-python", "python", "-u", "t.py"], same_python=False) == [
        "torchrun", "--no-python", "python", "-u", "-m", launcher, "t.py"]
    with pytest.raises(UserError, match="cannot read the torchrun command"):
        rewrite_command(["torchrun", "--nproc_per_node"])
    with pytest.raises(UserError):
        rewrite_command([])


def test_demo_train_captures_steps(tmp_path):
    out, js = tmp_path / "demo.zarr", tmp_path / "d.json"
    result = _run(["demo-train", "--steps", "3", "--batch-size", "2", "--capture", str(out), "--capture-steps", "1,2",
                   "--capture-layers", "0", "--capture-batch", "0:1", "--json", str(js)])
    assert result.returncode == 0, result.stderr
    payload = json.loads(js.read_text())
    assert payload["captured_steps"] == [1, 2] and len(payload["losses"]) == 3
    dump = open_dump(out)
    assert dump.steps == [1, 2]
    assert dump.step_attrs(2)["loss"] == pytest.approx(payload["losses"][2])
    q, k, v, o = (dump.read(2, 0, n) for n in ("q", "k", "v", "o"))
    from fa_forensics.demo.model import flash_attention_bf16

    assert torch.equal(flash_attention_bf16(q, k, v, dump.layer_info(2, 0).scale, causal=True), o)
