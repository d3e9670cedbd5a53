"""bitdiff, tensor mode: compare two O tensors bit by bit (mismatches, ULP distances, the bias map).

The two sides are any of: the O stored in the dump, O replayed under preset A, O replayed under
preset B. They may be held in different formats (e.g. bf16 and fp32): bits are compared in the
COARSER of the two formats (fewer fraction bits), the finer side rounded to it nearest-even first,
because that is what a store in the coarser format would hold. Signed errors (a − b) are taken on
the unrounded values in fp64.

The bias map is the mean signed error per (layer, head, feature) over every batch row and token
of every selected step, with its standard error, its t-test over units and its rounding unit (the
ulp of the comparison format at |b|): the O cells of `analyses.quantities`. A feature is "biased"
when the statistics policy says so (`analyses.significance`: Holm over the selection's family at
α = 0.01, and at least 1 % of a rounding unit), so that a map of hundreds of cells does not report
chance hits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from fa_forensics.analyses.contract import common_keys, replay_fidelity
from fa_forensics.analyses.quantities import (BiasCell, BiasClaim, CellSums, cell_sums, o_cells, o_claim, o_units,
                                              selection_family)
from fa_forensics.analyses.significance import ALPHA, Family, p_text
from fa_forensics.analyses.payloads import BitdiffPayload
from fa_forensics.layers.fanout import Workers, map_layers
from fa_forensics.enums import Backend
from fa_forensics.fidelity.planner import plan_for
from fa_forensics.fidelity.match import ReplayFidelity
from fa_forensics.fidelity.pair import input_cast_error, lp_of
from fa_forensics.layers.selection import as_seen_by, replay_layer
from fa_forensics.analyses.units import RowUnits, layer_units
from fa_forensics.errors import DumpError
from fa_forensics.replay.config import ReplayConfig

ULP_CLIP = 8  # the histogram's outermost bins hold |ULP distance| >= ULP_CLIP
TOP_K = 10

_DTYPE_FORMAT = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}
_FRACTION_BITS = {"fp32": 23, "fp16": 10, "bf16": 7, "fp8_e4m3": 3, "fp8_e5m2": 2}


def format_of(x: torch.Tensor) -> str:
    """The numerics format name of a tensor's dtype (fp64 counts as fp32: analyses never store fp64)."""
    if x.dtype == torch.float64:
        return "fp32"
    try:
        return _DTYPE_FORMAT[x.dtype]
    except KeyError:
        raise ValueError(f"no float format for dtype {x.dtype}") from None


def coarser(fmt_a: str, fmt_b: str) -> str:
    """The format with fewer fraction bits (ties: the first)."""
    return fmt_a if _FRACTION_BITS[fmt_a] <= _FRACTION_BITS[fmt_b] else fmt_b


@dataclass(frozen=True)
class LargestDiff:
    """One of the largest |a − b| elements, with both sides' bit strings in their own formats."""

    step: int
    layer: int
    head: int
    batch: int
    row: int
    feature: int
    a: float
    b: float
    diff: float
    ulp: int  # signed ULP distance in the comparison format
    a_bits: str
    b_bits: str


@dataclass(frozen=True)
class LayerStepDiff:
    """Sufficient statistics of one layer-step's comparison (to be merged across steps)."""

    step: int
    layer: int
    heads: list[int]
    fmt: str
    n: int  # elements compared
    mismatches: int
    ulp_counts: torch.Tensor  # (2·ULP_CLIP + 1,) int64 for distances −CLIP..CLIP (ends clipped)
    sums: CellSums  # per (head, feature): the O cells' sums of a − b and of its rounding unit
    largest: list[LargestDiff]


@dataclass(frozen=True)
class BitdiffResult:
    """The comparison of side A against side B over the whole selection."""

    a: str
    b: str
    fmt: str  # comparison format
    n_elements: int
    mismatch_rate: float
    ulp_hist: dict  # {"bins": [labels], "counts": [ints]}; bins "<=-8", "-7", ..., "7", ">=8"
    mean_signed_error: list[BiasCell]  # every (layer, head, feature) cell
    biased_features: list[BiasCell]  # significant cells, one each (all rows, else tied rows), largest |mean| first
    largest: list[LargestDiff]
    alpha: float = ALPHA
    n_cells: int = 0
    family: Family = Family()  # the tests the claims are corrected over (`significance`)
    steps: list[int] = field(default_factory=list)
    accumulation: str = "ieee"
    backend: Backend = Backend.EMULATE
    # the recipe's input cast alone (fp32 O of rounded vs stored inputs), None if no-op
    input_cast: Optional[dict] = None
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[ReplayFidelity] = None


def compare_layer_step(a: torch.Tensor, b: torch.Tensor, *, step: int, layer: int, heads: list[int],
                       top_k: int = TOP_K, row_units: Optional[RowUnits] = None) -> LayerStepDiff:
    """Compare two (B, h, T, D) O tensors of one layer-step bit by bit; the bias map's tests count the rows'
    units (`analyses.units`; None: every row its own unit)."""
    from fa_forensics.numerics import bit_string, round_to, ulp_distance

    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    fa, fb = format_of(a), format_of(b)
    fmt = coarser(fa, fb)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)  # (B, h, T, D)
    ar = round_to(a.to(torch.float32), fmt) if fa != fmt else a.to(torch.float32)
    br = round_to(b.to(torch.float32), fmt) if fb != fmt else b.to(torch.float32)
    ulp = ulp_distance(ar, br, fmt).to(torch.int64)  # (B, h, T, D) signed: a − b in ulps
    nan = torch.isnan(a64) | torch.isnan(b64)
    mismatch = int(((ar != br) & ~nan).sum() + nan.sum())
    counts = torch.bincount((ulp.clamp(-ULP_CLIP, ULP_CLIP) + ULP_CLIP).reshape(-1), minlength=2 * ULP_CLIP + 1)

    raw = a64 - b64  # (B, h, T, D)
    d = torch.where(torch.isfinite(raw), raw, torch.zeros_like(raw))  # non-finite errors: left out of the cells
    B, h, T, D = d.shape
    sums = cell_sums(step, layer, heads, raw, o_units(b64, fmt), row_units)

    largest = []
    k = min(top_k, d.numel())
    if k:
        idx = d.abs().reshape(-1).topk(k).indices.tolist()
        for i in idx:
            bi, hi, ti, fi = i // (h * T * D), (i // (T * D)) % h, (i // D) % T, i % D
            if d[bi, hi, ti, fi] == 0:
                continue
            va, vb = float(a64[bi, hi, ti, fi]), float(b64[bi, hi, ti, fi])
            largest.append(LargestDiff(step=step, layer=layer, head=heads[hi], batch=bi, row=ti, feature=fi,
                                       a=va, b=vb, diff=va - vb, ulp=int(ulp[bi, hi, ti, fi]),
                                       a_bits=bit_string(va, fa), b_bits=bit_string(vb, fb)))
    return LayerStepDiff(step=step, layer=layer, heads=list(heads), fmt=fmt, n=d.numel(), mismatches=mismatch,
                         ulp_counts=counts, sums=sums, largest=largest)


def ulp_bins() -> list[str]:
    """Labels of the ULP histogram bins."""
    return [f"<=-{ULP_CLIP}"] + [str(i) for i in range(-ULP_CLIP + 1, ULP_CLIP)] + [f">={ULP_CLIP}"]


def summarize(parts: list[LayerStepDiff], a_name: str, b_name: str, *, family: Optional[Family] = None,
              top_k: int = TOP_K) -> BitdiffResult:
    """Merge per-layer-step statistics (pooling steps per (layer, head)) into the bias map, its cells decided
    in `family` (default: the cells alone)."""
    if not parts:
        raise ValueError("nothing to summarize")
    cells = o_cells([p.sums for p in parts], family)
    family = family if family is not None else Family(o_cells=len(cells))
    # one entry per significant cell: over all rows where that is significant (its tied rows inside), else its tied rows
    biased = sorted((next(x for x in c.subsets if x.significant) for c in cells if c.found),
                    key=lambda c: -abs(c.mean))
    n_el = sum(p.n for p in parts)
    counts = sum(p.ulp_counts for p in parts)
    largest = sorted((d for p in parts for d in p.largest), key=lambda d: -abs(d.diff))[:top_k]
    return BitdiffResult(
        a=a_name, b=b_name, fmt=parts[0].fmt, n_elements=n_el,
        mismatch_rate=sum(p.mismatches for p in parts) / n_el if n_el else float("nan"),
        ulp_hist={"bins": ulp_bins(), "counts": [int(c) for c in counts]},
        mean_signed_error=cells, biased_features=biased, largest=largest, n_cells=len(cells), family=family,
        steps=sorted({p.step for p in parts}),
    )


def bias_map(result: BitdiffResult) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """(row labels (layer, head), mean (R, D), significant by the policy (R, D) bool) for the bias-map figure."""
    rows = sorted({(c.layer, c.head) for c in result.mean_signed_error})
    D = 1 + max(c.feature for c in result.mean_signed_error)
    index = {r: i for i, r in enumerate(rows)}
    mean = torch.full((len(rows), D), math.nan, dtype=torch.float64)
    sig = torch.zeros((len(rows), D), dtype=torch.bool)
    for c in result.mean_signed_error:
        mean[index[(c.layer, c.head)], c.feature] = c.mean
        sig[index[(c.layer, c.head)], c.feature] = c.found
    return rows, mean, sig


def side_name(side) -> str:
    """'dump' for the stored O (None), else the recipe's preset."""
    return "dump" if side is None else side.label


def run(dump, selections, a, b, backend: Backend = Backend.EMULATE, *, progress=None,
        workers: Workers = Workers()) -> BitdiffResult:
    """Compare side `a` against side `b` on every selected layer-step (one batched replay per side).

    A side is a `Recipe` or its `Plan` (O replayed under its config at each layer-step) or None (the O stored
    in the dump). Both recipes share one accumulation model. Work items are (step, layer, head group) on
    `workers`, reduced in item order (the same result for any N).
    """
    a = None if a is None else plan_for(dump, selections, a)
    b = None if b is None else plan_for(dump, selections, b, known=a)
    items = map_layers(layer_part, dump, selections, workers, progress, args=(a, b, backend))
    warnings: list[str] = []
    for warns, _, _ in items:
        warnings.extend(w for w in warns if w not in warnings)
    parts = [part for _, part, _ in items]
    cast_parts = [cast for _, _, cast in items if cast is not None]
    plan = a if a is not None else b
    return replace(summarize(parts, side_name(a), side_name(b), family=selection_family(dump, selections)),
                   accumulation=plan.recipe.accumulation_name if plan is not None else "ieee",
                   backend=Backend(backend), input_cast=_input_cast_summary(cast_parts), warnings=tuple(warnings),
                   replay_fidelity=None if plan is None else replay_fidelity(dump, selections, plan))


def layer_part(t, a, b, backend):
    """(warnings, the a-vs-b comparison, the input cast's own comparison or None) of one layer-step."""
    configs = [None if side is None else lp_of(t, side) for side in (a, b)]
    seen_cfg = min((c for c in configs if c is not None), key=lambda c: _INPUT_BITS[c.input_dtype.value], default=None)
    seen = t if seen_cfg is None else as_seen_by(t, seen_cfg)  # both replays see the coarser side's inputs
    sides = []
    for cfg in configs:
        if cfg is None:
            if t.o is None:
                raise DumpError(f"{t.where} has no stored 'o'; compare two presets instead of 'dump'")
            sides.append(t.o)
        else:
            sides.append(replay_layer(seen, cfg, backward=False, backend=backend).o)
    units = layer_units(seen, seen_cfg if seen_cfg is not None else ReplayConfig())
    part = compare_layer_step(sides[0], sides[1], step=t.step, layer=t.layer, heads=t.heads, row_units=units)
    cast = None
    if seen is not t:
        o_raw, o_cast = input_cast_error(t, seen_cfg, backend)
        cast = compare_layer_step(o_cast, o_raw, step=t.step, layer=t.layer, heads=t.heads, top_k=0, row_units=units)
    return seen.warnings, part, cast


_INPUT_BITS = {"fp32": 24, "fp16": 11, "bf16": 8, "fp8_e4m3": 4, "fp8_e5m2": 3}  # significand bits of each input format


def _input_cast_summary(parts: list[LayerStepDiff]) -> Optional[dict]:
    """What rounding the stored inputs to the recipe's input format alone does to the fp32 O (None if nothing)."""
    if not parts:
        return None
    r = summarize(parts, "fp32 of the rounded inputs", "fp32 of the stored inputs")
    return {"mismatch_rate": r.mismatch_rate, "n_elements": r.n_elements, "n_biased_features": len(r.biased_features),
            "biased_features": r.biased_features[:10], "n_cells": r.n_cells}


def verdict(r: BitdiffResult) -> str:
    """One sentence: the share of differing elements, the most biased feature, and the input cast apart."""
    top = r.biased_features[0] if r.biased_features else None
    n = len(r.biased_features)
    tail = (f"; most biased: layer {top.layer} head {top.head} feature {top.feature} mean {top.mean:+.3e} ± "
            f"{top.se:.1e} ({top.effect:.2g} of a rounding unit; "
            f"{p_text(top.tested_p, top.adjusted_p, r.family.n_tests)})"
            if top else f"; no feature is significantly biased ({r.family.describe()})")
    if r.input_cast is not None:
        tail += (f"; apart from that, the recipe's input cast alone biases {r.input_cast['n_biased_features']} "
                 f"feature(s) of the fp32 O ({r.input_cast['mismatch_rate']:.1%} of elements change)")
    return (f"{r.mismatch_rate:.1%} of elements differ in {r.fmt} bits; {n} significantly biased "
            f"feature{'s' if n != 1 else ''}{tail}")


def bias_claim(r: BitdiffResult) -> BiasClaim:
    """The most significant (layer, head, feature) cell of the bias map."""
    return o_claim(r.mean_signed_error, r.family)


def payload(r: BitdiffResult) -> BitdiffPayload:
    """The --json payload (keys documented in docs/json.md)."""
    return {
        "a": r.a, "b": r.b, "format": r.fmt, "steps": r.steps, "n_elements": r.n_elements,
        "mismatch_rate": r.mismatch_rate, "ulp_hist": r.ulp_hist,
        "mean_signed_error": r.mean_signed_error, "biased_features": r.biased_features,
        "alpha": r.alpha, "n_cells": r.n_cells, "family": r.family.as_dict(), "largest": r.largest,
        "input_cast": r.input_cast, "bias": bias_claim(r),
        "accumulation": r.accumulation, "backend": r.backend.value, **common_keys(r), "verdict": verdict(r),
    }
