"""The keys of every analysis's --json, one `TypedDict` per payload, in the order the JSON writes them.

Each analysis's `payload(result)` returns its type; the registry's key lists (`registry.Analysis.json_keys`,
`other_json_keys`) are `keys_of` these types, and a test runs every analysis and compares what it writes with
them, so a key is added or renamed in one place. docs/json.md documents each key. Values that are dataclasses
or enums in the payload (`Obj`) are written as JSON objects and strings by `jsonable.to_jsonable`.

This module imports nothing heavy: the registry reads it when the CLI lists its commands.
"""
from __future__ import annotations

from typing import Any, Optional, TypedDict

Obj = Any  # a dataclass or dict of the payload, written as a JSON object (null where absent)
Objs = Any  # a sequence of them, written as a JSON array


class IsolatePayload(TypedDict):
    variants: Objs
    heads: Objs
    layers: Objs
    culprits: list[str]
    baseline_block: int
    baseline_tiles: list[int]
    n_biased_heads: int
    input_cast: Obj
    bias: Obj
    family: dict
    preset: str
    accumulation: str
    backend: str
    warnings: list[str]
    replay_fidelity: Obj
    verdict: str


class DeltaBiasPayload(TypedDict):
    per_step: Objs
    steps: list[int]
    step_sums: list[float]
    cumulative: list[float]
    top_features: Objs
    focus: dict
    total: dict
    pooled: Objs
    top_token: Obj
    cumulative_tokens: list[float]
    bias: Obj
    family: dict
    preset: str
    accumulation: str
    backend: str
    warnings: list[str]
    replay_fidelity: Obj
    verdict: str


class Rank1SimPayload(TypedDict):
    has_x: bool
    focus: dict
    tokens: Objs
    cosine_offdiag_mean: Optional[float]
    pk_cosine_offdiag_mean: Optional[float]
    x_cosine_offdiag_mean: Optional[float]
    cosine: list[list[float]]
    top_columns: Objs
    singular_values: list[float]
    effective_rank: Optional[float]
    top_sv_ratio: Optional[float]
    cross_step_alignment: Optional[float]
    steps: list[int]
    step_norms: list[float]
    cumulative_norms: list[float]
    accumulation_exponent: Optional[float]
    claim: Obj
    family: dict
    preset: str
    accumulation: str
    backend: str
    warnings: list[str]
    replay_fidelity: Obj
    verdict: str


class PVTracePayload(TypedDict):
    step: int
    layer: int
    head: int
    batch: int
    row: int
    feature: int
    pv_format: str
    preset: str
    accumulation: str
    backend: str
    warnings: list[str]
    replay_fidelity: Obj
    verdict: str
    final_error: float
    o_error: float
    o_bias: dict
    row_choice: str
    bias_split: Obj
    p_one_positions: list[int]
    jumps: list[dict]
    frac_error_from_p_one: Optional[float]
    attribution: dict
    class_shares: dict
    rows_attributed: int
    counterfactual: Obj
    bias: Obj
    family: dict
    largest_jump: Obj
    explanation: Obj


class BitdiffPayload(TypedDict):
    a: str
    b: str
    format: str
    steps: list[int]
    n_elements: int
    mismatch_rate: float
    ulp_hist: dict
    mean_signed_error: Objs
    biased_features: Objs
    alpha: float
    n_cells: int
    family: dict
    largest: Objs
    input_cast: Obj
    bias: Obj
    accumulation: str
    backend: str
    warnings: list[str]
    replay_fidelity: Obj
    verdict: str


class BitdiffAddPayload(TypedDict):
    """`bitdiff --add A B --json`: the inputs as given, then `numerics.explain.AddExplanation`'s fields."""

    input_a: str
    input_b: str
    a: float
    b: float
    a_bits: str
    b_bits: str
    operands_exact: bool
    exact: float
    exact_fits_acc: bool
    exact_bits: str
    acc_sum: float
    acc_sum_bits: str
    rounded: float
    rounded_bits: str
    error: float
    guard: int
    round: int
    sticky: int
    direction: str
    into: str
    acc: str
    exponent: int
    a_aligned: str
    b_aligned: str
    sum_aligned: str
    shift: int
    sum_exponent: int
    normalized: str
    kept: str
    round_and_rest: str
    rounded_significand: str


class FixCheckPayload(TypedDict):
    target: Obj
    baseline: Obj
    fixed: Obj
    alternatives: Objs
    bias_reduction: Optional[float]
    max_p_bar: Optional[float]
    triggered_rows: int
    nan_count: int
    removed: bool
    verdict: str
    exit_code: int
    collapse: Obj
    bias: Obj
    has_bias: bool
    outcome: str
    deployment: Obj
    family: dict
    beta: float
    eps: float
    offset: float
    preset: str
    accumulation: str
    backend: str
    warnings: list[str]
    replay_fidelity: Obj


class PcastDumpPayload(TypedDict):
    mode: str
    dump: str
    n_sinks: int
    block: int
    delta_k: list[float]
    scales: list[float]
    orders: list[str]
    heads: Objs
    dp: list[dict]
    warnings: list[str]
    replay_fidelity: Obj
    verdict: str
    fix_floor: float  # the lost-mass floor of the decision
    confidence: float  # level of every interval
    band_counts: dict  # heads per band: needs-fix, borderline, no-fix, one-hot, empty


class PcastSimulationPayload(TypedDict):
    mode: str
    config: dict
    delta_k: Any
    sigma_k: Any
    n_main: int
    rows: list[dict]
    dp: list[dict]
    ratio: Obj
    ratio_448: Obj
    ttest: dict
    notes: list[str]


class TimelinePayload(TypedDict):
    steps: list[int]
    loss: list[float]
    n_layers: int
    n_heads: int
    series: dict
    ties_loss_spearman: Optional[float]
    ties_loss_p_value: Optional[float]
    top_wq_head: Optional[list[int]]
    alarm_steps: list[int]
    alarms: list[dict]  # the alarms the capture recorded: step, metric, layer, head, value, rule
    capture_alarm_rule: Optional[dict]
    output_lse: Optional[list[float]]  # per step: mean log-sum-exp of the output logits (null: not recorded)
    qk_norm: list  # per layer: its attention normalizes q and k (W_Q's norm not watched there)
    dropped_steps: list[dict]  # steps an alarm announced that the capture dropped: step, reason, episode, mb
    alarm_rule: dict
    rule_alarms: list[dict]
    diagnosis: dict  # the instability the series show: analyses.timeline.diagnose.InstabilityFinding.to_json
    verdict: str
    warnings: list[str]


def keys_of(payload_type: type, *, then: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The JSON keys of a payload type in order, followed by the keys its command adds (`then`: figures, ...)."""
    return (*payload_type.__annotations__, *then)
