"""Bit-identity of two versions of the CPU emulator: replay a fixed corpus, write a digest per output.

Run it under each checkout (PYTHONPATH=CHECKOUT picks the package), then compare the two files:

    PYTHONPATH=/path/to/old python benchmarks/emulator_corpus.py --out old.json
    python benchmarks/emulator_corpus.py --out new.json
    python benchmarks/emulator_corpus.py --compare old.json new.json

The corpus is the golden corpus of fa_forensics/replay/corpus.py (`full_cases`), read from this script's
checkout whatever package PYTHONPATH picks, so both runs replay the same cases: every preset × both
accumulation models × causal or not × no mask, a bool mask and an additive mask (with rows that see no
key) × two inputs (B 1, H 2, T 80, D 16 with tied scores; B 2, H 3, T 130, D 32), forward and backward;
and GPT-2-size rows (B 1, H 2, T 1024, D 64, causal) for three presets × both models, in one pass and in row
blocks of 96. Per replay: a sha256 prefix of O, lse, δ, dQ, dK, dV and the P̄ statistics. Digests are
comparable on one machine (the bits of a replay may depend on the host's float64 sum order, see
docs/replay.md, "Numerics contract of the emulator"). The engines of one version are compared with each
other by tests/unit/replay/test_engines_golden.py on the small corpus.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import sys
from pathlib import Path

CORPUS_FILE = Path(__file__).resolve().parent.parent / "fa_forensics" / "replay" / "corpus.py"
_FIELDS = ("o", "lse", "delta", "dq", "dk", "dv")
_STATS = ("repeated_max_rows", "p_one_count", "stabilized_rows", "p_zeroed")


def _corpus():
    """This checkout's corpus definition, importing whichever fa_forensics is on the path."""
    spec = importlib.util.spec_from_file_location("emulator_golden_corpus", CORPUS_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _digest(x) -> str | None:
    return None if x is None else hashlib.sha256(x.detach().contiguous().float().numpy().tobytes()).hexdigest()[:16]


def _record(r, with_stats: bool = True) -> list:
    row = [_digest(getattr(r, f)) for f in _FIELDS]
    if with_stats:
        row += [getattr(r.stats, f).tolist() for f in _STATS]
    return row


def run_corpus() -> dict:
    from fa_forensics.errors import ConfigError
    from fa_forensics.replay import ReplayConfig, replay
    from fa_forensics.replay.emulate.run import StreamPlan, emulate_replay

    corpus = _corpus()
    out = {}
    for case in corpus.full_cases():
        q, k, v, do = case.inputs.tensors()
        try:
            out[case.key] = _record(replay(q, k, v, case.config(), do=do, causal=case.causal,
                                           mask=case.inputs.mask(case.mask)))
        except ConfigError as exc:  # a GPU kernel's model refuses what that kernel does not do
            out[case.key] = f"refused: {exc}"
    q, k, v, do = corpus.Inputs(7, 1, 2, 1024, 64, False).tensors()
    for name, acc in itertools.product(("bf16", "bf16-autocast-train", "fp8-s448"), ("ieee", "tensor-core")):
        cfg = ReplayConfig.preset(name).with_(accumulation=acc)
        out[f"gpt2/{name}/{acc}"] = _record(replay(q, k, v, cfg, do=do, causal=True))
        rows = emulate_replay(q, k, v, cfg, do, causal=True, scale=0.125, plan=StreamPlan(heads=1, block_m=96))
        out[f"gpt2-rows/{name}/{acc}"] = _record(rows, with_stats=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the corpus digests here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digest files")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        common = a.keys() & b.keys()
        differ = sorted(k for k in common if a[k] != b[k])
        only = sorted(a.keys() ^ b.keys())
        print(f"{len(a)} / {len(b)} replays, {len(common)} in both; {len(differ)} of those differ"
              + (": " + ", ".join(differ[:20]) if differ else "")
              + (f"; {len(only)} in one file only (presets the other version lacks)" if only else ""))
        sys.exit(1 if differ else 0)
    if not args.out:
        ap.error("give --out FILE or --compare A B")
    digests = run_corpus()
    with open(args.out, "w") as f:
        json.dump(digests, f, indent=0)
    print(f"{len(digests)} replays -> {args.out}")


if __name__ == "__main__":
    main()
