"""Capture on a torch.compile'd model: the cost of an unselected compiled step, and dynamo's counters.

Protocol (one run, one compiled model, blocks interleaved in alternating order, medians): the demo
GPT (nanoGPT-shaped, SDPA attention, bf16 autocast) is compiled once with `torch.compile(model)`.
Warm-up: 3 steps without capture, then a capture session recording step 1 of 3 steps (this
compiles the graph for steps that are not busy and the one for busy steps). Then `--repeats`
times: a block of `--block` steps without capture and a block of `--block` steps inside a capture
session whose selection holds no step of the block (sessions are entered and left outside the
timed steps). Each step is forward + backward + AdamW, timed alone.

Reported: median step time of each case (wall clock, and the process's CPU time, which a loaded
machine disturbs less with one torch thread), their ratios (capture / none), and dynamo's counters:
graph breaks, unique graphs and frames compiled after warm-up (0 = no recompilation).

    python benchmarks/capture_compile_overhead.py [--repeats 10] [--block 5] [--batch-size 4] [--threads 1] \
        [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import torch
from torch._dynamo.utils import counters

import fa_forensics
from fa_forensics.demo.model import GPT, GPTConfig

FAR_STEP = 10**9  # a selection the run never reaches: every timed step is unselected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPTConfig(attention="sdpa")  # 4 layers, 4 heads, C 128, T 256
    model = GPT(config)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    scratch = tempfile.mkdtemp(prefix="fa-compile-bench-")

    def one_step() -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one training step."""
        idx = torch.randint(0, config.vocab_size, (args.batch_size, config.block_size), generator=gen)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = compiled(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, time.process_time() - c0

    try:
        t0 = time.perf_counter()
        for _ in range(3):
            one_step()
        with fa_forensics.capture(compiled, out=f"{scratch}/warm.zarr", steps=[1]):
            for _ in range(3):
                one_step()
        warmup_s = time.perf_counter() - t0
        stats_after_warmup = dict(counters["stats"])
        times: dict[str, list[tuple[float, float]]] = {"none": [], "capture": []}
        for r in range(args.repeats):
            for case in (("none", "capture") if r % 2 == 0 else ("capture", "none")):
                if case == "none":
                    times[case] += [one_step() for _ in range(args.block)]
                else:
                    with fa_forensics.capture(compiled, out=f"{scratch}/r{r}.zarr", steps=[FAR_STEP]):
                        times[case] += [one_step() for _ in range(args.block)]
        stats = dict(counters["stats"])
        med = {case: statistics.median(w for w, _ in ts) for case, ts in times.items()}
        cpu = {case: statistics.median(c for _, c in ts) for case, ts in times.items()}
        result = {
            "median_ms": {case: 1e3 * m for case, m in med.items()},
            "ratio_capture_over_none": med["capture"] / med["none"],
            "median_cpu_ms": {case: 1e3 * m for case, m in cpu.items()},
            "cpu_ratio_capture_over_none": cpu["capture"] / cpu["none"],
            "steps_per_case": len(times["none"]),
            "warmup_s": warmup_s,
            "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": stats.get("unique_graphs"),
            "frames_compiled_after_warmup": stats.get("unique_graphs", 0) - stats_after_warmup.get("unique_graphs", 0),
            "batch_size": args.batch_size, "threads": args.threads,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"compiled demo GPT (4 layers, T 256, batch {args.batch_size}), {result['steps_per_case']} unselected steps "
          "per case")
    print(f"  no capture          wall {result['median_ms']['none']:8.1f} ms   cpu "
          f"{result['median_cpu_ms']['none']:8.1f} ms")
    print(f"  capture, unselected wall {result['median_ms']['capture']:8.1f} ms   cpu "
          f"{result['median_cpu_ms']['capture']:8.1f} ms")
    print(f"  ratio capture / none: wall {result['ratio_capture_over_none']:.3f}, cpu "
          f"{result['cpu_ratio_capture_over_none']:.3f}")
    print(f"  dynamo: graph breaks {result['graph_breaks']}, unique graphs {result['unique_graphs']}, "
          f"compiled after warm-up {result['frames_compiled_after_warmup']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
