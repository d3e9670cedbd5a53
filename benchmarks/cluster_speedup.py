"""Speed-up of the analyses on 2 Dask workers, side by side in one run: in-process, a local cluster of 2
(`--workers 2`, started by the command) and an existing cluster (`--scheduler`, a `dask scheduler` and two
single-threaded `dask worker` processes started before the runs, as on a real cluster). The first command on
fresh workers pays their imports and the compiled kernels' loading; it runs first, timed apart ("warm-up").

    python benchmarks/cluster_speedup.py [--shape 16x2048] [--steps 2] [--command delta-bias] [--repeats 2]

The dump is synthetic (`fa-forensics synth`, B 1, one layer, --steps steps; H heads make H/4 work items per
step). Each configuration runs --repeats times, interleaved (in-process, local, existing, in-process, ...), so
a change of the machine's load hits all three alike; the wall times, their medians, the ratios to the
in-process median and the load average (1 min) before each run are printed, and every run's JSON must be
the in-process JSON. CPU seconds: the command's process and its children (the local cluster's workers), plus
for the existing cluster its worker processes' (psutil, read before and after the run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fa_forensics.cli", *args]


def _start_cluster(where: Path, n_workers: int) -> tuple[str, list[subprocess.Popen]]:
    info = where / "scheduler.json"
    started = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                 "--port", "0", "--no-dashboard", "--scheduler-file", str(info)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    while not info.exists():
        time.sleep(0.2)
    address = json.loads(info.read_text())["address"]
    for i in range(n_workers):
        started.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads",
                                         "1", "--no-dashboard", "--name", f"w{i}"], cwd=where,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    from dask.distributed import Client

    with Client(address, timeout="60s") as client:
        client.wait_for_workers(n_workers, timeout=300)
    return address, started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="16x2048", help="HxT (D 64)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--command", default="delta-bias")
    ap.add_argument("--preset", default="bf16")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    H, T = (int(x) for x in args.shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        dump = where / "bench.zarr"
        subprocess.run(_cli("synth", "--out", str(dump), "--seq", str(T), "--heads", str(H), "--batch", "1",
                            "--steps", str(args.steps), "--layers", "1"), check=True, capture_output=True)
        address, started = _start_cluster(where, 2)
        configs = {"in-process": [], "local --workers 2": ["--workers", "2"], "existing --scheduler": ["--scheduler",
                                                                                                      address]}
        walls: dict[str, list[float]] = {name: [] for name in configs}
        cluster_processes = [psutil.Process(p.pid) for p in started[1:]]

        def cluster_cpu() -> float:
            total = 0.0
            for process in cluster_processes:
                for p in [process, *process.children(recursive=True)]:
                    times = p.cpu_times()
                    total += times.user + times.system
            return total

        reference = None
        try:
            js = where / "warm-up.json"
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            subprocess.run(_cli(args.command, str(dump), "--preset", args.preset, "--json", str(js), "--scheduler",
                                address), capture_output=True, text=True)
            print(f"warm-up existing --scheduler {time.perf_counter() - t0:7.1f} s wall  (load {load:.1f} before): "
                  "the first command on fresh workers", flush=True)
            for r in range(args.repeats):
                for name, extra in configs.items():
                    js = where / f"{r}-{name.split()[0]}.json"
                    load = os.getloadavg()[0]
                    before, workers_before = os.times(), cluster_cpu()
                    t0 = time.perf_counter()
                    done = subprocess.run(_cli(args.command, str(dump), "--preset", args.preset, "--json", str(js),
                                               *extra), capture_output=True, text=True)
                    wall = time.perf_counter() - t0
                    after = os.times()
                    cpu = (after.children_user + after.children_system - before.children_user
                           - before.children_system + cluster_cpu() - workers_before)
                    if done.returncode not in (0, 1):
                        raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
                    text = js.read_text()
                    reference = reference or text
                    same = "same JSON" if text == reference else "JSON DIFFERS"
                    walls[name].append(wall)
                    print(f"run {r + 1} {name:<22} {wall:7.1f} s wall {cpu:7.1f} s CPU  (load {load:.1f} before)  "
                          f"{same}", flush=True)
        finally:
            for process in reversed(started):
                process.terminate()
                process.wait(30)
    base = statistics.median(walls["in-process"])
    print(f"{args.command} --preset {args.preset}, H {H}, T {T}, D 64, {args.steps} steps "
          f"({args.steps * ((H + 3) // 4)} work items), {os.cpu_count()} CPUs:")
    for name, values in walls.items():
        median = statistics.median(values)
        print(f"  {name:<22} median {median:7.1f} s   speed-up {base / median:4.2f}x")


if __name__ == "__main__":
    main()
