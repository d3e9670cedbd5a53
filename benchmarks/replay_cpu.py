"""Time the CPU emulator on one GPT-2-size attention layer: forward + backward, default BF16 config.

Shape B 1, H 12, T 1024, D 64, causal, untiled (the paper's default config), under both
accumulation models. Arithmetic per pass (untiled emulator, causal rows still computed in full):
  forward  S = QKᵀ and P̄V:            2 products x B·H·T·T·D   = 2 x 805M multiply-adds
  backward S, dP = dO Vᵀ, dQ, dK, dV:  5 products x B·H·T·T·D   = 5 x 805M multiply-adds
Each multiply-add is emulated with explicit fp32 rounding (ieee) or the grouped truncating
alignment of the tensor-core model, so the time is dominated by numerics.matmul's K loop.

    python benchmarks/replay_cpu.py [--T 1024] [--accumulation ieee tensor-core]
"""
from __future__ import annotations

import argparse
import time

import torch

from fa_forensics.replay import ReplayConfig, replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--accumulation", nargs="+", default=["ieee", "tensor-core"])
    args = ap.parse_args()
    B, H, T, D = args.B, args.H, args.T, args.D
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(4))
    mads = B * H * T * T * D
    print(f"shape B={B} H={H} T={T} D={D}; one product = {mads / 1e6:.0f}M multiply-adds; threads={torch.get_num_threads()}")
    print(f"{'accumulation':<12} {'forward s':>10} {'fwd+bwd s':>10} {'Mmad/s':>8}")
    for acc in args.accumulation:
        cfg = ReplayConfig.preset("bf16").with_(accumulation=acc)
        t0 = time.perf_counter()
        replay(q, k, v, cfg)
        t_fwd = time.perf_counter() - t0
        t0 = time.perf_counter()
        replay(q, k, v, cfg, do=do)
        t_all = time.perf_counter() - t0
        print(f"{acc:<12} {t_fwd:>10.1f} {t_all:>10.1f} {7 * mads / t_all / 1e6:>8.0f}")


if __name__ == "__main__":
    main()
