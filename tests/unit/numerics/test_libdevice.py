"""CUDA's accurate expf and logf (numerics/libdevice.py) against the H200's census of both functions.

On the GPU, benchmarks/gpu_special_functions.cu (part `laws`) evaluated expf and logf on every fp32 input of
each binade and kept, per binade, how many results differ from the correctly rounded value and a checksum
Σ bits(f(x))·bits(x) mod 2⁶⁴ (tests/data/sfu_h200/README.md). The emulation must give both numbers exactly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fa_forensics.numerics import libdevice

# (function, binade = bits >> 23 with the sign bit) -> (mismatches vs correctly rounded, checksum); NVIDIA H200,
# CUDA 13.0, 2026-11-26
CENSUS = {
    ("expf", 382): (2717368, 3144976242939012080),  # x in [-1, -0.5)
    ("expf", 128): (2461691, 4838369689195625468),  # x in [2, 4)
    ("logf", 127): (675615, 15214586567098164211),  # x in [1, 2)
    ("logf", 137): (352564, 18397581837923899764),  # x in [1024, 2048)
}


# One binade of each function in the fast loop; every binade in the full suite (about 3 s of CPU each: 2²³ inputs).
FAST = {("expf", 382), ("logf", 137)}


@pytest.mark.parametrize("name,binade", [pytest.param(*key, marks=() if key in FAST else pytest.mark.slow)
                                         for key in sorted(CENSUS)])
def test_census_of_a_whole_binade(name, binade):
    x_bits = (np.uint64(binade) << np.uint64(23)) + np.arange(1 << 23, dtype=np.uint64)
    x = torch.from_numpy(x_bits.astype(np.uint32).view(np.float32).copy())
    fn, exact = (libdevice.expf, torch.exp) if name == "expf" else (libdevice.logf, torch.log)
    y = fn(x).numpy().view(np.uint32)
    correctly_rounded = exact(x.double()).float().numpy().view(np.uint32)
    mismatches = int((y != correctly_rounded).sum())
    checksum = int((y.astype(np.uint64) * x_bits).sum(dtype=np.uint64))
    assert (mismatches, checksum) == CENSUS[name, binade]


def test_special_values():
    x = torch.tensor([0.0, -1.0, float("inf"), float("nan"), 1e-40])
    got = libdevice.logf(x)
    assert got[0] == float("-inf") and torch.isnan(got[1]) and got[2] == float("inf") and torch.isnan(got[3])
    assert abs(got[4].item() - np.log(1e-40)) < 1e-4  # a subnormal input is scaled, not flushed
    e = libdevice.expf(torch.tensor([float("-inf"), 0.0, 100.0, -100.0, -110.0]))
    assert e.tolist()[:2] == [0.0, 1.0] and torch.isinf(e[2]) and 0 < e[3].item() < 1e-43 and e[4] == 0.0
