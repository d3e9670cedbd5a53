"""Monitor overhead on the demo model: training steps monitored (timeline rows, alarm rule) vs no capture.

Protocol (one run; the cases interleaved in rotating order; medians over repeats). Each repeat times
one block of `--block` training steps per case. A training step is forward + backward + AdamW +
`cap.step(loss)`, plus reading the loss, as demo-train does. The cases:
(a) no capture;
(b) inside a capture session with `monitor_every=1` and no dump steps: per-head statistics of every
    layer on the batch slice, exact W_Q spectral norms, one timeline row per step;
(c) as (b) with `alarm=True` (the rule runs on every row);
(d) as (c) with `ring=4, alarm_steps=3` (the issue's `capture --monitor-every 1 --alarm --ring 4`: every
    monitored step's arrays are held in host memory for the ring).
In (b) and (c) the session is entered and one warm-up step is run before the timer starts. The timer
then covers the block AND the session's exit, so the writer's timeline appends (buffered, 16 rows at
a time) and its final flush are paid inside the timed block. That is pessimistic: a real run pays the
exit once, not once per block. Reported:
- per-step median of each case, in wall seconds and in CPU seconds of the whole process (every thread: the
  monitor's worker and the store's writer included; on a machine shared with other jobs the CPU seconds are the
  steadier measure of what the monitor costs);
- median(b)/median(a), median(c)/median(a) and median(d)/median(a), wall and CPU (the aim is ≤ 1.03);
- the quartiles of the paired per-repeat ratio b/a (the noise of the machine);
- the load average before and after the run.

Arithmetic of the statistics per monitored step (demo: L = 4, H = 4, T = 256, D = 32, batch slice
B = 2): the scores are 2·B·H·T²·D·L = 67 MFLOP. The model's attention forward on the full batch of
4 is 2·(2·4·4·T²·D)·4 = 268 MFLOP; its whole step is ≈ 6·0.86 M·4·256 + attention ≈ 2.1 GFLOP.
On top of the scores come about 6 elementwise passes (scale, mask, max, subtract, exp, floor count)
over the 0.4 M entries per layer that the causal mask leaves within reach. W_Q takes 3 iterations
of 2·(H·D·C) multiply-adds per layer, which is negligible.

    python benchmarks/monitor_overhead.py [--repeats 9] [--block 16] [--batch-size 4] [--capture-batch 0:2] \
        [--threads 1] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch
from demo_bench import DemoBench, add_common_args, rotated

import fa_forensics


CASES = {"no_capture": "no capture", "monitor": "monitored step (--monitor-every 1)",
         "monitor_alarm": "monitored step + alarm rule", "monitor_alarm_ring": "monitored + alarm + ring 4"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--block", type=int, default=16, help="training steps per timed block")
    parser.set_defaults(repeats=9)
    args = parser.parse_args()
    load_before = os.getloadavg()
    bench = DemoBench(args, "fa-monitor-bench-")
    model, config, scratch = bench.model, bench.config, bench.scratch

    def plain_block() -> tuple[float, float]:
        """(wall, CPU) seconds per step of a block without capture."""
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(args.block):
            bench.one_step(read_loss=True)
        return (time.perf_counter() - t0) / args.block, (time.process_time() - c0) / args.block

    def monitored_block(name: str, **settings) -> tuple[float, float]:
        """(wall, CPU) seconds per step of a block in a fresh monitored session, its exit (final flush) included."""
        out = scratch / f"{name}.zarr"
        cap = fa_forensics.capture(model, out=out, steps=None, batch=args.capture_batch, monitor_every=1, **settings)
        cap.__enter__()
        try:
            bench.one_step(cap, read_loss=True)  # warm-up step, untimed
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(args.block):
                bench.one_step(cap, read_loss=True)
        finally:
            cap.__exit__(None, None, None)
        seconds = ((time.perf_counter() - t0) / args.block, (time.process_time() - c0) / args.block)
        shutil.rmtree(out)
        return seconds

    plain_block(), monitored_block("warm", alarm=True)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    make = {"no_capture": plain_block, "monitor": lambda: monitored_block("m", alarm=False),
            "monitor_alarm": lambda: monitored_block("a", alarm=True),
            "monitor_alarm_ring": lambda: monitored_block("r", alarm=True, ring=4, alarm_steps=3)}
    try:
        cases = [lambda name=name: runs[name].append(make[name]()) for name in CASES]
        for r in range(args.repeats):
            for case in rotated(cases, r):
                case()
    finally:
        bench.cleanup()

    base, mon = [w for w, _ in runs["no_capture"]], [w for w, _ in runs["monitor"]]
    med = {name: statistics.median(w for w, _ in runs[name]) for name in CASES}
    cpu = {name: statistics.median(c for _, c in runs[name]) for name in CASES}
    result = {
        "model": {"n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
                  "block_size": config.block_size},
        "device": bench.device_name(),
        "batch_size": args.batch_size, "capture_batch": args.capture_batch, "repeats": args.repeats,
        "block": args.block,
        "median_seconds": med,
        "ratio_monitor_over_no_capture": med["monitor"] / med["no_capture"],
        "ratio_monitor_alarm_over_no_capture": med["monitor_alarm"] / med["no_capture"],
        "ratio_monitor_alarm_ring_over_no_capture": med["monitor_alarm_ring"] / med["no_capture"],
        "median_cpu_seconds": cpu,
        "cpu_ratio_over_no_capture": {name: cpu[name] / cpu["no_capture"] for name in CASES},
        "paired_ratio_monitor_quartiles": statistics.quantiles([m / b for m, b in zip(mon, base)], n=4),
        "torch_threads": torch.get_num_threads(),
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
    }
    print(f"{'case':<44}{'wall ms/step':>14}{'ratio':>8}{'CPU ms/step':>14}{'ratio':>8}")
    for name, label in CASES.items():
        print(f"{label:<44}{med[name] * 1000:>14.1f}{med[name] / med['no_capture']:>8.3f}"
              f"{cpu[name] * 1000:>14.1f}{cpu[name] / cpu['no_capture']:>8.3f}")
    q1, q2, q3 = result["paired_ratio_monitor_quartiles"]
    print(f"paired ratio monitored/no-capture per repeat: median {q2:.3f}, quartiles {q1:.3f}-{q3:.3f}")
    print(f"load average (1 min) before {load_before[0]:.2f}, after {result['load_average_after'][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
