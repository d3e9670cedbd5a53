"""Monitor overhead on the demo model: a training step monitored (timeline row, alarm rule) vs no capture.

Protocol (one run, the cases interleaved in rotating order, medians): for each repeat r, time one
training step (forward + backward + AdamW + `cap.step(loss)`, as demo-train does) (a) with no
capture, (b) inside a capture session with `monitor_every=1` and no dump steps (per-head statistics
of every layer on the batch slice, W_Q power iteration, the row queued for the writer thread),
(c) as (b) with `alarm=True` (the rule evaluated on the row). Sessions are entered and left outside
the timed region. Reported: median(b)/median(a) and median(c)/median(a) (aim ≤ 1.03), and the
paired per-repeat ratio quartiles (the noise floor of the machine).

Arithmetic of the statistics per monitored step (demo: L = 4, H = 4, T = 256, D = 32, batch slice
B = 2): scores 2·B·H·T²·D·L = 67 MFLOP (the model's attention forward on the full batch of 4 is
2·(2·4·4·T²·D)·4 = 268 MFLOP, its whole step ≈ 6·0.86 M·4·256 + attention ≈ 2.1 GFLOP), plus
≈ 10 elementwise passes over the B·H·T² = 0.5 M scores per layer; W_Q: 3 iterations of 2·(H·D·C)
multiply-adds per layer (negligible).

    python benchmarks/monitor_overhead.py [--repeats 31] [--batch-size 4] [--capture-batch 0:2] [--threads 1] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics

import torch
from demo_bench import DemoBench, add_common_args, rotated

import fa_forensics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    args = parser.parse_args()
    bench = DemoBench(args, "fa-monitor-bench-")
    model, config, device, scratch = bench.model, bench.config, bench.device, bench.scratch

    def one_step(cap=None) -> float:
        return bench.one_step(cap, read_loss=True)  # demo-train reads the loss every step: so do all cases

    def monitored(name: str, alarm: bool, times: list) -> None:
        out = scratch / f"{name}.zarr"
        with fa_forensics.capture(model, out=out, steps=None, batch=args.capture_batch, monitor_every=1, alarm=alarm) as cap:
            times.append(one_step(cap))
        shutil.rmtree(out)

    for _ in range(2):  # warm-up
        one_step()
        monitored("warm", True, [])
    base, mon, mon_alarm = [], [], []
    try:
        cases = [lambda: base.append(one_step()), lambda: monitored("m", False, mon), lambda: monitored("a", True, mon_alarm)]
        for r in range(args.repeats):
            for case in rotated(cases, r):
                case()
    finally:
        bench.cleanup()

    med = {"no_capture": statistics.median(base), "monitor": statistics.median(mon), "monitor_alarm": statistics.median(mon_alarm)}
    result = {
        "model": {"n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd, "block_size": config.block_size},
        "device": bench.device_name(),
        "batch_size": args.batch_size, "capture_batch": args.capture_batch, "repeats": args.repeats,
        "median_seconds": med,
        "ratio_monitor_over_no_capture": med["monitor"] / med["no_capture"],
        "ratio_monitor_alarm_over_no_capture": med["monitor_alarm"] / med["no_capture"],
        "paired_ratio_monitor_quartiles": statistics.quantiles([m / b for m, b in zip(mon, base)], n=4),
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{'case':<40}{'median step (ms)':>18}{'ratio':>8}")
    for name, label in (("no_capture", "no capture"), ("monitor", "monitored step (--monitor-every 1)"),
                        ("monitor_alarm", "monitored step + alarm rule")):
        print(f"{label:<40}{med[name] * 1000:>18.1f}{med[name] / med['no_capture']:>8.3f}")
    q1, q2, q3 = result["paired_ratio_monitor_quartiles"]
    print(f"paired ratio monitored/no-capture per repeat: median {q2:.3f}, quartiles {q1:.3f}-{q3:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
