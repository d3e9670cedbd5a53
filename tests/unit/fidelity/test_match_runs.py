"""`match` on real captures: a paper-style attention Function under CPU bf16 autocast with its stabilized softmax,
the same in fp32, flex_attention with a score_mod; and on stored O it cannot reproduce: arrays stored in the
wrong layout, an fp32 kernel that sums in another order."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

import fa_forensics
from fa_forensics.capture.events import CaptureWarning
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.dump.writer import DumpWriter
from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.api import replay

CUSTOM = Path(__file__).resolve().parents[2] / "data" / "custom_attention"
runner = CliRunner()


class _Attn(nn.Module):
    def __init__(self, call, C=16, H=2):
        super().__init__()
        self.call, self.H, self.qkv, self.proj = call, H, nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in self.qkv(x).split(C, 2))  # (B, H, T, D)
        return self.proj(self.call(q, k, v).transpose(1, 2).reshape(B, T, C))


class _Net(nn.Module):
    def __init__(self, call, L=2):
        super().__init__()
        self.h = nn.ModuleList([nn.ModuleDict({"attn": _Attn(call)}) for _ in range(L)])

    def forward(self, x):
        for block in self.h:
            x = x + block["attn"](x)
        return x


def _train(out: Path, call, *, autocast: bool, **options) -> Path:
    """Two SGD steps of a 2-layer model whose attention is `call`, under capture (step 1 recorded)."""
    torch.manual_seed(0)
    net = _Net(call)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with fa_forensics.capture(net, out=out, steps=[1], batch=None, **options):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = net(torch.randn(2, 20, 16) * 4)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    return out


def _match(path: Path, tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "m.json"
    res = runner.invoke(app, ["match", str(path), *args, "--json", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), res.output


@pytest.fixture
def blocked_attention(monkeypatch):
    monkeypatch.syspath_prepend(str(CUSTOM))
    monkeypatch.setenv("TINY_STABLE", "1")
    from blocked_attention import BlockedAttention

    yield lambda q, k, v: BlockedAttention.apply(q, k, v, None, True, 512)  # the paper's tiles of 512 keys
    sys.modules.pop("blocked_attention", None)


def test_cpu_autocast_with_the_stabilized_softmax_is_named_by_its_recipe(blocked_attention, tmp_path):
    target = {"attention": ["blocked_attention:BlockedAttention"]}
    run = _train(tmp_path / "stable.zarr", blocked_attention, autocast=True, softmax="TINY_STABLE=1", **target)
    d, _ = _match(run, tmp_path)
    for layer in d["layers"]:
        assert layer["best"]["preset"] == "bf16-autocast-cpu-stabilized" and layer["best"]["o_bits_equal"] == 1.0
        assert layer["run_precision"] == "bf16"
        tried = {c["preset"] for c in layer["candidates"]}
        assert all("stabilized" in p for p in tried) and not any(p.startswith("fp8") for p in tried)
    assert d["verdict"].startswith("stored O reproduced 100 % in every selected layer-step (2)") and not d["notes"]

    unsaid = _train(tmp_path / "unsaid.zarr", blocked_attention, autocast=True, **target)  # --softmax not given
    d, output = _match(unsaid, tmp_path)
    for layer in d["layers"]:  # where no row ties within ε of its maximum, the two softmax variants are one
        assert layer["best"]["preset"] in ("bf16-autocast-cpu", "bf16-autocast-cpu-stabilized")
        assert layer["best"]["o_bits_equal"] == 1.0
    assert d["notes"][0].startswith("the softmax variant is not recorded (2 layer-step(s)): both were tried; record "
                                    "it with --softmax at capture")
    assert "note: the softmax variant is not recorded" in output


def test_an_fp32_run_with_the_stabilized_softmax_tries_its_fp32_recipe_only(blocked_attention, tmp_path):
    run = _train(tmp_path / "fp32.zarr", blocked_attention, autocast=False, softmax="TINY_STABLE=1",
                 attention=["blocked_attention:BlockedAttention"])
    d, _ = _match(run, tmp_path)
    for layer in d["layers"]:
        assert [(c["preset"], c["accumulation"]) for c in layer["candidates"]] == [("fp32-stabilized", "ieee")]
        assert layer["run_precision"] == "fp32" and layer["best"]["max_ulp"] is not None
    assert d["verdict"].startswith("trained in fp32: no low-precision rounding to analyse")


@pytest.mark.slow  # flex_attention compiles its kernel at the first call (about 2 s)
def test_a_score_mod_makes_fidelity_unverifiable_not_a_matter_of_last_bits(tmp_path):
    def rel(score, b, h, q_idx, kv_idx):
        return score + 0.3 * (q_idx - kv_idx)

    def call(q, k, v):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q.detach(), k.detach(), v.detach(), score_mod=rel) + 0 * q  # no backward on a CPU

    with pytest.warns(CaptureWarning, match="score_mod 'rel'"):
        run = _train(tmp_path / "mod.zarr", call, autocast=False)
    d, _ = _match(run, tmp_path)
    for layer in d["layers"]:
        assert layer["unverifiable"].startswith("the call used score_mod 'rel': stored O includes it")
    assert d["verdict"].startswith("trained in fp32: no low-precision rounding to analyse (the analyses show what "
                                   "bf16 would do on these inputs); fidelity unverifiable at step 1 layer 0, step 1 "
                                   "layer 1: the call used score_mod 'rel'")
    assert "last bits" not in d["verdict"]


def _write(path: Path, tensors: dict, **run_attrs) -> Path:
    with DumpWriter(path, run_attrs) as w:
        for name, x in tensors.items():
            w.write_array(0, 0, name, x, layer_attrs={"causal": True, "scale": 0.25})
        w.complete_step(0)
    return path


def test_arrays_stored_in_the_wrong_layout_are_unverifiable_and_say_which_layout_fits(tmp_path):
    """O of (B, T, H, D) tensors stored as if they were (B, H, T, D): no recipe reproduces it, read the other way
    round the bf16 reading does."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 96, 16, generator=g).to(torch.bfloat16) for _ in range(3))  # (B, H, T, D)
    o = replay(q, k, v, ReplayConfig.preset("bf16"), causal=True, scale=0.25).o
    bthd = {n: x.transpose(1, 2).contiguous() for n, x in zip("qkvo", (q, k, v, o))}  # stored as (B, T, H, D)
    d, _ = _match(_write(tmp_path / "layout.zarr", bthd), tmp_path)
    (layer,) = d["layers"]
    assert layer["best"]["o_bits_equal"] < 0.5
    assert layer["unverifiable"].startswith("the stored arrays do not fit their layout")
    assert "read as (B, T, H, D) 100.00 % of a sample of rows by bf16 / ieee" in layer["unverifiable"]
    assert d["verdict"].startswith("fidelity unverifiable at step 0 layer 0: the stored arrays do not fit")
    assert "last bits" not in d["verdict"]


def test_the_last_bits_wording_comes_with_the_ulp_count_only_where_differences_are_a_few_ulps(tmp_path):
    """An fp32 kernel (torch's SDPA on the CPU) sums in another order than the emulator: every element within a few
    ulps, and the verdict says how many."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    d, _ = _match(_write(tmp_path / "fp32.zarr", {"q": q, "k": k, "v": v, "o": o}), tmp_path)
    (layer,) = d["layers"]
    ulps = layer["best"]["max_ulp"]
    assert 0 < layer["best"]["o_bits_equal"] < 1.0 and 0 < ulps <= 4
    assert f"the other elements differ in the last bits (at most {ulps} ulp" in d["verdict"]
    assert open_dump(tmp_path / "fp32.zarr").layer_info(0, 0).dtype == "float32"
