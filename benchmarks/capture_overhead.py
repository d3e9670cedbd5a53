"""Capture overhead on the demo model: unselected steps vs no capture, and the cost of a selected step.

Protocol (one run, interleaved in rotating order, medians): for each repeat r, time one training step
(forward + backward + AdamW) (a) with no capture, (b) inside an active capture session whose
selection does not contain this step, (c) inside a session that records this step (all layers,
heads, the batch slice); for (c) also the time until the background writer has flushed it.
Reported: median(b)/median(a) (aim ≤ 1.01) and median(c)/median(a). Sessions are entered and
left outside the timed region. Bytes per selected step are printed from the arithmetic below.

    python benchmarks/capture_overhead.py [--repeats 31] [--batch-size 4] [--threads 1] [--device cpu] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time

import torch
from demo_bench import DemoBench, add_common_args, rotated

import fa_forensics
from fa_forensics.demo.model import GPTConfig


def bytes_per_selected_step(config: GPTConfig, batch: int) -> int:
    """q, k, v, o, do in bf16: 5·B·H·T·D·2 bytes per layer, x in fp32 (LayerNorm output under autocast): B·T·C·4."""
    B, T, C = batch, config.block_size, config.n_embd
    return config.n_layer * (5 * B * T * C * 2 + B * T * C * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    args = parser.parse_args()
    bench = DemoBench(args, "fa-capture-bench-")
    model, config, scratch, one_step = bench.model, bench.config, bench.scratch, bench.one_step

    for _ in range(2):  # warm-up
        one_step()
    base, idle, selected, flushed = [], [], [], []
    try:
        for r in range(args.repeats):
            def run_base():
                base.append(one_step())

            def run_idle():
                with fa_forensics.capture(model, out=scratch / "idle.zarr", steps=[10**9], batch=args.capture_batch):
                    idle.append(one_step())

            def run_selected():
                with fa_forensics.capture(model, out=scratch / f"sel{r}.zarr", steps=[0], batch=args.capture_batch):
                    selected.append(one_step())
                    t0 = time.perf_counter()
                flushed.append(selected[-1] + time.perf_counter() - t0)
                shutil.rmtree(scratch / f"sel{r}.zarr")

            for case in rotated([run_base, run_idle, run_selected], r):
                case()
    finally:
        bench.cleanup()

    med = {name: statistics.median(v) for name, v in (("no_capture", base), ("unselected", idle), ("selected",
                                                                                                   selected),
                                                      ("selected_flushed", flushed))}
    result = {
        "model": {"n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
                  "block_size": config.block_size, "attention": config.attention},
        "device": bench.device_name(),
        "batch_size": args.batch_size,
        "capture_batch": args.capture_batch,
        "repeats": args.repeats,
        "median_seconds": med,
        "ratio_unselected_over_no_capture": med["unselected"] / med["no_capture"],
        "ratio_selected_over_no_capture": med["selected"] / med["no_capture"],
        "ratio_selected_flushed_over_no_capture": med["selected_flushed"] / med["no_capture"],
        "paired_ratio_unselected_quartiles": statistics.quantiles([i / b for i, b in zip(idle, base)], n=4),
        "bytes_per_selected_step": bytes_per_selected_step(config,
                                                           2 if args.capture_batch == "0:2" else args.batch_size),
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{'case':<34}{'median step (ms)':>18}{'ratio':>8}")
    for name, label in (("no_capture", "no capture"), ("unselected", "capture active, step not selected"),
                        ("selected", "selected step (training thread)"), ("selected_flushed",
                                                                          "selected step, until written")):
        print(f"{label:<34}{med[name] * 1000:>18.1f}{med[name] / med['no_capture']:>8.3f}")
    q1, q2, q3 = result["paired_ratio_unselected_quartiles"]
    print(f"paired ratio unselected/no-capture per repeat: median {q2:.3f}, quartiles {q1:.3f}-{q3:.3f} (the noise "
          "floor)")
    print(f"bytes per selected step (before zstd): {result['bytes_per_selected_step']:,}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
