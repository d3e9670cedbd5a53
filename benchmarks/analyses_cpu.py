"""Time each analysis command on one layer-step of a GPT-2-size dump (B 1, H 12, T 1024, D 64) on CPU.

Builds a random dump with DumpWriter in a temporary folder (bf16 q, k, v, do, o; x of width 768)
and runs each of the six analysis commands in-process with the emulator, one after the other,
printing wall-clock seconds (goal: < 60 s each on 2 cores). Arithmetic per forward replay:
QKᵀ and P̄V are 2·B·H·T²·D = 2·12·1024²·64 ≈ 1.6 GFLOP each (≈ 3.2 GFLOP per replay).

    python benchmarks/analyses_cpu.py [--keep DIR]
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

B, H, T, D, C = 1, 12, 1024, 64, 768
COMMANDS = [
    ["isolate"], ["delta-bias"], ["rank1-sim"], ["pv-trace"], ["bitdiff", "--a", "bf16", "--b", "fp32"], ["fix-check"],
]


def build_dump(path: Path) -> Path:
    """A one-step, one-layer random dump of GPT-2 size (o from a plain fp32 attention, stored bf16)."""
    from fa_forensics.dump import DumpWriter

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    x = torch.randn(B, T, C, generator=g).bfloat16()
    o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    attrs = {"module": "transformer.h.0.attn", "n_heads": H, "head_dim": D, "scale": 1 / math.sqrt(D), "causal": True, "dtype": "bfloat16"}
    w = DumpWriter(path, {"model": {"name": "gpt2-size-random"}}, overwrite=True)
    for name, tensor in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("x", x)):
        w.write_array(0, 0, name, tensor, layer_attrs=attrs)
    w.complete_step(0, loss=0.0)
    w.close()
    return path


def main() -> None:
    import typer

    from fa_forensics.cli import app
    from fa_forensics.commands.common import console

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="build the dump here and keep it")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="fa_bench_"))
    dump = build_dump(root / "gpt2.zarr")
    command = typer.main.get_command(app)
    rows = []
    for cmd in COMMANDS:
        t0 = time.perf_counter()
        with console.capture():
            code = command.main(args=[cmd[0], str(dump), *cmd[1:], "--json", str(root / f"{cmd[0]}.json")],
                                prog_name="fa-forensics", standalone_mode=False)
        rows.append((cmd[0], time.perf_counter() - t0, code))
        print(f"{cmd[0]:<12} {rows[-1][1]:7.1f} s  exit {code}", flush=True)
    print(f"\nB={B} H={H} T={T} D={D}, {torch.get_num_threads()} threads; goal < 60 s per command")
    for name, sec, code in rows:
        print(f"| {name} | {sec:.1f} s | {'ok' if sec < 60 else 'SLOW'} | exit {code} |")


if __name__ == "__main__":
    main()
