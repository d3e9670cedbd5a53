"""The background writer's cost to training: the steps right after a recorded step, and recording after an alarm.

A small SDPA GPT trains on the CPU (2 layers, width 64, 4 heads, T = 256, batch 4, one torch thread); a
recorded step stores q, k, v, o, dO and X of both layers for batch rows 0:2 in fp32:
2 layers · 6 arrays · 2·256·64·4 bytes = 1.5 MiB per step (before zstd).

Part 1, steps after a recorded step (one run, cases interleaved in rotating order): each repeat r trains,
for each case, one recorded step and the `window` steps after it (a block), timing every step: (a) no capture
(the same steps, none recorded); (b) the writer at full speed (writer_duty=1, as it wrote before it was paced);
(c) the paced writer (the default writer_duty, 0.1). The window is long enough for either writer to finish
the recorded step. Reported, as medians over the repeats of ratios to the no-capture block of the same repeat:
the time of all `window` steps (the writer's whole cost), the median of the first 4 steps (where a writer at
full speed puts its cost; a paced one spreads the same work over more steps) and the recorded step itself.
Goal: (c) ≤ 1.1 on both. Also reported: the share of the time from the recorded step to the end of the
window the writer spent writing (the paced writer's bound by construction: `writer_duty` while little
waits). On a shared machine single steps vary by ±50 % from other processes: the no-capture blocks of two
neighbouring repeats give the noise floor.

Part 2, recording after an alarm: monitor every step with a ring of `ring` steps and an alarm (warm-up 10);
at step 30 W_Q of layer 0 is multiplied by 20, the alarm fires and the ring's steps plus `alarm_steps` more
are written. Reported: the median and the largest step time of the 10 steps after the alarm over the median
of the 10 steps before W_Q was changed (the same run), and which steps were written or dropped.

    python benchmarks/capture_writer_cost.py [--repeats 10] [--window 40] [--ring 8] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import fa_forensics
from fa_forensics.demo.model import GPT, GPTConfig
from fa_forensics.monitor.alarm import AlarmRule

CONFIG = GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=64, attention="sdpa")
BATCH = 4


def bytes_per_recorded_step(config: GPTConfig = CONFIG, rows: int = 2) -> int:
    """q, k, v, o, dO and X in fp32 per layer: 6 · rows · T · C · 4 bytes."""
    return config.n_layer * 6 * rows * config.block_size * config.n_embd * 4


class Trainer:
    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = GPT(CONFIG)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self, cap=None) -> float:
        x = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size), generator=self.gen)
        t0 = time.perf_counter()
        _, loss = self.model(x, x)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if cap is not None:
            cap.step(loss)
        return time.perf_counter() - t0


BUSY: dict[float, list[tuple[float, float]]] = {}  # duty -> [(seconds the writer wrote, seconds it had to write)]


def block(trainer: Trainer, scratch: Path, duty, window: int) -> list[float]:
    """Step times of one recorded step and the `window` steps after it; duty None: nothing recorded."""
    if duty is None:
        return [trainer.step() for _ in range(window + 1)]
    out = scratch / f"d{duty}-{time.monotonic_ns()}.zarr"
    with fa_forensics.capture(trainer.model, out=out, steps=[0], batch="0:2", writer_duty=duty) as cap:
        times = [trainer.step(cap) for _ in range(window + 1)]
        writer = cap._writer
        BUSY.setdefault(duty, []).append((writer.seconds_writing, writer.seconds_open()))
    shutil.rmtree(out)
    return times


def after_alarm(scratch: Path, ring: int, alarm_steps: int) -> dict:
    trainer = Trainer(seed=1)
    out = scratch / "alarm.zarr"
    times = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with fa_forensics.capture(trainer.model, out=out, steps=[], batch="0:2", monitor_every=1,
                                  alarm=AlarmRule.with_settings(warmup=10), alarm_steps=alarm_steps, ring=ring) as cap:
            for i in range(60):
                if i == 30:
                    with torch.no_grad():
                        trainer.model.transformer.h[0].attn.c_attn.weight[:CONFIG.n_embd] *= 20
                times.append(trainer.step(cap))
            alarms = [a.step for a in cap.alarms]
    dump = fa_forensics.open_dump(out)
    first = alarms[0] if alarms else None
    result = {"alarm_steps": alarms, "steps_written": dump.steps,
              "dropped": [str(w.message) for w in said if "was dropped" in str(w.message)]}
    if first is not None:
        before = statistics.median(times[20:30])
        following = times[first + 1:first + 11]
        result.update(median_ratio=statistics.median(following) / before, max_ratio=max(following) / before,
                      median_before_ms=before * 1e3)
    shutil.rmtree(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--window", type=int, default=40)
    parser.add_argument("--ring", type=int, default=8)
    parser.add_argument("--alarm-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="fa-writer-bench-"))
    trainer = Trainer()
    for _ in range(3):
        trainer.step()
    cases = {"no capture": None, "writer at full speed": 1.0, "paced writer": 0.1}
    blocks: dict[str, list[list[float]]] = {name: [] for name in cases}
    try:
        for r in range(args.repeats):
            names = list(cases)
            for name in names[r % 3:] + names[:r % 3]:
                blocks[name].append(block(trainer, scratch, cases[name], args.window))
        alarm = after_alarm(scratch, args.ring, args.alarm_steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def ratios(name: str, part) -> float:
        return statistics.median(part(b) / part(p) for b, p in zip(blocks[name], blocks["no capture"]))

    whole, first4, recorded = (lambda b: sum(b[1:])), (lambda b: statistics.median(b[1:5])), (lambda b: b[0])
    plain = blocks["no capture"]
    noise = statistics.median(abs(sum(a[1:]) / sum(b[1:]) - 1) for a, b in zip(plain[1:], plain[:-1]))
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d"),
        "bytes_per_recorded_step": bytes_per_recorded_step(),
        "median_step_ms_no_capture": statistics.median(t for b in plain for t in b) * 1e3,
        "window": args.window,
        "window_over_plain": {n: ratios(n, whole) for n in cases if cases[n] is not None},
        "first_4_over_plain": {n: ratios(n, first4) for n in cases if cases[n] is not None},
        "recorded_over_plain": {n: ratios(n, recorded) for n in cases if cases[n] is not None},
        "noise_floor": noise,
        "writer_busy_share": {n: statistics.median(w / max(o, 1e-9) for w, o in BUSY[cases[n]])
                              for n in cases if cases[n] is not None},
        "writer_seconds_per_recorded_step": statistics.median(w for w, _ in BUSY[1.0]),
        "alarm": alarm,
    }
    print(f"median step without capture: {result['median_step_ms_no_capture']:.1f} ms; "
          f"{result['bytes_per_recorded_step'] / 2 ** 20:.2f} MiB per recorded step; noise floor between "
          f"neighbouring no-capture windows ±{noise:.1%}")
    print(f"the writer wrote a recorded step in {result['writer_seconds_per_recorded_step']:.2f} s of wall time")
    print(f"{'case':<24}{f'{args.window} steps after / plain':>26}{'first 4 after / plain':>24}"
          f"{'recorded step / plain':>24}{'writer busy share':>20}")
    for n in result["window_over_plain"]:
        print(f"{n:<24}{result['window_over_plain'][n]:>26.3f}{result['first_4_over_plain'][n]:>24.3f}"
              f"{result['recorded_over_plain'][n]:>24.2f}{result['writer_busy_share'][n]:>20.2f}")
    if "median_ratio" in alarm:
        print(f"alarm at step {alarm['alarm_steps'][0]}: the 10 steps after it / the 10 before the change: median "
              f"{alarm['median_ratio']:.2f}, largest {alarm['max_ratio']:.2f}; steps written {alarm['steps_written']}, "
              f"{len(alarm['dropped'])} dropped")
    else:
        print(f"no alarm fired: {alarm}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
