"""Scale of the CPU emulator and of the analyses: time and peak RSS against T and H, side by side in one run.

Every measurement runs in a fresh Python process, so its peak RSS (ru_maxrss) is its own.

  replay    forward + backward, B 1, causal, bf16 inputs: the emulator (`replay(..., do=do)`,
            preset bf16, ieee unless --acc) against torch's fp32 scaled_dot_product_attention
            forward + backward on the same inputs (the fp32 reference a GPU-less user has), for
            every T in --T and H in --H. Arithmetic of one pass: 7 products of B·H·T²·D
            multiply-adds for the emulator (QKᵀ, P̄V; QKᵀ again, dO Vᵀ, dQ, dK, dV), 4-5 for
            SDPA (whose kernel skips the masked half). Prints wall and CPU seconds, the ratio
            emulator / SDPA, peak RSS, and the growth law fitted over T (time ∝ T^a).
  analysis  `fa-forensics delta-bias` on a synthetic dump (`fa-forensics synth`, B 1, one step,
            one layer) under /usr/bin/time -v, per (H, T) in --shapes, with every --workers N.

    python benchmarks/scale.py replay [--T 1024 2048 4096 8192] [--H 1 12] [--D 64] [--acc ieee] [--repeats 5]
    python benchmarks/scale.py analysis [--shapes 16x4096 32x8192:128] [--workers 1 2] [--preset auto]
            (auto, the default, matches the dump's stored O first: one forward replay per candidate
            recipe tried, then cached in the dump; a named preset measures the analysis alone)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _measure_replay(kind: str, H: int, T: int, D: int, acc: str, repeats: int) -> dict:
    """Forward + backward of `kind` (emulator | sdpa) in this process, after a warm-up: the median
    seconds of `repeats` runs, and peak RSS."""
    import torch

    from fa_forensics.replay import ReplayConfig, replay

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, H, T, D, generator=g).to(torch.bfloat16) for _ in range(4))
    if kind == "emulator":
        cfg = ReplayConfig.preset("bf16").with_(accumulation=acc)
        replay(q[:, :1, :64], k[:, :1, :64], v[:, :1, :64], cfg, do=do[:, :1, :64])  # load the compiled kernels

        def run():
            replay(q, k, v, cfg, do=do)
    else:
        def run():
            qq, kk, vv = (x.float().requires_grad_() for x in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            o.backward(do.float())
        run()  # warm-up
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads()}


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "_one", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _growth(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(y) against log(T)."""
    if len(points) < 2:
        return math.nan
    xs, ys = [math.log(t) for t, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def replay_table(Ts: list[int], Hs: list[int], D: int, acc: str, repeats: int) -> None:
    print(f"B 1, D {D}, causal, bf16 inputs, preset bf16 : {acc}; median of {repeats} runs; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'H':>3} {'T':>5} | {'SDPA wall':>9} {'cpu':>6} {'RSS MB':>7} | {'emulator wall':>13} {'cpu':>6} "
          f"{'RSS MB':>7} | {'ratio wall':>10} {'cpu':>5}")
    for H in Hs:
        times = []
        for T in Ts:
            ref = _child(["replay", "sdpa", str(H), str(T), str(D), acc, str(repeats)])
            emu = _child(["replay", "emulator", str(H), str(T), str(D), acc, str(repeats)])
            times.append((T, emu["cpu_s"]))
            print(f"{H:>3} {T:>5} | {ref['wall_s']:>9.2f} {ref['cpu_s']:>6.2f} {ref['peak_rss_mb']:>7.0f} | "
                  f"{emu['wall_s']:>13.2f} {emu['cpu_s']:>6.2f} {emu['peak_rss_mb']:>7.0f} | "
                  f"{emu['wall_s'] / ref['wall_s']:>10.1f} {emu['cpu_s'] / ref['cpu_s']:>5.1f}", flush=True)
        print(f"    H {H}: emulator CPU time grows as T^{_growth(times):.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


_TIME_V = {"wall": re.compile(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)"),
           "rss": re.compile(r"Maximum resident set size \(kbytes\): (\d+)")}


def _timed_cli(argv: list[str]) -> tuple[float, float, str]:
    """Run a CLI command under /usr/bin/time -v: (wall seconds, peak RSS MB, stdout)."""
    out = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr[-2000:]}")
    h, m, s = _TIME_V["wall"].search(out.stderr).groups()
    wall = int(h or 0) * 3600 + int(m) * 60 + float(s)
    rss = int(_TIME_V["rss"].search(out.stderr).group(1)) / 1024
    return wall, rss, out.stdout


def analysis_table(shapes: list[str], workers: list[int], preset: str = "auto") -> None:
    cli = [str(Path(sys.executable).with_name("fa-forensics"))]
    print(f"delta-bias --preset {preset} on one synthetic layer-step (B 1, planted head 1); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'H':>3} {'T':>5} {'D':>4} {'workers':>7} | {'wall s':>8} {'peak RSS MB':>11} | same numbers")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            hxt, _, d = shape.partition(":")
            H, T = (int(x) for x in hxt.split("x"))
            D = int(d or 64)
            dump = Path(tmp) / f"h{H}t{T}d{D}.zarr"
            subprocess.run([*cli, "synth", "--out", str(dump), "--seq", str(T), "--heads", str(H), "--head-dim", str(D),
                            "--batch", "1", "--steps", "1", "--layers", "1"], check=True, capture_output=True)
            first = None
            for n in workers:
                js = Path(tmp) / f"db_{H}_{T}_{n}.json"
                extra = ["--workers", str(n)] if n != 1 else []
                wall, rss, _ = _timed_cli([*cli, "delta-bias", str(dump), "--json", str(js), "--preset", preset,
                                           *extra])
                cells = [c["delta_err_sum"] for c in json.loads(js.read_text())["per_step"]] if js.exists() else []
                same = "—" if first is None else ("yes" if cells == first else "NO")
                first = cells if first is None else first
                print(f"{H:>3} {T:>5} {D:>4} {n:>7} | {wall:>8.1f} {rss:>11.0f} | {same}", flush=True)
            dump_size = sum(f.stat().st_size for f in dump.rglob("*") if f.is_file())
            print(f"    dump on disk: {dump_size / 2**20:.0f} MiB")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        _, _, what, kind, H, T, D, acc, repeats = sys.argv
        print(json.dumps(_measure_replay(kind, int(H), int(T), int(D), acc, int(repeats))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("replay")
    r.add_argument("--T", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    r.add_argument("--H", type=int, nargs="+", default=[1, 12])
    r.add_argument("--D", type=int, default=64)
    r.add_argument("--acc", default="ieee")
    r.add_argument("--repeats", type=int, default=5, help="runs per measurement (the median is shown)")
    a = sub.add_parser("analysis")
    a.add_argument("--shapes", nargs="+", default=["16x4096"], help="HxT or HxT:D")
    a.add_argument("--workers", type=int, nargs="+", default=[1])
    a.add_argument("--preset", default="auto")
    args = ap.parse_args()
    if args.mode == "replay":
        replay_table(args.T, args.H, args.D, args.acc, args.repeats)
    else:
        analysis_table(args.shapes, args.workers, args.preset)


if __name__ == "__main__":
    main()
