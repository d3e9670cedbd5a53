"""What re-checking a kept match costs: the best recipe replayed on every element (what `match`, `--preset auto` and
`verify` do before they use or show a kept match) against the same recipe replayed on the layer's row sample only,
and against a fresh search (`fidelity.search.match_layer`), side by side in one process.

For each shape, one layer-step (causal, bf16 inputs ~ N(0, 1), O written by preset bf16) is replayed, after one
warm-up of each, --repeats times each, alternating; the median wall seconds and the ratios are printed.

    python benchmarks/recheck_cost.py [--shapes 2x4x256x64 4x12x1024x64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time


def _layer(B: int, H: int, T: int, D: int):
    import torch

    from fa_forensics.layers.selection import LayerTensors
    from fa_forensics.replay import ReplayConfig, replay

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(3))
    o = replay(q, k, v, ReplayConfig.preset("bf16"), causal=True, scale=D ** -0.5).o
    return LayerTensors(step=0, layer=0, heads=list(range(H)), q=q, k=k, v=v, o=o, do=None, x=None, scale=D ** -0.5,
                        causal=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["2x4x256x64", "4x12x1024x64"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from fa_forensics.fidelity.candidates import layer_candidates
    from fa_forensics.fidelity.layer_match import CandidateRecipe
    from fa_forensics.fidelity.run_facts import UNKNOWN
    from fa_forensics.fidelity.sample import replay_rows, row_sample
    from fa_forensics.fidelity.search import match_layer
    from fa_forensics.layers.selection import replay_layer

    config = CandidateRecipe("bf16", "ieee").config()
    print("| shape (B×H×T×D) | sample re-check | full re-check | fresh search | full / sample | full / search |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        B, H, T, D = (int(x) for x in shape.split("x"))
        t = _layer(B, H, T, D)
        recipes = layer_candidates(t, UNKNOWN).recipes
        runs = {
            "sample": lambda: replay_rows(t, config, row_sample(T)),
            "full": lambda: replay_layer(t, config, backward=False).o,
            "search": lambda: match_layer(t, recipes),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():  # warm-up: numba's compiled kernels loaded once
            run()
        for _ in range(args.repeats):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) for name, v in times.items()}
        rows = row_sample(T).rows
        print(f"| {shape} | {med['sample']:.2f} s ({rows} of {T} rows) | {med['full']:.2f} s | {med['search']:.2f} s "
              f"| {med['full'] / med['sample']:.1f} | {med['full'] / med['search']:.2f} |")


if __name__ == "__main__":
    main()
