"""Time each analysis on one layer-step of a GPT-2-size dump (B 1, H 12, T 1024, D 64), on the CPU emulator.

Builds a random dump with DumpWriter in a temporary folder (bf16 q, k, v, do, o; x of width 768)
and runs each analysis through the library (`analyses.<name>.run` and `payload`: what the command
and the report call; no CLI parsing, rendering or JSON writing is timed), one after the other.
Each is reported in CPU seconds (time.process_time: robust to other jobs on the machine) and wall
seconds, and as a ratio to ONE plain forward replay of the same layer-step under the bf16 preset,
timed in the same run: the ratio is the number that carries across machines. Arithmetic per
forward replay: QKᵀ and P̄V are B·H·T²·D = 12·1024²·64 ≈ 805M multiply-adds each (≈ 3.2 GFLOP).

    python benchmarks/analyses_cpu.py [--keep DIR] [--H 12] [--T 1024]
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

B, D, C = 1, 64, 768


def build_dump(path: Path, H: int = 12, T: int = 1024) -> Path:
    """A one-step, one-layer random dump (GPT-2 size by default; o from a plain fp32 attention, stored bf16)."""
    from fa_forensics.dump import DumpWriter

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    x = torch.randn(B, T, C, generator=g).bfloat16()
    o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    attrs = {"module": "transformer.h.0.attn", "n_heads": H, "head_dim": D, "scale": 1 / math.sqrt(D), "causal": True,
             "dtype": "bfloat16"}
    w = DumpWriter(path, {"model": {"name": "gpt2-size-random"}}, overwrite=True)
    for name, tensor in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("x", x)):
        w.write_array(0, 0, name, tensor, layer_attrs=attrs)
    w.complete_step(0, loss=0.0)
    w.close()
    return path


def _time(fn) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def main() -> None:
    from fa_forensics.analyses.bitdiff import compute as bitdiff
    from fa_forensics.analyses.delta_bias import compute as delta_bias
    from fa_forensics.analyses.fix_check import compute as fix_check
    from fa_forensics.analyses.isolate import compute as isolate
    from fa_forensics.analyses.pv_trace import compute as pv_trace
    from fa_forensics.analyses.rank1_sim import compute as rank1_sim
    from fa_forensics.enums import Backend
    from fa_forensics.fidelity.recipe import Recipe
    from fa_forensics.layers.selection import load, replay_layer, select
    from fa_forensics.dump import open_dump

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="build the dump here and keep it")
    ap.add_argument("--H", type=int, default=12, help="heads (12: GPT-2)")
    ap.add_argument("--T", type=int, default=1024, help="tokens (1024: GPT-2)")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="fa_bench_"))
    dump = open_dump(build_dump(root / "gpt2.zarr", args.H, args.T))
    sels, recipe, backend = select(dump), Recipe(), Backend.EMULATE
    analyses = {
        "isolate": lambda: isolate.payload(isolate.run(dump, sels, recipe, backend)),
        "delta-bias": lambda: delta_bias.payload(delta_bias.run(dump, sels, recipe, backend)),
        "rank1-sim": lambda: rank1_sim.payload(rank1_sim.run(dump, sels, recipe, backend)),
        "pv-trace": lambda: pv_trace.payload(pv_trace.run(dump, sels, recipe, backend)),
        "bitdiff": lambda: bitdiff.payload(bitdiff.run(dump, sels, recipe, Recipe("fp32"), backend)),
        "fix-check": lambda: fix_check.payload(fix_check.run(dump, sels, recipe, backend)),
    }
    t = load(dump, sels[0])
    unit_cpu, unit_wall = _time(lambda: replay_layer(t, recipe.base_config(), backward=False, backend=backend))
    print(f"B={B} H={args.H} T={args.T} D={D}, {torch.get_num_threads()} threads; one bf16 forward replay: "
          f"{unit_cpu:.1f} CPU s, {unit_wall:.1f} wall s")
    print("| analysis | CPU s | wall s | CPU ÷ one forward replay |")
    print("|---|---|---|---|")
    for name, fn in analyses.items():
        cpu, wall = _time(fn)
        print(f"| {name} | {cpu:.1f} | {wall:.1f} | {cpu / unit_cpu:.1f} |", flush=True)


if __name__ == "__main__":
    main()
