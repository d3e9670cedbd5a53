"""Monitor overhead on the demo model: training steps monitored (timeline rows, alarm rule) vs no capture.

Protocol (one run; the cases interleaved in rotating order; medians over repeats). Each repeat times
one block of `--block` training steps per case. A training step is forward + backward + AdamW +
`cap.step(loss)`, plus reading the loss, as demo-train does. The cases:
(a) no capture;
(b) inside a capture session with `monitor_every=1` and no dump steps: per-head statistics of every
    layer on the batch slice, exact W_Q spectral norms, one timeline row per step;
(c) as (b) with `alarm=True` (the rule runs on every row).
In (b) and (c) the session is entered and one warm-up step is run before the timer starts. The timer
then covers the block AND the session's exit, so the writer's timeline appends (buffered, 16 rows at
a time) and its final flush are paid inside the timed block. That is pessimistic: a real run pays the
exit once, not once per block. Reported:
- per-step median of each case;
- median(b)/median(a) and median(c)/median(a) (the aim is ≤ 1.03);
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--block", type=int, default=16, help="training steps per timed block")
    parser.set_defaults(repeats=9)
    args = parser.parse_args()
    load_before = os.getloadavg()
    bench = DemoBench(args, "fa-monitor-bench-")
    model, config, scratch = bench.model, bench.config, bench.scratch

    def plain_block() -> float:
        return sum(bench.one_step(read_loss=True) for _ in range(args.block)) / args.block

    def monitored_block(name: str, alarm: bool) -> float:
        """Seconds per step of a block in a fresh monitored session, its exit (final flush) included."""
        out = scratch / f"{name}.zarr"
        cap = fa_forensics.capture(model, out=out, steps=None, batch=args.capture_batch, monitor_every=1, alarm=alarm)
        cap.__enter__()
        try:
            bench.one_step(cap, read_loss=True)  # warm-up step, untimed
            t0 = time.perf_counter()
            for _ in range(args.block):
                bench.one_step(cap, read_loss=True)
        finally:
            cap.__exit__(None, None, None)
        seconds = (time.perf_counter() - t0) / args.block
        shutil.rmtree(out)
        return seconds

    plain_block(), monitored_block("warm", True)  # warm-up
    base, mon, mon_alarm = [], [], []
    try:
        cases = [lambda: base.append(plain_block()), lambda: mon.append(monitored_block("m", False)),
                 lambda: mon_alarm.append(monitored_block("a", True))]
        for r in range(args.repeats):
            for case in rotated(cases, r):
                case()
    finally:
        bench.cleanup()

    med = {"no_capture": statistics.median(base), "monitor": statistics.median(mon),
           "monitor_alarm": statistics.median(mon_alarm)}
    result = {
        "model": {"n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
                  "block_size": config.block_size},
        "device": bench.device_name(),
        "batch_size": args.batch_size, "capture_batch": args.capture_batch, "repeats": args.repeats,
        "block": args.block,
        "median_seconds": med,
        "ratio_monitor_over_no_capture": med["monitor"] / med["no_capture"],
        "ratio_monitor_alarm_over_no_capture": med["monitor_alarm"] / med["no_capture"],
        "paired_ratio_monitor_quartiles": statistics.quantiles([m / b for m, b in zip(mon, base)], n=4),
        "torch_threads": torch.get_num_threads(),
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
    }
    print(f"{'case':<40}{'median step (ms)':>18}{'ratio':>8}")
    for name, label in (("no_capture", "no capture"), ("monitor", "monitored step (--monitor-every 1)"),
                        ("monitor_alarm", "monitored step + alarm rule")):
        print(f"{label:<40}{med[name] * 1000:>18.1f}{med[name] / med['no_capture']:>8.3f}")
    q1, q2, q3 = result["paired_ratio_monitor_quartiles"]
    print(f"paired ratio monitored/no-capture per repeat: median {q2:.3f}, quartiles {q1:.3f}-{q3:.3f}")
    print(f"load average (1 min) before {load_before[0]:.2f}, after {result['load_average_after'][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
