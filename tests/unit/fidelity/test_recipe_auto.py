"""`--preset auto`: per layer-step, the recipe that reproduces the stored O, cached beside the dump."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import zarr
from typer.testing import CliRunner

import fa_forensics.fidelity.match as match_mod
from fa_forensics.analyses.delta_bias import compute as delta_bias
from fa_forensics.fidelity.match import CACHE_ATTR, best_recipe
from fa_forensics.fidelity.recipe import Choice, Recipe, lp_config_for
from fa_forensics.fidelity.auto import resolve
from fa_forensics.layers.selection import select
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.dump.lock import StoreLock
from fa_forensics.enums import Accumulation
from fa_forensics.replay.config import ReplayConfig

ROOT = Path(__file__).resolve().parents[3]
PLANTED, DEMO = ROOT / "sample_dumps" / "planted.zarr", ROOT / "sample_dumps" / "demo.zarr"
runner = CliRunner()


@pytest.fixture
def counted_matches(monkeypatch):
    calls = []
    real = match_mod.match_layer
    monkeypatch.setattr(match_mod, "match_layer", lambda *a, **k: calls.append(a[0].where) or real(*a, **k))
    return calls


@pytest.mark.parametrize("path, preset", [(PLANTED, "bf16"), (DEMO, "bf16-autocast-train")])
def test_the_sample_dumps_carry_their_match_and_auto_reads_it(path, preset, counted_matches):
    """Both bundled dumps carry their match in their layers' attributes and it still fits: read, never rewritten."""
    dump = open_dump(path)
    sels = select(dump)
    recipe = resolve(dump, sels, Recipe())
    assert counted_matches == []  # every fingerprint fits: nothing replayed
    assert {c for _, c in recipe.choices} == {Choice(preset, Accumulation.IEEE, 1.0)}
    assert len(recipe.choices) == len(sels) and recipe.label == f"auto ({preset})"
    assert lp_config_for(dump, sels[0].step, sels[0].layer, recipe) == ReplayConfig.preset(preset)


def test_auto_matches_once_then_reads_the_cache_and_a_changed_dump_rematches(make_dump, counted_matches, tmp_path):
    path = make_dump(steps=(0,), seq=32, head_dim=16)  # o = the bf16 preset's replay
    out = tmp_path / "a.json"
    for _ in range(2):
        res = runner.invoke(app, ["delta-bias", str(path), "--json", str(out)])
        assert res.exit_code == 0, res.output
    assert len(counted_matches) == 1  # the second run read the match cache
    d = json.loads(out.read_text())
    assert (d["preset"], d["accumulation"]) == ("auto", "auto")
    assert d["replay_fidelity"]["preset"] == "bf16" and d["replay_fidelity"]["o_bits_equal"] == 1.0
    assert "preset auto (bf16)" in d["verdict"] and not d["warnings"]

    o = zarr.open_group(str(path), mode="r+")["step_000000000/layer_000/o"]
    bits = o[...]
    bits[0, 1, 7, 2] ^= 1  # one element of the stored O one ulp off: the dump changed
    o[...] = bits
    best = best_recipe(open_dump(path), 0, 0)
    assert len(counted_matches) == 2  # the changed layer-step was matched again
    assert (best.best.preset, best.best.n_elements, best.best.o_bits_equal) == ("bf16", 1024, 1023 / 1024)
    assert best.best.max_abs_err == 2.0 ** -8  # the flipped low bit: one ulp of a bf16 element in [0.5, 1)
    assert runner.invoke(app, ["verify", str(path)]).exit_code == 0


def test_the_match_command_and_auto_share_one_cached_result(make_dump, counted_matches, tmp_path):
    path = make_dump(steps=(0, 1), seq=32, head_dim=16)
    res = runner.invoke(app, ["match", str(path), "--json", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    assert len(counted_matches) == 2  # steps 0 and 1, matched and written
    assert runner.invoke(app, ["delta-bias", str(path)]).exit_code == 0
    assert runner.invoke(app, ["match", str(path), "--step", "1"]).exit_code == 0
    assert len(counted_matches) == 2  # both read what the first match wrote
    assert runner.invoke(app, ["match", str(path), "--head", "0"]).exit_code == 0
    assert len(counted_matches) == 4  # one head is not a whole layer-step: both steps matched again, not cached


def test_a_given_accumulation_restricts_the_match(make_dump):
    path = make_dump(steps=(0,), seq=32, head_dim=16)
    dump = open_dump(path)
    recipe = resolve(dump, select(dump), Recipe(accumulation=Accumulation.TENSOR_CORE))
    (_, choice), = recipe.choices
    assert choice.accumulation is Accumulation.TENSOR_CORE
    assert not any(k.startswith(CACHE_ATTR) for k in open_dump(path)._layer(0, 0).attrs)  # nothing written in the dump
    full = resolve(open_dump(path), select(dump), Recipe())
    assert full.choices[0][1].accumulation is Accumulation.IEEE  # kept apart from the restricted match


def test_without_a_stored_o_auto_replays_the_fallback_and_says_so(make_dump, tmp_path):
    path = make_dump(steps=(0,), seq=16, names=("q", "k", "v", "do", "x"))
    res = runner.invoke(app, ["delta-bias", str(path), "--json", str(tmp_path / "d.json")])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "d.json").read_text())
    fid = d["replay_fidelity"]
    assert fid["o_bits_equal"] is None and fid["unmatched"] == [{"step": 0, "layer": 0, "preset": "bf16"}]
    fallback = "preset auto: no stored O to match at step 0 layer 0; replayed preset bf16"
    assert any(w.startswith(fallback) for w in d["warnings"])


def test_a_store_held_by_a_writer_is_analysed_and_not_written(make_dump, counted_matches):
    path = make_dump(steps=(0,), seq=32, head_dim=16)
    with StoreLock(path).acquire():
        r = delta_bias.run(open_dump(path), select(open_dump(path)), Recipe())
    assert r.replay_fidelity.preset == "bf16" and len(counted_matches) == 1
    assert CACHE_ATTR not in open_dump(path)._layer(0, 0).attrs


def test_a_read_only_copy_of_a_sample_dump_is_analysed_without_writing(tmp_path):
    copy = tmp_path / "planted.zarr"
    shutil.copytree(PLANTED, copy)
    for p in copy.rglob("*"):
        p.chmod(0o555 if p.is_dir() else 0o444)
    copy.chmod(0o555)
    try:
        res = runner.invoke(app, ["delta-bias", str(copy), "--step", "0"])
        assert res.exit_code == 0, res.output
    finally:
        for p in [copy, *copy.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)


def test_a_named_gpu_kernel_preset_keeps_its_tensor_core_products():
    """--preset sdpa-flash without --accumulation replays what the hardware ran (tensor-core products); other
    presets replay ieee, and --accumulation still decides where given."""
    from fa_forensics.fidelity.recipe import Recipe
    from fa_forensics.enums import Accumulation

    assert Recipe("sdpa-flash").accumulation is Accumulation.TENSOR_CORE
    assert Recipe("sdpa-cudnn-sm90@block_m=128,block_n=128").accumulation is Accumulation.TENSOR_CORE
    assert Recipe("bf16-hw").accumulation is Accumulation.IEEE
    assert Recipe("sdpa-flash", "ieee").accumulation is Accumulation.IEEE


def test_a_masked_layer_under_a_gpu_kernel_preset_replays_the_reference_backward(tmp_path):
    """The GPU kernels' backward models do not model masks: on a layer captured with an attn_mask the analyses
    replay the emulator's reference backward instead of stopping, and the mask check says so."""
    import torch
    from typer.testing import CliRunner

    from fa_forensics.fidelity.recipe import Recipe, lp_config_for
    from fa_forensics.cli import app
    from fa_forensics.dump import DumpWriter, open_dump
    from fa_forensics.enums import BackwardKernel

    g = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 32, 16
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    mask = torch.rand(B, 1, T, T, generator=g) > 0.2
    o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).bfloat16()
    path = tmp_path / "masked.zarr"
    with DumpWriter(path, {"amp_dtype": "bfloat16", "device": "cuda:0"}) as w:
        attrs = {"n_heads": H, "head_dim": D, "scale": D ** -0.5, "causal": False, "dtype": "bfloat16", "mask": "bool"}
        for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("mask", mask)):
            w.write_array(0, 0, name, t, attrs)
        w.complete_step(0)
    dump = open_dump(path)
    assert ReplayConfig.preset("sdpa-cudnn-sm90").backward_kernel is not BackwardKernel.REFERENCE
    config = lp_config_for(dump, 0, 0, Recipe("sdpa-cudnn-sm90"))
    assert config.backward_kernel is BackwardKernel.REFERENCE
    res = CliRunner().invoke(app, ["delta-bias", str(path), "--preset", "sdpa-cudnn-sm90"])
    assert res.exit_code == 0, res.output
    assert ("warning: captured with an attention mask (bool); every replay and every score, P̄ and P the analyses form "
            "apply it (the GPU kernels' backward models do not model masks: under their presets the backward there "
            "is the emulator's reference backward)") in res.output.splitlines()
