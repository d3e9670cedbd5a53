"""Time the CPU emulator on one GPT-2-size attention layer: forward + backward, BF16 and FP32 presets.

Shape B 1, H 12, T 1024, D 64, causal, untiled: the default BF16 config under both accumulation
models, and the fp32 preset (the high-precision reference every analysis runs). Arithmetic per pass (untiled
emulator, causal rows still computed in full):
  forward  S = QKᵀ and P̄V:            2 products x B·H·T·T·D   = 2 x 805M multiply-adds
  backward S, dP = dO Vᵀ, dQ, dK, dV:  5 products x B·H·T·T·D   = 5 x 805M multiply-adds
Each multiply-add is emulated with explicit fp32 rounding (ieee) or the grouped truncating
alignment of the tensor-core model, so the time is dominated by numerics.matmul's K loop. With
fp32 operands (dS in the backward; P̄ in the fp32 preset) the products are not exact in fp32 and
matmul runs its fp64 kernel (about 5 passes per k instead of 1). Prints wall and CPU seconds
and the load average (the machine may be shared).

    python benchmarks/replay_cpu.py [--T 1024] [--runs bf16:ieee bf16:tensor-core fp32:ieee]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from fa_forensics.replay import ReplayConfig, replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--runs", nargs="+", default=["bf16:ieee", "bf16:tensor-core", "fp32:ieee"],
                    help="PRESET:ACCUMULATION")
    args = ap.parse_args()
    B, H, T, D = args.B, args.H, args.T, args.D
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(4))
    mads = B * H * T * T * D
    print(f"shape B={B} H={H} T={T} D={D}; one product = {mads / 1e6:.0f}M multiply-adds; "
          f"threads={torch.get_num_threads()}")
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'preset:accumulation':<20} {'fwd wall s':>10} {'fwd cpu s':>9} {'f+b wall s':>10} {'f+b cpu s':>9} "
          f"{'Mmad/s':>7}")
    for run in args.runs:
        preset, acc = run.split(":")
        cfg = ReplayConfig.preset(preset).with_(accumulation=acc)
        w0, c0 = time.perf_counter(), time.process_time()
        replay(q, k, v, cfg)
        w1, c1 = time.perf_counter(), time.process_time()
        replay(q, k, v, cfg, do=do)
        w2, c2 = time.perf_counter(), time.process_time()
        print(f"{run:<20} {w1 - w0:>10.1f} {c1 - c0:>9.1f} {w2 - w1:>10.1f} {c2 - c1:>9.1f} "
              f"{7 * mads / (w2 - w1) / 1e6:>7.0f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")

if __name__ == "__main__":
    main()
