"""`report` on monitored runs: wall and CPU seconds, per section, on a run that stored only its alarm's steps and,
side by side, on the same run with every step recorded in full.

The dumps are what the monitor writes on an unstable run: a tiny GPT-style byte decoder
(tests/helpers/unstable_training.py, output-logit divergence: first alarm at step 20, loss spike at step 48)
trained `--steps` steps inside `fa_forensics.capture(monitor_every=1, alarm=True, ring=4, alarm_steps=3)` (the
library form of `capture --monitor-every 1 --alarm --ring 4`):
- `alarm_steps_only`: the store holds the alarm's ring and the steps after it (7 steps) and the timeline;
- `every_step`: the same run with `steps=range(steps)` as well, every step in the store.
By default `report` analyses the steps that matter (the first alarm's, the spike's; report/run.py
`steps_that_matter`), so its cost should not grow with the steps stored. Each case runs `--repeats` times, in
turn, as a fresh `python -m fa_forensics report DUMP --out DIR` process. Reported: the median wall and CPU seconds
(user + sys of the report process, from `getrusage`), their ratio, the seconds of each section (the report's own
table) and the load average.

    python benchmarks/report_speed.py [--steps 100] [--repeats 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"alarm_steps_only": False, "every_step": True}  # case -> every step recorded in full


def make_dump(out: Path, steps: int, all_steps: bool) -> Path:
    """Train the output-logit-divergence run under the monitor (every step recorded too when `all_steps`)."""
    import torch

    import fa_forensics
    from tests.helpers.unstable_training import UNSTABLE, train

    torch.set_num_threads(1)
    spec = replace(next(s for s in UNSTABLE if s.name == "output-logit-divergence"), steps=steps)
    train(spec, around=lambda model: fa_forensics.capture(
        model, out=out, steps=range(steps) if all_steps else None, batch=None, monitor_every=1, alarm=True,
        alarm_steps=3, ring=4, overwrite=True), stop_after_divergence=10)
    return out


def run_report(dump: Path, out: Path) -> dict:
    """One report process: wall and CPU seconds, and the seconds of each section from its table."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fa_forensics", "report", str(dump), "--out", str(out)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"report failed on {dump}: {done.stderr[-2000:]}")
    sections = {m.group(1): float(m.group(2)) for m in re.finditer(r"│ (\S+)\s+│ \d: [^│]*│ ([\d.]+)\s+│", done.stdout)}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "sections": sections}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fa-report-speed-") as tmp:
        tmp = Path(tmp)
        dumps = {case: make_dump(tmp / f"{case}.zarr", args.steps, every) for case, every in CASES.items()}
        runs: dict[str, list[dict]] = {case: [] for case in CASES}
        for r in range(args.repeats):
            for case in (list(CASES) if r % 2 == 0 else list(CASES)[::-1]):  # alternate which runs first
                runs[case].append(run_report(dumps[case], tmp / f"{case}_{r}"))
    med = {case: {k: statistics.median(run[k] for run in rs) for k in ("wall", "cpu")} for case, rs in runs.items()}
    result = {"run": f"output-logit-divergence, {args.steps} steps", "repeats": args.repeats, "median_seconds": med,
              "cpu_ratio_every_step_over_alarm_steps": med["every_step"]["cpu"] / med["alarm_steps_only"]["cpu"],
              "wall_ratio_every_step_over_alarm_steps": med["every_step"]["wall"] / med["alarm_steps_only"]["wall"],
              "sections": {case: {name: statistics.median(run["sections"].get(name, float("nan")) for run in rs)
                                  for name in rs[0]["sections"]} for case, rs in runs.items()},
              "load_average_before": list(load_before),
              "load_average_after": list(os.getloadavg())}
    print(f"{'case':<26}{'wall s':>9}{'CPU s':>9}")
    for case, m in med.items():
        print(f"{case:<26}{m['wall']:>9.1f}{m['cpu']:>9.1f}")
    print(f"every step / alarm steps only: CPU {result['cpu_ratio_every_step_over_alarm_steps']:.3f}, "
          f"wall {result['wall_ratio_every_step_over_alarm_steps']:.3f}")
    print("section seconds (median):", json.dumps(result["sections"]))
    print(f"load average (1 min) before {load_before[0]:.2f}, after {result['load_average_after'][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
