"""The monitor's alarm on instabilities that arise on their own, and on healthy controls (docs/monitor.md).

Tiny GPT-style byte decoders (tests/helpers/unstable_training.py: AdamW, stdlib bytes, 2 layers, width 64,
context 64, batch 8) made unstable the ways Wortsman et al. 2023 describe (attention-logit growth without
qk-layernorm at a high learning rate; output-logit divergence without z-loss; optimizer settings), and
healthy controls (qk-layernorm, low learning rates, several seeds). Each run trains twice, side by side:
plainly, then inside `fa_forensics.capture(monitor_every=1, alarm=True, ring=4, alarm_steps=3)` (the library
form of `capture --monitor-every 1 --alarm --ring 4`), and reports:

- the loss-spike step (the first step whose loss is not finite or exceeds the median of the 20 before it by
  more than 1 nat and stays there over 5 steps, after step 20), the first alarm (step, rule, metric) and the
  lead (spike − first alarm);
- the alarms, the episodes and the lines the capture wrote on stderr (a healthy run's alarm is a false alarm);
- the steps kept in the store against those an alarm announced and that were dropped;
- the overhead: the monitored run's median step time over the plain run's.

    python benchmarks/natural_instabilities.py [--runs NAME,...] [--seeds 3] [--steps 300] [--keep DIR] [--json F]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_forensics  # noqa: E402
from fa_forensics.dump import open_dump  # noqa: E402
from tests.helpers.unstable_training import HEALTHY, UNSTABLE, RunSpec, loss_spike, train  # noqa: E402


def timed_train(spec: RunSpec, around=None) -> tuple[list[float], list[float]]:
    """(losses, seconds per step)."""
    stamps = [time.perf_counter()]

    def on_step(step: int, loss: float) -> None:
        stamps.append(time.perf_counter())

    kwargs = {} if around is None else {"around": around}
    losses = train(spec, on_step=on_step, stop_after_divergence=10, **kwargs)
    return losses, [b - a for a, b in zip(stamps, stamps[1:])]


def monitored_run(spec: RunSpec, out: Path, ring: int = 4, alarm_steps: int = 3) -> dict:
    """Train `spec` plainly and under the monitor; the numbers of the module docstring."""
    plain_losses, plain_times = timed_train(spec)
    sessions = []

    def around(model):
        sessions.append(fa_forensics.capture(model, out=out, steps=None, batch=None, monitor_every=1, alarm=True,
                                             alarm_steps=alarm_steps, ring=ring, overwrite=True))
        return sessions[-1]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, times = timed_train(spec, around)
    cap = sessions[0]
    spike = loss_spike(losses)
    alarms = cap.alarms
    first = alarms[0] if alarms else None
    dump = open_dump(out)
    monitor = dump.attrs.get("capture", {}).get("monitor", {})
    lines = [str(w.message) for w in caught if type(w.message).__name__ in ("AlarmWarning", "CaptureWarning")]
    same = all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(plain_losses, losses))
    n = min(len(plain_times), len(times))
    return {
        "name": spec.name, "healthy": spec.healthy, "steps": len(losses), "spike": spike,
        "first_alarm": None if first is None else {**first.to_json(), "line": first.message()},
        "lead": None if first is None or spike is None else spike - first.step,
        "alarms": len(alarms), "episodes": len(monitor.get("episodes", [])),
        "stderr_lines": len(lines), "alarm_lines": sum("alarm:" in line for line in lines),
        "steps_kept": len(dump.steps), "dropped": len(monitor.get("dropped_steps", [])),
        "qk_norm": monitor.get("qk_norm"),
        "store_mb": round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2 ** 20, 1),
        "overhead": round(statistics.median(times[1:n]) / statistics.median(plain_times[1:n]), 3),
        "losses_equal_plain": same,
    }


def specs(names: list[str] | None, seeds: int, steps: int) -> list[RunSpec]:
    out = [replace(s, steps=steps) for s in UNSTABLE]
    out += [replace(s, steps=steps, name=f"{s.name}/s{seed}", seed=seed) for s in HEALTHY for seed in range(seeds)]
    if names:
        out = [s for s in out if any(s.name == n or s.name.startswith(n + "/") for n in names)]
    return out


def table(runs: list[dict]) -> str:
    rows = ["| run | loss spike | first alarm (rule, metric) | lead | alarms / episodes / lines | steps kept / "
            "dropped | overhead |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        first = r["first_alarm"]
        what = "none" if first is None else f"{first['step']} ({first['rule']}, {first['metric']})"
        rows.append(f"| {r['name']} | {r['spike'] if r['spike'] is not None else 'none'} | {what} | "
                    f"{r['lead'] if r['lead'] is not None else '–'} | {r['alarms']} / {r['episodes']} / "
                    f"{r['stderr_lines']} | {r['steps_kept']} / {r['dropped']} | {r['overhead']:.2f}× |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=None, help="comma-separated run names (a healthy name: all its seeds)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per healthy control")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--keep", default=None, help="keep the stores in this folder")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = specs(args.runs.split(",") if args.runs else None, args.seeds, args.steps)
    runs = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="fa-natural-") as tmp:
        where = Path(args.keep) if args.keep else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for spec in chosen:
            runs.append(monitored_run(spec, where / f"{spec.name.replace('/', '-')}.zarr"))
            print(json.dumps(runs[-1]), flush=True)
    print(f"{platform.node()} {time.strftime('%Y-%m-%d')} torch {torch.__version__}; {time.time() - t0:.0f} s")
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
