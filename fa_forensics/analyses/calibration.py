"""Families of null dumps: how the statistics policy is checked.

A null dump is a planted dump (`fa_forensics.planted`) without a bias: the planted feature of V takes either sign
at random (v_skew = 0.5), and either every row's maximum is attained once (ties = 1, `NULL_SHAPES`: no two P̄ = 1
terms can carry into a tie) or more than once (`TIED_NULL_SHAPES`: each tie group errs one way, its sign drawn at
random, so nothing holds across groups or steps), beside previous-token heads (every query attends mostly to the
key before it, so each row's dominant key is a different one), sinks and plain N(0, 1) heads, T 64 to 2048.
Nothing in it is biased, so every rounding claim on it is a false alarm. The planted family of the same shapes
(v_skew 1: one-signed) measures the power.

`report.calibration.alarms` runs the report's sections on such a dump and counts the claims the report makes
(each section's, fix-check's exit code, the card); tests/unit/analyses/test_calibration.py runs a small family,
benchmarks/false_alarms.py a large one.
"""
from __future__ import annotations

from pathlib import Path

from fa_forensics.planted import SynthSpec

# small shapes, alternated by seed: (T, heads, D, batch, steps); any other SynthSpec field may be set too
NULL_SHAPES: tuple[dict, ...] = (
    {"seq": 64, "heads": 2, "head_dim": 16, "batch": 1, "steps": 2},
    {"seq": 48, "heads": 3, "head_dim": 16, "batch": 2, "steps": 1},
)
# null families with the structure of real attention, alternated by seed: tie groups whose V signs are drawn at
# random (each group errs one way, no sign holds across groups or steps; 2 to 8 groups, 2 or 3 tied keys),
# previous-token heads, sinks in the other heads, several planted heads and batch rows; T from 64 to 2048, mostly
# short (a long dump costs as much as several short ones), the long ones one in eight seeds each
TIED_NULL_SHAPES: tuple[dict, ...] = (
    {"seq": 64, "heads": 3, "head_dim": 32, "batch": 2, "steps": 2, "ties": 2, "sink_strength": 6.0,
     "previous_token_heads": (2,)},
    {"seq": 128, "heads": 4, "head_dim": 32, "batch": 2, "steps": 2, "ties": 2, "planted_heads": (1, 2),
     "previous_token_heads": (0,), "tie_groups": 4},
    {"seq": 96, "heads": 3, "head_dim": 32, "batch": 3, "steps": 2, "ties": 3, "planted_heads": (0,),
     "sink_strength": 6.0, "tie_groups": 2},
    {"seq": 512, "heads": 2, "head_dim": 32, "batch": 1, "steps": 2, "ties": 2, "previous_token_heads": (0,)},
    {"seq": 64, "heads": 2, "head_dim": 32, "batch": 2, "steps": 3, "ties": 2, "planted_heads": (0,),
     "previous_token_heads": (1,), "tie_groups": 3},
    {"seq": 256, "heads": 3, "head_dim": 32, "batch": 2, "steps": 2, "ties": 2, "sink_strength": 6.0,
     "previous_token_heads": (0,), "tie_start": 0.5},
    {"seq": 128, "heads": 2, "head_dim": 32, "batch": 2, "steps": 2, "ties": 2, "planted_heads": (0,)},
    {"seq": 2048, "heads": 2, "head_dim": 32, "batch": 1, "steps": 1, "ties": 2, "previous_token_heads": (0,)},
)
FAMILIES = ("null", "tied-null", "planted")

def family_shapes(family: str) -> tuple[dict, ...]:
    """The shapes of a family: `NULL_SHAPES` for "null", `TIED_NULL_SHAPES` for "tied-null" and "planted"."""
    return NULL_SHAPES if family == "null" else TIED_NULL_SHAPES


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


