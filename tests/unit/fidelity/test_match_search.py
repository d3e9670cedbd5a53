"""The screened search of `match`: a row sample replays exactly those rows of the whole replay, and a search that
screens on it names the recipe, with the share, that a search replaying every candidate on every element names."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fa_forensics.dump import open_dump
from fa_forensics.fidelity.candidates import catalogue, layer_candidates, pick_best
from fa_forensics.fidelity.layer_match import Candidate
from fa_forensics.fidelity.run_facts import UNKNOWN, facts_at
from fa_forensics.fidelity.sample import compare_o, replay_rows, row_sample
from fa_forensics.fidelity.search import match_layer
from fa_forensics.layers.selection import LayerSelection, LayerTensors, load, replay_layer

REPO = Path(__file__).resolve().parents[3]


def test_the_row_sample_is_spread_over_the_rows_and_ends_with_the_last_block():
    assert row_sample(40).whole and row_sample(64).whole  # half the rows or more: every row
    assert row_sample(96).blocks == ((64, 96),)
    s = row_sample(1024)
    assert s.blocks == ((480, 512), (992, 1024)) and s.rows == 64 and not s.whole
    assert row_sample(1000).blocks[-1] == (992, 1000)  # a partial last block
    assert torch.equal(s.index(), torch.cat([torch.arange(480, 512), torch.arange(992, 1024)]))


def _layer(causal: bool, mask: bool) -> LayerTensors:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1, 160, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    m = None
    if mask:
        m = torch.rand(1, 1, 160, 160, generator=g) > 0.2
        m[..., 130:140, :] = False  # rows that see no key
    return LayerTensors(0, 0, [0], q, k, v, None, None, None, 0.25, causal, mask=m)


@pytest.mark.parametrize("causal, mask", [(True, False), (False, True)])
def test_the_sampled_rows_replay_bit_for_bit_as_in_the_whole_replay_under_every_recipe(causal, mask):
    """Every recipe of the catalogue (the GPU kernels' models with their tiles and split-KV forwards included)."""
    t = _layer(causal, mask)
    sample = row_sample(160)
    assert sample.blocks == ((128, 160),)
    for recipe in catalogue(t, UNKNOWN):
        cfg = recipe.config()
        whole = replay_layer(t, cfg, backward=False).o
        rows = replay_rows(t, cfg, sample)
        assert rows.dtype == whole.dtype
        assert torch.equal(rows.view(torch.int16), whole[..., 128:160, :].contiguous().view(torch.int16)), recipe


def _exhaustive(t: LayerTensors, recipes, facts) -> Candidate:
    """The search without a sample: every candidate on every element, in order, up to the first 100 %."""
    tried = []
    for r in recipes:
        share, err, n = compare_o(replay_layer(t, r.config(), backward=False).o, t.o)
        tried.append(Candidate(r.preset, r.accumulation, share, err, n))
        if share == 1.0:
            break
    return pick_best(tried, facts)


def _gpu_dump(tmp_path: Path, device: str) -> Path:
    """The H200 bits of cuDNN, FlashAttention-2 and the memory-efficient kernel on planted.zarr's step 0 layer 0
    head 0 (tests/data/h200_bits), one layer each, with `device` recorded."""
    from fa_forensics.dump.writer import DumpWriter
    from fa_forensics.replay.gpu_fidelity import read_tensors

    tensors, _ = read_tensors(REPO / "tests" / "data" / "h200_bits" / "planted.s0l0.safetensors.xz")
    path = tmp_path / f"gpu-{device}.zarr"
    with DumpWriter(path, {"device": device}) as w:
        for layer, kernel in enumerate(("cudnn", "flash", "efficient")):
            attrs = {"causal": True, "scale": 0.125}
            for name in ("q", "k", "v"):
                w.write_array(0, layer, name, tensors[f"planted.s0l0.{name}"], layer_attrs=attrs)
            w.write_array(0, layer, "o", tensors[f"planted.s0l0.{kernel}.o"], layer_attrs=attrs)
        w.complete_step(0)
    return path


def _layers(tmp_path: Path):
    """Layer-steps a screened search must get right: a recipe at 100 % early, late and among the GPU kernels, and
    layers no admitted recipe reproduces whole (GPU bits recorded as a CPU run), where the ranking decides."""
    planted = open_dump(REPO / "sample_dumps" / "planted.zarr")
    demo = open_dump(REPO / "sample_dumps" / "demo.zarr")
    yield planted, 0, 0
    yield demo, 56, 1
    for device in ("unknown", "cpu"):
        dump = open_dump(_gpu_dump(tmp_path, device))
        for layer in (0, 1, 2):
            yield dump, 0, layer


@pytest.mark.slow  # about 6 s of CPU: every candidate of eight layer-steps replayed whole
def test_the_screened_search_names_the_recipe_and_share_of_the_exhaustive_one(tmp_path):
    seen = set()
    for dump, step, layer in _layers(tmp_path):
        t = load(dump, LayerSelection(step, layer, dump.heads(step, layer)))
        facts = facts_at(dump, step, layer)
        recipes = layer_candidates(t, facts).recipes
        screened = match_layer(t, recipes, facts=facts)
        exhaustive = _exhaustive(t, recipes, facts)
        got = (screened.best.preset, screened.best.accumulation, screened.best.o_bits_equal)
        assert got == (exhaustive.preset, exhaustive.accumulation, exhaustive.o_bits_equal), (dump.path, layer)
        assert not screened.best.sampled
        seen.add(screened.best.o_bits_equal == 1.0)
        if screened.best.o_bits_equal < 1.0:  # the layers no recipe reproduces whole were ranked, on a sample
            assert any(c.sampled for c in screened.candidates)
    assert seen == {True, False}
