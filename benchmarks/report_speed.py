"""`report` on a monitored run: wall and CPU seconds, per section, side by side with the figures' old first draw.

The dump is what the monitor writes on an unstable run: a tiny GPT-style byte decoder
(tests/helpers/unstable_training.py, output-logit divergence: its loss spikes at step 48) trained `--steps` steps
inside `fa_forensics.capture(monitor_every=1, alarm=True, ring=4, alarm_steps=3)` (the library form of
`capture --monitor-every 1 --alarm --ring 4`); `--dump DIR` reports on an existing one instead. With
`--all-steps` every step is also recorded in full (`steps=range(steps)`), the case of a monitored run that
captured steps as well: the report still analyses only the steps that matter.

Two cases, run in turn `--repeats` times, each a fresh `python -m fa_forensics report DUMP --out DIR` process:
- `full_first_draw`: `save_figure` lays each figure out with a full draw of its canvas (pixels included) before
  it fits the titles and the caption, then draws the PNG again (the way figures were saved before);
- `layout_only_first_draw`: the first pass lays out without drawing pixels (`Figure.draw_without_rendering`);
  the PNG is drawn once.
Reported: the median wall and CPU seconds (user + sys of the report process, from `getrusage`) of each case, their
ratio, the seconds of each section (the report's own table), the load average, and whether the two cases wrote
the same JSON and the same PNG bytes (they must).

    python benchmarks/report_speed.py [--steps 100] [--all-steps] [--dump DIR] [--repeats 3] [--json FILE]
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

# A report process whose figures get a full first draw: `draw_without_rendering` made to draw the canvas.
FULL_FIRST_DRAW = ("import runpy, matplotlib.figure as f; "
                   "f.Figure.draw_without_rendering = lambda self: self.canvas.draw(); "
                   "runpy.run_module('fa_forensics', run_name='__main__')")
CASES = {"full_first_draw": ["-c", FULL_FIRST_DRAW], "layout_only_first_draw": ["-m", "fa_forensics"]}


def make_dump(out: Path, steps: int, all_steps: bool) -> Path:
    """Train the output-logit-divergence run under the monitor (with every step recorded when `all_steps`)."""
    import torch

    import fa_forensics
    from tests.helpers.unstable_training import UNSTABLE, train

    torch.set_num_threads(1)
    spec = replace(next(s for s in UNSTABLE if s.name == "output-logit-divergence"), steps=steps)
    train(spec, around=lambda model: fa_forensics.capture(
        model, out=out, steps=range(steps) if all_steps else None, batch=None, monitor_every=1, alarm=True,
        alarm_steps=3, ring=4, overwrite=True), stop_after_divergence=10)
    return out


def run_report(case: str, dump: Path, out: Path) -> dict:
    """One report process: wall and CPU seconds, and the seconds of each section from its table."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *CASES[case], "report", str(dump), "--out", str(out)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"report failed ({case}): {done.stderr[-2000:]}")
    sections = {m.group(1): float(m.group(2)) for m in re.finditer(r"│ (\S+)\s+│ \d: [^│]*│ ([\d.]+)\s+│", done.stdout)}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "sections": sections}


def same_output(a: Path, b: Path) -> dict:
    """Whether two report folders hold the same JSON (their own folder's name aside) and the same PNG bytes."""
    def files(root: Path, ext: str) -> dict:
        return {p.relative_to(root): p for p in sorted(root.rglob(f"*.{ext}"))}

    ja, jb = files(a, "json"), files(b, "json")
    pa, pb = files(a, "png"), files(b, "png")
    json_same = ja.keys() == jb.keys() and all(
        ja[k].read_text().replace(str(a), "OUT") == jb[k].read_text().replace(str(b), "OUT") for k in ja)
    png_same = pa.keys() == pb.keys() and all(pa[k].read_bytes() == pb[k].read_bytes() for k in pa)
    return {"json_files": len(ja), "json_identical": json_same, "png_files": len(pa), "png_identical": png_same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--all-steps", action="store_true", help="also record every step in full")
    parser.add_argument("--dump", type=Path, default=None, help="report on this dump instead of training one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fa-report-speed-") as tmp:
        tmp = Path(tmp)
        dump = args.dump or make_dump(tmp / "run.zarr", args.steps, args.all_steps)
        runs: dict[str, list[dict]] = {case: [] for case in CASES}
        for r in range(args.repeats):
            for case in (list(CASES) if r % 2 == 0 else list(CASES)[::-1]):  # alternate which runs first
                runs[case].append(run_report(case, dump, tmp / f"{case}_{r}"))
        same = same_output(tmp / f"{list(CASES)[0]}_0", tmp / f"{list(CASES)[1]}_0")
    med = {case: {k: statistics.median(run[k] for run in rs) for k in ("wall", "cpu")} for case, rs in runs.items()}
    result = {"dump": str(args.dump) if args.dump else f"output-logit-divergence, {args.steps} steps"
              + (", every step recorded" if args.all_steps else ""),
              "repeats": args.repeats, "median_seconds": med,
              "cpu_ratio": med["layout_only_first_draw"]["cpu"] / med["full_first_draw"]["cpu"],
              "wall_ratio": med["layout_only_first_draw"]["wall"] / med["full_first_draw"]["wall"],
              "sections": {case: {name: statistics.median(run["sections"].get(name, float("nan")) for run in rs)
                                  for name in rs[0]["sections"]} for case, rs in runs.items()},
              "same_output": same, "load_average_before": list(load_before),
              "load_average_after": list(os.getloadavg())}
    print(f"{'case':<26}{'wall s':>9}{'CPU s':>9}")
    for case, m in med.items():
        print(f"{case:<26}{m['wall']:>9.1f}{m['cpu']:>9.1f}")
    print(f"CPU ratio {result['cpu_ratio']:.3f}, wall ratio {result['wall_ratio']:.3f}; same output: {same}")
    print("section seconds (median):", json.dumps(result["sections"]))
    print(f"load average (1 min) before {load_before[0]:.2f}, after {result['load_average_after'][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
