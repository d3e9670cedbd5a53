"""Time numerics.matmul (ieee, tensor-core) against torch's plain fp32 matmul, side by side in one run.

GPT-2 size, bf16 inputs, B 1, H 12, T 1024, D 64. Arithmetic per product: B·H·T·T·D = 805M
multiply-adds (1.61 GFLOP) for both QKᵀ ((1,12,1024,64) @ (1,12,64,1024)) and P̄V
((1,12,1024,1024) @ (1,12,1024,64)). A full replay (forward + backward) is about 7 such products.
Reported: CPU seconds (time.process_time, robust to other jobs on the machine), wall seconds,
and the ratio to torch.matmul measured in the same run. P̄ comes from logits of std ≈ 5, so
it holds values below 2^-40 (the case real dumps have).

    python benchmarks/numerics_matmul.py [--threads 1 2] [--H 12]
"""
from __future__ import annotations

import argparse
import time

import torch

from fa_forensics.numerics import matmul


def _time(fn) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    args = ap.parse_args()
    H, T, D = args.H, args.T, args.D
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, H, T, D, generator=g).to(torch.bfloat16).float() for _ in range(2))
    p_bar = torch.softmax(q @ k.transpose(-1, -2) * 0.6, dim=-1).to(torch.bfloat16).float()  # (1, H, T, T)
    mads = H * T * T * D
    print(f"one product = {mads / 1e6:.0f}M multiply-adds = {2 * mads / 1e9:.2f} GFLOP; P̄ < 2^-40: "
          f"{float((p_bar[p_bar > 0] < 2.0**-40).float().mean()):.1%} of nonzeros")
    matmul(q[:, :1, :32], k[:, :1].transpose(-1, -2), "tensor-core")  # warm-up: lazy imports
    products = {"QKᵀ": (q, k.transpose(-1, -2)), "P̄V": (p_bar, k)}
    print(f"{'threads':>7} {'product':>7} {'model':>12} {'cpu s':>7} {'wall s':>7} {'x torch':>8} {'Mmad/cpu-s':>10}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (a, b) in products.items():
            base, base_wall = _time(lambda: torch.matmul(a, b))
            for model in ("torch fp32", "ieee", "tensor-core"):
                if model == "torch fp32":
                    cpu, wall = base, base_wall
                else:
                    cpu, wall = _time(lambda: matmul(a, b, model, gpu="h100", in_format="bf16"))
                print(f"{threads:>7} {name:>7} {model:>12} {cpu:>7.2f} {wall:>7.2f} {cpu / max(base, 1e-9):>8.0f} "
                      f"{mads / max(cpu, 1e-9) / 1e6:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
