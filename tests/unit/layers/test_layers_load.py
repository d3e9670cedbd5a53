"""The shared selection/load/replay layer on a small real dump store written with DumpWriter."""

import pytest
import torch

from fa_forensics.fidelity.pair import lp_hp_pair
from fa_forensics.fidelity.planner import plan_for_layers
from fa_forensics.layers.selection import LayerSelection, load, replay_layer, select
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.errors import DumpError, UserError
from fa_forensics.replay.config import ReplayConfig

import fa_forensics.dump as dump_mod  # noqa: E402


@pytest.fixture
def small_dump(tmp_path):
    g = torch.Generator().manual_seed(0)
    B, H, T, D, C = 1, 3, 16, 8, 12
    w = dump_mod.DumpWriter(tmp_path / "d.zarr", {"model": {"name": "test"}, "capture": {}})
    attrs = {"module": "attn", "n_heads": H, "head_dim": D, "scale": 0.3, "causal": False, "dtype": "bfloat16"}
    for step in (5, 9):
        for name in ("q", "k", "v", "o", "do"):
            w.write_array(step, 0, name, torch.randn(B, H, T, D, generator=g).bfloat16(), layer_attrs=attrs)
        w.write_array(step, 0, "x", torch.randn(B, T, C, generator=g).bfloat16(), layer_attrs=attrs)
        w.complete_step(step, loss=1.0)
    w.close()
    return dump_mod.open_dump(tmp_path / "d.zarr")


def test_select_defaults_cover_everything_and_validate(small_dump):
    sels = select(small_dump)
    assert [(s.step, s.layer, s.heads) for s in sels] == [(5, 0, [0, 1, 2]), (9, 0, [0, 1, 2])]
    assert select(small_dump, step=9, head=2) == [LayerSelection(9, 0, [2])]
    with pytest.raises(DumpError):
        select(small_dump, step=7)
    with pytest.raises(DumpError):
        select(small_dump, head=3)


def test_load_batches_selected_heads_and_keeps_dtype_scale_causal(small_dump):
    t = load(small_dump, LayerSelection(5, 0, [0, 2]))
    assert t.q.shape == (1, 2, 16, 8) and t.q.dtype == torch.bfloat16
    assert t.x.shape == (1, 16, 12) and t.scale == pytest.approx(0.3) and t.causal is False
    full = small_dump.read(5, 0, "q")
    assert torch.equal(t.q[:, 1], full[:, 2])


def test_replay_layer_uses_the_dump_scale_and_pair_differs_only_by_precision(small_dump):
    t = load(small_dump, LayerSelection(5, 0, [1]))
    hp = replay_layer(t, ReplayConfig.preset("fp32"), backward=False)
    q, k, v = (a.double() for a in (t.q, t.k, t.v))
    ref = torch.softmax(0.3 * q @ k.transpose(-1, -2), -1) @ v  # non-causal, α = 0.3 from the dump
    torch.testing.assert_close(hp.o.double(), ref, atol=1e-5, rtol=1e-5)
    lp, hp2 = lp_hp_pair(t, plan_for_layers([t], Recipe("bf16")), backward=False)
    assert lp.o.dtype == torch.bfloat16 and torch.equal(hp2.o, hp.o)
    err = (lp.o.double() - ref).abs().max()
    assert 0 < err < 0.05


def test_bad_accumulation_is_a_user_error(small_dump):
    t = load(small_dump, LayerSelection(5, 0, [0]))
    with pytest.raises(UserError):
        lp_hp_pair(t, Recipe("bf16", "nope"), backward=False)


def test_a_selection_of_heads_keeps_the_launch_of_the_layer_as_stored(small_dump):
    """The kernel's launch (batch, heads) a replay reads is the stored layer's, not the selected heads'."""
    assert load(small_dump, LayerSelection(9, 0, [1])).launch == (1, 3)
    assert load(small_dump, LayerSelection(9, 0, [0, 1, 2])).launch == (1, 3)


@pytest.mark.slow  # the backward of 16 x 16 heads of 128 keys, replayed twice: about 6 s of CPU
def test_a_layer_replays_its_kernel_launch_whatever_heads_are_selected(tmp_path):
    """The memory-efficient backward's key splits follow PyTorch's heuristic on the layer as stored (16 x 16 heads
    of two key tiles: one CTA per head), not on the heads an analysis selected (two heads would get two CTAs):
    a selected head's gradients are the whole layer's."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 16, 16, 128, 32
    w = dump_mod.DumpWriter(tmp_path / "d.zarr", {"model": {"name": "test"}, "capture": {}})
    attrs = {"module": "attn", "n_heads": H, "head_dim": D, "scale": D ** -0.5, "causal": False, "dtype": "bfloat16"}
    for name in ("q", "k", "v", "o", "do"):
        w.write_array(1, 0, name, torch.randn(B, H, T, D, generator=g).bfloat16(), layer_attrs=attrs)
    w.complete_step(1, loss=1.0)
    w.close()
    dump = dump_mod.open_dump(tmp_path / "d.zarr")
    config = ReplayConfig.preset("sdpa-efficient")
    some = load(dump, LayerSelection(1, 0, [3, 4]))
    assert some.launch == (16, 16)
    whole = replay_layer(load(dump, LayerSelection(1, 0, list(range(H)))), config, backward=True)
    part = replay_layer(some, config, backward=True)
    for name in ("dq", "dk", "dv"):
        assert torch.equal(getattr(part, name), getattr(whole, name)[:, 3:5]), name
