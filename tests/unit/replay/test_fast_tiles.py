"""The training-speed kernels' launch table and options (fast_tiles.py): valid tiles for every supported shape,
one-line errors for bad options, and the environment variable `stable_attention` reads them from."""
import pytest
import torch

from fa_forensics.errors import ConfigError
from fa_forensics.replay.stable_reference import STABLE_BLOCK_N
from fa_forensics.replay.triton import fast_tiles
from fa_forensics.replay.triton.fast_tiles import BwdTiles, KernelOptions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [16, 32, 64, 128])
def test_every_supported_shape_has_tiles_the_kernels_accept(D, dtype):
    for causal in (True, False):
        fwd, bwd = fast_tiles.fwd_tiles(D, causal, dtype), fast_tiles.bwd_tiles(D, causal, dtype)
        assert fwd.block_m % STABLE_BLOCK_N == 0  # the causal split and the tail mask assume it
        assert bwd.block_m2 == bwd.block_n1 and bwd.block_n1 % bwd.block_m1 == 0 and bwd.block_m2 % bwd.block_n2 == 0
    # the stabilized and the plain kernel share the call: the table has no say in the fix's cost
    assert fast_tiles.fwd_tiles(D, True, dtype) == fast_tiles.fwd_tiles(D, False, dtype)


def test_backward_tiles_that_break_the_kernel_s_layout_are_refused():
    with pytest.raises(ConfigError, match="BLOCK_M2 must equal BLOCK_N1"):
        BwdTiles(32, 128, 64, 32, 4, 3)


def test_options_parse_from_names_and_refuse_unknown_ones(monkeypatch):
    assert KernelOptions.parse("") == KernelOptions()
    opts = KernelOptions.parse("autotune, tma,top2,warp_specialize")
    assert (opts.tuning, opts.tie_test, opts.tma, opts.warp_specialize) == ("autotune", "top2", True, True)
    assert opts.label() == "autotune,top2,tma,warp_specialize" and KernelOptions().label() == "default"
    with pytest.raises(ConfigError, match=r"unknown option\(s\) fast"):
        KernelOptions.parse("tma,fast")
    with pytest.raises(ConfigError, match="tie_test"):
        KernelOptions(tie_test="pairs")
    monkeypatch.setenv(fast_tiles.ENV, "top2")
    assert KernelOptions.from_env() == KernelOptions(tie_test="top2")
