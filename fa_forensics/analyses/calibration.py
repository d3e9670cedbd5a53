"""Families of null dumps and the alarms the analyses raise on them: how the statistics policy is checked.

A null dump is a planted dump (`fa_forensics.planted`) without a bias: the planted feature of V takes either sign
at random (v_skew = 0.5), and either every row's maximum is attained once (ties = 1, `NULL_SHAPES`: no two P̄ = 1
terms can carry into a tie) or twice (`TIED_NULL_SHAPES`: each tie group errs one way, its sign drawn at random, so
nothing holds across groups or steps); the other heads are plain N(0, 1) or have sinks. Nothing in it is
biased, so every claim an analysis makes on it is a false alarm. `alarms` runs the analyses as the report does
(the recipe "auto", every option at its default) and says, per analysis, whether its verdict claims something: a
bias claim found (`bias.found`), fix-check's exit code 1, a pcast head that needs a fix; `report` is any of them
(the report's headline). The policy promises a rate of at most α = 0.01 for each analysis and for the report (one
family for all). tests/unit/analyses/test_calibration.py runs a small family; benchmarks/false_alarms.py a large one.
"""
from __future__ import annotations

from pathlib import Path

from fa_forensics.planted import SynthSpec

# small shapes, alternated by seed: (T, heads, D, batch, steps); any other SynthSpec field may be set too
NULL_SHAPES: tuple[dict, ...] = (
    {"seq": 64, "heads": 2, "head_dim": 16, "batch": 1, "steps": 2},
    {"seq": 48, "heads": 3, "head_dim": 16, "batch": 2, "steps": 1},
)
# null families with the structure of real attention: tie groups whose V signs are drawn at random (each group errs
# one way, no sign holds across groups or steps), sinks in the other heads, several planted heads and batch rows,
# T from 64 to 2048
TIED_NULL_SHAPES: tuple[dict, ...] = (
    {"seq": 64, "heads": 3, "head_dim": 16, "batch": 2, "steps": 2, "ties": 2, "sink_strength": 6.0},
    {"seq": 256, "heads": 4, "head_dim": 32, "batch": 2, "steps": 2, "ties": 2, "planted_heads": (1, 2)},
    {"seq": 512, "heads": 2, "head_dim": 32, "batch": 2, "steps": 2, "ties": 2, "sink_strength": 6.0},
    {"seq": 2048, "heads": 2, "head_dim": 16, "batch": 1, "steps": 1, "ties": 2},
)
CLAIMING = ("isolate", "delta-bias", "rank1-sim", "pv-trace", "bitdiff", "fix-check", "pcast")


def null_spec(seed: int, shapes: tuple[dict, ...] = NULL_SHAPES, v_skew: float = 0.5) -> SynthSpec:
    """The null dump of one seed: shape `seed mod len(shapes)`, by default one maximum per row; V signs at random
    (`v_skew` 1: the planted dump of the same shape, one-signed, for the power)."""
    return SynthSpec(**{"ties": 1, "planted_heads": (1,), **shapes[seed % len(shapes)], "v_skew": v_skew,
                        "seed": seed})


def make_null(path: Path, seed: int, shapes: tuple[dict, ...] = NULL_SHAPES, v_skew: float = 0.5) -> Path:
    """Write the null dump of `seed` to `path` (kept if it is already there)."""
    from fa_forensics.planted import synth

    path = Path(path)
    if not path.exists():
        synth(path, null_spec(seed, shapes, v_skew))
    return path


def alarms(path: Path, analyses: tuple[str, ...] = CLAIMING) -> dict[str, bool]:
    """{analysis: its verdict claims something} on the dump at `path`, each run as the report runs it, and
    {"report": any of them}; fix-check also gives "fix-check exit 1"."""
    from fa_forensics.analyses.jsonable import to_jsonable
    from fa_forensics.analyses.registry import BY_NAME
    from fa_forensics.dump import open_dump
    from fa_forensics.enums import Backend
    from fa_forensics.fidelity.recipe import Recipe
    from fa_forensics.layers.fanout import Workers
    from fa_forensics.layers.selection import select

    dump = open_dump(path)
    out: dict[str, bool] = {}
    for name in analyses:
        analysis = BY_NAME[name]
        whole = analysis.section.whole_dump
        sels = select(dump, dump.steps[-1]) if whole else select(dump)
        payload = to_jsonable(analysis.payload(analysis.report_run(dump, sels, Recipe(), Backend.EMULATE, Workers())))
        if name == "pcast":
            out[name] = any(h.get("needs_fix") for h in payload.get("heads") or [])
        else:  # rank1-sim, a follow-on analysis, carries the Σδ claim it studies as `claim`
            out[name] = bool((payload.get("bias") or payload.get("claim") or {}).get("found"))
        if name == "fix-check":
            out["fix-check exit 1"] = payload["exit_code"] == 1
    out["report"] = any(out.values())
    return out
