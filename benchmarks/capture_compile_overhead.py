"""Capture on a torch.compile'd model: the cost of an unselected and of a recorded compiled step, and what
dynamo and inductor compile after warm-up.

Protocol (one run, one compiled model, blocks interleaved in rotating order, medians): the demo GPT
(nanoGPT-shaped, SDPA attention, bf16 autocast) is compiled once with `torch.compile(model)`.
Warm-up: 3 steps without capture, then a capture session recording step 1 of 3 steps (its first step
compiles the session's graph, taps included; nothing else compiles after it). Then `--repeats` times,
in rotating order, a block of `--block` steps of each case:
- `none`: no capture session;
- `unselected`: inside a capture session whose selection holds no step of the block;
- `recorded`: the first step of a capture session that records it (all layers and heads, batch rows
  0:2, capture's default: Q, K, V, O, X and dO copied to the host and queued for the background
  writer); the block's other steps are run, untimed, so the writer drains before the next case.
Sessions are entered and left outside the timed steps. Each step is forward + backward + AdamW, timed
alone (wall clock, and the process's CPU time, which a loaded machine disturbs less with one torch thread).

Reported: median step time of each case, their ratios to `none`, and what was compiled after warm-up:
dynamo frames, graphs and inductor graphs (the backward's graph is compiled at its first run), from
torch's own counters (0 = no recompilation at recorded steps), and graph breaks.

    python benchmarks/capture_compile_overhead.py [--repeats 12] [--block 4] [--batch-size 4] [--threads 1] \
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
CASES = ("none", "unselected", "recorded")


def compile_work() -> dict:
    """Frames dynamo traced, graphs it made, graphs inductor compiled (cache hits included) so far."""
    inductor = counters["inductor"]
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "inductor_graphs": sum(inductor[k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                                         "fxgraph_cache_bypass"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--block", type=int, default=4)
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

    def block(case: str, name: str) -> list[tuple[float, float]]:
        if case == "none":
            return [one_step() for _ in range(args.block)]
        selected = 0 if case == "recorded" else FAR_STEP
        with fa_forensics.capture(compiled, out=f"{scratch}/{name}.zarr", steps=[selected]):
            times = [one_step() for _ in range(args.block)]
        return times[:1] if case == "recorded" else times

    try:
        t0 = time.perf_counter()
        for _ in range(3):
            one_step()
        before_session = compile_work()
        with fa_forensics.capture(compiled, out=f"{scratch}/warm.zarr", steps=[1]):
            for _ in range(3):
                one_step()
        warmup_s = time.perf_counter() - t0
        after_warmup = compile_work()
        times: dict[str, list[tuple[float, float]]] = {case: [] for case in CASES}
        for r in range(args.repeats):
            order = CASES[r % 3:] + CASES[:r % 3]
            for case in order:
                times[case] += block(case, f"{case}{r}")
        end = compile_work()
        med = {case: statistics.median(w for w, _ in ts) for case, ts in times.items()}
        cpu = {case: statistics.median(c for _, c in ts) for case, ts in times.items()}
        result = {
            "steps_timed": {case: len(ts) for case, ts in times.items()},
            "median_ms": {case: 1e3 * m for case, m in med.items()},
            "ratio_over_none": {case: med[case] / med["none"] for case in CASES[1:]},
            "median_cpu_ms": {case: 1e3 * m for case, m in cpu.items()},
            "cpu_ratio_over_none": {case: cpu[case] / cpu["none"] for case in CASES[1:]},
            "warmup_s": warmup_s,
            "compiled_at_session_start": {k: after_warmup[k] - before_session[k] for k in end},
            "compiled_after_warmup": {k: end[k] - after_warmup[k] for k in end},
            "graph_breaks": sum(counters["graph_break"].values()),
            "batch_size": args.batch_size, "threads": args.threads,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"compiled demo GPT (4 layers, T 256, batch {args.batch_size}); steps timed {result['steps_timed']}")
    for case in CASES:
        ratio = "" if case == "none" else (f"   ratio wall {result['ratio_over_none'][case]:.3f}, "
                                           f"cpu {result['cpu_ratio_over_none'][case]:.3f}")
        print(f"  {case:<11} wall {result['median_ms'][case]:8.1f} ms   cpu {result['median_cpu_ms'][case]:8.1f} ms"
              f"{ratio}")
    print(f"  compiled when the session started: {result['compiled_at_session_start']}")
    print(f"  compiled after warm-up: {result['compiled_after_warmup']}; graph breaks {result['graph_breaks']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
