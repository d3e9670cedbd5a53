"""The false-alarm rate of every analysis's verdict and exit code on a family of null dumps, with its 95 % interval,
and the power on planted families.

A null dump has no bias (`fa_forensics.analyses.calibration`): V signs at random, with one maximum per row
(`--family null`, shapes `NULL_SHAPES`) or tie groups whose signs are drawn at random, sinks, several planted heads
and batch rows, T 64 to 2048 (`--family tied-null`, shapes `TIED_NULL_SHAPES`); every claim on it is false. A
planted family (`--family planted`) is the tied family with the planted V feature one-signed (v_skew 1): the rate
is then the power. Each analysis runs as the report runs it; a claim is a bias found, fix-check's
exit code 1 or a pcast head that needs a fix; "report" is any of them (the report's headline). The statistics
policy (`analyses.significance`) promises at most α = 0.01 for each. Prints one row per analysis: false alarms,
dumps, the rate and its Clopper-Pearson 95 % interval; with --json FILE also writes them.

    python benchmarks/false_alarms.py [--seeds 200] [--first 0] [--family null|tied-null|planted]
                                      [--analyses LIST] [--shape T,H,D,B,S ...] [--keep DIR] [--json FILE]

--analyses runs some of them only (comma list): bitdiff, pv-trace and fix-check decide their claims on the same O
cells, isolate, delta-bias and rank1-sim on the same Σδ items, so a large family of the cheapest of each
(bitdiff,delta-bias) measures the rate of all. --shape (repeatable) replaces the family's shapes (`NULL_SHAPES`):
sequence length T, heads H, head dim D, batch rows B, steps S; the seeds alternate over them.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    from scipy.stats import binomtest

    from fa_forensics.analyses.calibration import CLAIMING, NULL_SHAPES, TIED_NULL_SHAPES, alarms, make_null
    from fa_forensics.analyses.significance import ALPHA

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--analyses", type=str, default=",".join(CLAIMING))
    ap.add_argument("--family", choices=("null", "tied-null", "planted"), default="null")
    ap.add_argument("--shape", action="append", default=None, metavar="T,H,D,B,S",
                    help="a shape of the family (repeatable; default: NULL_SHAPES)")
    ap.add_argument("--keep", type=Path, default=None, help="folder for the null dumps (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="null-family-"))
    root.mkdir(parents=True, exist_ok=True)
    chosen = tuple(a.strip() for a in args.analyses.split(",") if a.strip())
    base = NULL_SHAPES if args.family == "null" else TIED_NULL_SHAPES
    shapes = base if not args.shape else tuple(
        dict(zip(("seq", "heads", "head_dim", "batch", "steps"), (int(x) for x in text.split(",")), strict=True))
        for text in args.shape)
    v_skew = 1.0 if args.family == "planted" else 0.5
    counts: dict[str, int] = {}
    t0 = time.process_time()
    seeds = range(args.first, args.first + args.seeds)
    for i, seed in enumerate(seeds):
        path = make_null(root / f"{args.family}{seed}.zarr", seed, shapes, v_skew=v_skew)
        for name, alarm in alarms(path, chosen).items():
            counts[name] = counts.get(name, 0) + int(alarm)
        if (i + 1) % 10 == 0:
            print(f"{i + 1} dumps, {time.process_time() - t0:.0f} CPU s", flush=True)
    n = len(seeds)
    rows = []
    print(f"\n{args.family} family: {n} dumps (seeds {seeds.start}..{seeds.stop - 1}), shapes {list(shapes)}; "
          f"α = {ALPHA}")
    print(f"{'analysis':<18} {'alarms':>6} {'dumps':>6} {'rate':>7}   95 % interval")
    for name in (*chosen, *(["fix-check exit 1"] if "fix-check" in chosen else []), "report"):
        k = counts.get(name, 0)
        ci = binomtest(k, n).proportion_ci(0.95, method="exact")
        rows.append({"analysis": name, "alarms": k, "dumps": n, "rate": k / n, "ci_low": ci.low, "ci_high": ci.high})
        print(f"{name:<18} {k:>6} {n:>6} {k / n:>7.2%}   [{ci.low:.2%}, {ci.high:.2%}]")
    print(f"{time.process_time() - t0:.0f} CPU s")
    if args.json:
        listed = [{k: list(v) if isinstance(v, tuple) else v for k, v in sh.items()} for sh in shapes]
        args.json.write_text(json.dumps({"alpha": ALPHA, "family": args.family, "shapes": listed, "rows": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
