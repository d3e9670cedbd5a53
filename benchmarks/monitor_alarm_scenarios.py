"""When the alarm fires on injected instabilities, and that it does not on stable runs (docs/monitor.md).

The tiny bf16 GPT of tests/data/monitor_scenarios/gpt_scenarios.py (2 layers, width 64, 4 heads, context 64,
batch 8, AdamW 3e-3) trains 300 steps on stdlib bytes inside `fa_forensics.capture(monitor_every=1,
alarm=True)` with the statistics on the whole batch (as `capture` does), once per (scenario, seed). An
instability is injected from step `--at`. Reported per run: the first alarm (step, rule, metric, where) and
the number of alarms; per scenario the first-alarm steps over the seeds. A control that alarms is a false
alarm. Not a timing: steps, not seconds.

    python benchmarks/monitor_alarm_scenarios.py [--seeds 3] [--controls 10] [--lr 0.003] [--json FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

import fa_forensics

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "data" / "monitor_scenarios" / "gpt_scenarios.py"
INJECTED = ("logit-growth", "sink-drift", "lr-jump", "wq-x20", "wq-x1e36", "wq-nan", "nan-activation", "inf-loss")


def load_scenarios():
    spec = importlib.util.spec_from_file_location("gpt_scenarios", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_alarms(scenarios, scratch: Path, scenario: str, seed: int, at: int, lr: float) -> dict:
    sessions = []

    def around(model):
        sessions.append(fa_forensics.capture(model, out=scratch / f"{scenario}-{seed}.zarr", steps=None, batch=None,
                                             monitor_every=1, alarm=True, alarm_steps=0, overwrite=True))
        return sessions[-1]

    scenarios.train(scenario, steps=300, at=at, seed=seed, lr=lr, around=around)
    alarms = sessions[0].alarms
    first = alarms[0] if alarms else None
    return {"scenario": scenario, "seed": seed, "alarms": len(alarms),
            "first": None if first is None else {**first.to_json(), "line": first.message()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per injected scenario")
    parser.add_argument("--controls", type=int, default=10, help="seeds of the stable control")
    parser.add_argument("--at", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import warnings

    warnings.simplefilter("ignore")  # the alarm lines: reported below
    scenarios = load_scenarios()
    runs = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="fa-alarm-scenarios-") as tmp:
        for seed in range(args.controls):
            runs.append(first_alarms(scenarios, Path(tmp), "control", seed, args.at, args.lr))
        for scenario in INJECTED:
            for seed in range(args.seeds):
                runs.append(first_alarms(scenarios, Path(tmp), scenario, seed, args.at, args.lr))
    print(f"{platform.node()} {time.strftime('%Y-%m-%d')} torch {torch.__version__}, lr {args.lr}, "
          f"injected at step {args.at}; {time.time() - t0:.0f} s")
    print("| scenario | first alarm (step, per seed) | rule, metric of the first | alarms per run |")
    print("|---|---|---|---|")
    for scenario in ("control", *INJECTED):
        mine = [r for r in runs if r["scenario"] == scenario]
        steps = ", ".join("none" if r["first"] is None else str(r["first"]["step"]) for r in mine)
        kinds = sorted({f"{r['first']['rule']}, {r['first']['metric']}" for r in mine if r["first"]})
        counts = ", ".join(str(r["alarms"]) for r in mine)
        print(f"| {scenario} | {steps} | {'; '.join(kinds) or '–'} | {counts} |")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
