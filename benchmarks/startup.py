"""How fast the CLI starts: wall time of `python -m fa_forensics ARGS` against `python -c pass` and against
`python -c "import torch"`, measured side by side in one run (fresh interpreters, median of --repeat runs after
one warm-up run each, so the files are in the page cache: the "warm" start).

  pass         the interpreter alone
  torch        `import torch` alone (what every command paid before the app was built from light modules)
  --help       the app's help
  info --help  one command's help
  info DUMP    info of sample_dumps/demo.zarr (reads the dump's metadata with zarr)

Printed: seconds and the ratio to `pass` for each.

    python benchmarks/startup.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "pass": ["-c", "pass"],
    "torch": ["-c", "import torch"],
    "--help": ["-m", "fa_forensics", "--help"],
    "info --help": ["-m", "fa_forensics", "info", "--help"],
    "info DUMP": ["-m", "fa_forensics", "info", str(REPO / "sample_dumps" / "demo.zarr")],
}


def seconds(args: list[str]) -> float:
    """Wall time of one fresh interpreter running `args` (its output discarded)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    repeat = parser.parse_args().repeat
    for args in CASES.values():  # warm-up: the page cache holds every file each case reads
        seconds(args)
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(repeat):  # interleaved, so that load on the machine falls on every case alike
        for name, args in CASES.items():
            times[name].append(seconds(args))
    base = statistics.median(times["pass"])
    print(f"{'case':<12} {'median s':>9} {'× pass':>7}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<12} {median:9.3f} {median / base:7.1f}")


if __name__ == "__main__":
    main()
