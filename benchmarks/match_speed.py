"""`fa-forensics match` against a two-replay `bitdiff` of the same layer-step, side by side in one run.

For each kind of stored O below, one layer-step of a GPT-2-size shape (default B 4, H 12, T 1024, D 64, causal,
bf16 inputs ~ N(0, 1)) is written to a dump, then, alternating, in fresh processes:

  match     `fa-forensics match DUMP --match-cache off` (the recipes the recorded facts admit, screened on a row
            sample, the winner confirmed on every element)
  bitdiff   `fa-forensics bitdiff DUMP --a bf16 --b fp32` (named presets: the bf16 and the fp32 replay of the
            layer-step, forward only, and the bf16 replay's share of the stored O)

and prints the median wall and CPU seconds (user + system of the child) of --repeats runs and the ratio
match / bitdiff. Kinds (the recipe that writes O, and the facts the dump records):

  bf16       preset bf16 (the planted dumps' reading), device cpu: found after 13 screened recipes
  reference  bf16-autocast-train (the paper's code as it trains), device cpu: the first recipe tried
  cudnn      sdpa-cudnn-sm90 / tensor-core (a GPU run imported without facts, device unknown): every reading and
             reference recipe screened before the GPU kernels' models

Arithmetic of one replay: 2·B·H·T²·D multiply-adds (QKᵀ and P̄V, the causal half skipped by the tiled recipes).
With --exhaustive the search that replays every candidate on every element (what `match` did before it screened)
is timed in-process too, on the same dumps, and must name the same recipe and share.

    python benchmarks/match_speed.py [--kinds bf16 reference cudnn] [--shape 4x12x1024x64] [--repeats 3]
            [--exhaustive]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = {"bf16": ("bf16", "ieee", "cpu"), "reference": ("bf16-autocast-train", "ieee", "cpu"),
         "cudnn": ("sdpa-cudnn-sm90", "tensor-core", "unknown")}


def _write_dump(path: Path, kind: str, B: int, H: int, T: int, D: int) -> None:
    import torch

    from fa_forensics.dump.writer import DumpWriter
    from fa_forensics.replay import ReplayConfig, replay

    preset, acc, device = KINDS[kind]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(3))
    o = replay(q, k, v, ReplayConfig.preset(preset).with_(accumulation=acc), causal=True, scale=D ** -0.5).o
    with DumpWriter(path, {"device": device}) as w:
        for name, x in (("q", q), ("k", k), ("v", v), ("o", o)):
            w.write_array(0, 0, name, x, layer_attrs={"causal": True, "scale": D ** -0.5, "module": "bench.attn"})
        w.complete_step(0)


def _timed(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, stdout) of one command in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.stdout


def _exhaustive(dump_path: Path) -> tuple[float, tuple]:
    """(seconds, (preset, accumulation, share)) of the search that replays every candidate on every element."""
    from fa_forensics.dump import open_dump
    from fa_forensics.fidelity.candidates import layer_candidates, pick_best
    from fa_forensics.fidelity.layer_match import Candidate
    from fa_forensics.fidelity.run_facts import facts_at
    from fa_forensics.fidelity.sample import compare_o
    from fa_forensics.layers.selection import LayerSelection, load, replay_layer

    dump = open_dump(dump_path)
    t0 = time.perf_counter()
    t = load(dump, LayerSelection(0, 0, dump.heads(0, 0)))
    facts = facts_at(dump, 0, 0)
    tried = []
    for r in layer_candidates(t, facts).recipes:
        share, err, n = compare_o(replay_layer(t, r.config(), backward=False).o, t.o)
        tried.append(Candidate(r.preset, r.accumulation, share, err, n))
        if share == 1.0:
            break
    best = pick_best(tried, facts)
    return time.perf_counter() - t0, (best.preset, best.accumulation, best.o_bits_equal)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--shape", default="4x12x1024x64", help="BxHxTxD")
    ap.add_argument("--repeats", type=int, default=3, help="runs per command (the median is shown)")
    ap.add_argument("--exhaustive", action="store_true", help="also time the exhaustive search in-process")
    args = ap.parse_args()
    B, H, T, D = (int(x) for x in args.shape.split("x"))
    cli = str(Path(sys.executable).with_name("fa-forensics"))
    print(f"one layer-step B {B} H {H} T {T} D {D}, causal, bf16; median of {args.repeats} runs each, alternating; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")
    print(f"{'stored O':>10} | {'match wall':>10} {'cpu':>6} | {'bitdiff wall':>12} {'cpu':>6} | "
          f"{'ratio wall':>10} {'cpu':>5} | best recipe, share")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            dump = Path(tmp) / f"{kind}.zarr"
            _write_dump(dump, kind, B, H, T, D)
            match, bitdiff = [], []
            for i in range(args.repeats):
                js = Path(tmp) / f"{kind}-{i}.json"
                match.append(_timed([cli, "match", str(dump), "--match-cache", "off", "--json", str(js)]))
                bitdiff.append(_timed([cli, "bitdiff", str(dump), "--a", "bf16", "--b", "fp32"]))
            best = json.loads(js.read_text())["layers"][0]["best"]
            mw, mc = (statistics.median(x[j] for x in match) for j in (0, 1))
            bw, bc = (statistics.median(x[j] for x in bitdiff) for j in (0, 1))
            print(f"{kind:>10} | {mw:>10.1f} {mc:>6.1f} | {bw:>12.1f} {bc:>6.1f} | {mw / bw:>10.2f} {mc / bc:>5.2f} | "
                  f"{best['preset']} / {best['accumulation']} {best['o_bits_equal']:.6f}", flush=True)
            if args.exhaustive:
                seconds, found = _exhaustive(dump)
                same = found == (best["preset"], best["accumulation"], best["o_bits_equal"])
                verdict = "yes" if same else "NO"
                print(f"{'':>10}   exhaustive search in-process: {seconds:.1f} s, same result: {verdict}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
