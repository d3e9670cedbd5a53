"""The false-alarm rate of every claim the report makes (each section's, fix-check's exit code, the O and Σδ claims,
the card) on a family of null dumps, with its Clopper-Pearson 95 % interval, and the power on a planted family.

Families (`fa_forensics.analyses.calibration`): `null` (one maximum per row, V signs at random, `NULL_SHAPES`),
`tied-null` (tie groups of random sign, previous-token heads, sinks, several planted heads and batch rows, T 64 to
2048, `TIED_NULL_SHAPES`) and `planted` (the tied shapes with the planted V feature one-signed: the rate is then the
power). Each dump runs the report's sections as the report runs them and the report's own verdict is composed from
them (`report.calibration.alarms`), so whatever claims the sections and the diagnosis make are counted. The card counts
when the diagnosis names a cause other than FP8 P-collapse (the family's sink and previous-token heads really lose
mass to the E4M3 cast: counted apart, as is "cannot tell"); "pcast, plain heads" is pcast's claim on a plain head.

    python benchmarks/false_alarms.py [--family null|tied-null|planted] [--seeds 200] [--first 0]
                                      [--analyses LIST] [--shape T,H,D,B,S ...] [--keep DIR] [--json FILE]
    python benchmarks/false_alarms.py --merge A.json B.json ... [--json FILE]

--analyses runs some sections only (comma list; default: every section the report runs). The card's rounding
cause is decided by the rounding sections, and isolate and rank1-sim quote delta-bias's Σδ items, pv-trace
bitdiff's O cells, so `delta-bias,bitdiff,fix-check` measures the card's false alarms at a fraction of the cost;
the full set (pcast, isolate, pv-trace and rank1-sim replay much more) runs on a smaller family. --shape
(repeatable) replaces the family's shapes: T, heads H, head dim D, batch rows B, steps S; the seeds alternate over
them. --merge adds up the JSON files of runs on disjoint seeds of one family and one set of sections. Prints one
row per claim: false alarms (or detections), dumps, the rate and its 95 % interval.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def table(family: str, records: list[dict]) -> list[dict]:
    """One row per claim over the dumps' records ({seed, claims}): claims, dumps, rate, Clopper-Pearson 95 %."""
    from scipy.stats import binomtest

    names: list[str] = []
    for r in records:
        names += [k for k in r["claims"] if k not in names]
    rows = []
    for name in names:
        counted = [r["claims"][name] for r in records if name in r["claims"]]
        k, n = sum(counted), len(counted)
        ci = binomtest(k, n).proportion_ci(0.95, method="exact")
        rows.append({"claim": name, "alarms": k, "dumps": n, "rate": k / n, "ci_low": ci.low, "ci_high": ci.high})
    return rows


def show(family: str, analyses: str, rows: list[dict], seeds: list[int], seconds: float) -> None:
    from fa_forensics.report.calibration import NOT_FALSE
    from fa_forensics.analyses.significance import ALPHA

    what = "detections (power)" if family == "planted" else "false alarms"
    print(f"\n{family} family: {len(seeds)} dumps (seeds {min(seeds)}..{max(seeds)}); sections: {analyses}; "
          f"α = {ALPHA}; {seconds:.0f} s")
    print(f"{'claim':<22} {what:>20} {'dumps':>6} {'rate':>7}   95 % interval")
    for r in rows:
        note = "  (not a false alarm)" if family != "planted" and r["claim"] in NOT_FALSE else ""
        print(f"{r['claim']:<22} {r['alarms']:>20} {r['dumps']:>6} {r['rate']:>7.2%}   "
              f"[{r['ci_low']:.2%}, {r['ci_high']:.2%}]{note}")


def _shape(text: str) -> dict:
    """'128,2,32,8,4,ties=2' -> {"seq": 128, "heads": 2, "head_dim": 32, "batch": 8, "steps": 4, "ties": 2}."""
    parts = text.split(",")
    shape = dict(zip(("seq", "heads", "head_dim", "batch", "steps"), (int(x) for x in parts[:5]), strict=True))
    for item in parts[5:]:
        name, _, value = item.partition("=")
        shape[name.strip()] = float(value) if "." in value else int(value)
    return shape


def main() -> None:
    from fa_forensics.analyses.calibration import FAMILIES, family_shapes, make_null
    from fa_forensics.report.calibration import alarms

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, default="tied-null")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--analyses", type=str, default="", help="comma list of sections (default: all the report runs)")
    ap.add_argument("--shape", action="append", default=None, metavar="T,H,D,B,S[,FIELD=VALUE...]",
                    help="a shape of the family (repeatable; default: the family's); FIELD=VALUE sets any other "
                         "SynthSpec field, e.g. ties=2 (without it a shape has one maximum per row)")
    ap.add_argument("--keep", type=Path, default=None, help="folder to keep the dumps in (default: each is deleted)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, help="JSON files of runs to add up")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.merge:
        parts = [json.loads(p.read_text()) for p in args.merge]
        if len({(p["family"], p["analyses"]) for p in parts}) != 1:
            raise SystemExit("--merge: the files are of different families or sections; merge runs of one only")
        records = sorted((r for p in parts for r in p["records"]), key=lambda r: r["seed"])
        if len({r["seed"] for r in records}) != len(records):
            raise SystemExit("--merge: the files share seeds; merge runs on disjoint seeds only")
        family, analyses, shapes = parts[0]["family"], parts[0]["analyses"], parts[0]["shapes"]
        seconds = sum(p["seconds"] for p in parts)
    else:
        family = args.family
        chosen = tuple(a.strip() for a in args.analyses.split(",") if a.strip()) or None
        analyses = ",".join(chosen) if chosen else "all"
        shapes = family_shapes(family) if not args.shape else tuple(_shape(text) for text in args.shape)
        root = args.keep or Path(tempfile.mkdtemp(prefix="null-family-"))
        root.mkdir(parents=True, exist_ok=True)
        v_skew = 1.0 if family == "planted" else 0.5
        records = []
        t0 = time.perf_counter()
        for i, seed in enumerate(range(args.first, args.first + args.seeds)):
            path = make_null(root / f"{family}{seed}.zarr", seed, shapes, v_skew=v_skew)
            records.append({"seed": seed, "claims": alarms(path, chosen)})
            if args.keep is None:
                shutil.rmtree(path)
            if (i + 1) % 10 == 0:
                print(f"{i + 1} dumps, {time.perf_counter() - t0:.0f} s", flush=True)
                if args.json:  # partial results survive an interrupted run
                    _write(args.json, family, analyses, shapes, records, time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    rows = table(family, records)
    show(family, analyses, rows, [r["seed"] for r in records], seconds)
    if args.json:
        _write(args.json, family, analyses, shapes, records, seconds, rows)


def _write(path: Path, family: str, analyses: str, shapes, records: list[dict], seconds: float,
           rows: list[dict] | None = None) -> None:
    from fa_forensics.analyses.significance import ALPHA

    listed = [{k: list(v) if isinstance(v, tuple) else v for k, v in sh.items()} for sh in shapes]
    path.write_text(json.dumps({"alpha": ALPHA, "family": family, "analyses": analyses, "shapes": listed,
                                "seconds": seconds, "rows": rows if rows is not None else table(family, records),
                                "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
