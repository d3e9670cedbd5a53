"""isolate: which single repair removes the δ error? (paper §3.2, Claim 1)

Each (step, layer) is replayed once per variant with all selected heads batched: the low-precision
baseline and single repairs of it, each compared with the high-precision replay (preset "fp32") of
the same stored inputs. Per variant and head: the O bias (signed mean of O_var − O_hp ± se), the O
RMSE, Σ_T(δ_var − δ_hp), and the gradient errors ‖dQ_var − dQ_hp‖ and ‖dW_Q,var − dW_Q,hp‖.

Baseline and tiling: the baseline tiles like the paper's reference code (a pure-PyTorch
FlashAttention-2 with 512 x 512 blocks; 64 x 64 when T ≤ 512 so a short dump still tiles), and the
"no-tiling" repair sets block = sequence. Every other repair keeps the baseline's tiling.

Gradient errors use the paper's Eq. 1, exact when the two backward passes differ only in δ (the
§3.2 setting: an fp32 backward on the same inputs): dQ_var − dQ_hp = −α·diag(δ_var − δ_hp)·(P K),
dW_Q = dQᵀX, with P the fp32 attention matrix. δ itself comes from O (δ = rowsum(dO ∘ O), float64)
for forward repairs; the two backward repairs (δ from O recomputed, δ = rowsum(dP ∘ P)) run the
replay's backward and take its δ.

Culprits: the bias to remove is the baseline's Σ_T(δ_lp − δ_hp) in the heads where it is significant
(t-test or sign test p < 0.01; heads with only noise define no bias). A repair's residual is its own
Σδ error projected on the baseline's sign per biased head; it is a culprit when the residual is at most
10% of the baseline's (reduction ≥ 0.9). With no biased head there are no culprits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from fa_forensics.analyses.delta_bias import delta_error, delta_of
from fa_forensics.analyses.rank1_sim import pk_rows
from fa_forensics.analyses.selection import LayerSelection, LayerTensors, hp_config, load, lp_config, replay_layer
from fa_forensics.analyses.stats import sign_test, sum_se
from fa_forensics.errors import DumpError, UserError
from fa_forensics.replay.config import DeltaSource, Precision, ReplayConfig, Rounding, Softmax

Progress = Optional[Callable[[str], None]]
CULPRIT_REDUCTION = 0.9  # a repair is a culprit when it removes ≥ 90% of the baseline's Σδ bias
BIASED_HEAD_P = 0.01  # heads whose baseline Σδ error is significant (t-test or sign test) define the bias


@dataclass(frozen=True)
class Variant:
    """One replay of the isolation table: a name, what it changes, its config, whether δ needs the backward."""

    name: str
    description: str
    config: ReplayConfig
    backward: bool


def baseline_block(T: int) -> int:
    """The baseline's tile size: 512 like the paper's reference code, 64 for short sequences (T ≤ 512)."""
    return 512 if T > 512 else 64


def variants(T: int, accumulation: str = "ieee") -> list[Variant]:
    """The baseline (tiled BF16) and its single repairs, in the order of the paper's §3.2."""
    b = baseline_block(T)
    base = lp_config(accumulation).with_(block_m=b, block_n=b)
    fp32 = Precision.FP32
    return [
        Variant("baseline", f"BF16 flash attention, {b}x{b} tiles (paper reference code)", base, False),
        Variant("no-tiling", "block = sequence length", base.with_(block_m=None, block_n=None), False),
        Variant("o-fp32", "O in fp32 (P̄V product and O kept fp32)", base.with_(pv_dtype=fp32, o_dtype=fp32), False),
        Variant("delta-o-recomputed", "δ from O recomputed as P̄V/ℓ in fp32 in the backward", base.with_(delta=DeltaSource.O_RECOMPUTED), True),
        Variant("delta-dp-p", "δ = rowsum(dP ∘ P)", base.with_(delta=DeltaSource.DP_P), True),
        Variant("pv-fp32", "P̄V product in fp32 only (O still stored bf16)", base.with_(pv_dtype=fp32), False),
        Variant("stabilized", "stabilized softmax (Algorithm 3, β=2)", base.with_(softmax=Softmax.STABILIZED), False),
        Variant("stochastic", "stochastic rounding of the P̄ and O casts", base.with_(rounding=Rounding.STOCHASTIC), False),
    ]


# ---- pure per-head measurements -----------------------------------------------------------------

@dataclass(frozen=True)
class HeadMeasure:
    """Sums for one variant on one (step, layer, head), combined later across heads and steps."""

    n_o: int
    o_err_sum: float
    o_err_sumsq: float
    delta_err_sum: float
    dq_err_sq: float
    dwq_err_sq: Optional[float]


def measure_heads(
    o_var: torch.Tensor,
    o_hp: torch.Tensor,
    dd: torch.Tensor,
    pk: torch.Tensor,
    x: Optional[torch.Tensor],
    scale: float,
) -> list[HeadMeasure]:
    """Per head: sums of the O error and its square, Σδ error, ‖dQ error‖², ‖dW_Q error‖² (Eq. 1-2).

    o_var, o_hp (B, h, T, D); dd = δ_var − δ_hp (B, h, T); pk (B, h, T, D); x (B, T, C) or None.
    """
    err = o_var.to(torch.float64) - o_hp.to(torch.float64)  # (B, h, T, D)
    dq = -scale * dd.unsqueeze(-1) * pk  # (B, h, T, D): dQ_var − dQ_hp
    dq_sq = (dq**2).sum(dim=(0, 2, 3))  # (h,)
    dwq_sq = None
    if x is not None:
        dwq = torch.einsum("bhtd,btc->hdc", dq, x.to(torch.float64))  # (h, D, C)
        dwq_sq = (dwq**2).sum(dim=(1, 2))
    out = []
    for j in range(err.shape[1]):
        e = err[:, j]
        out.append(HeadMeasure(
            n_o=e.numel(), o_err_sum=float(e.sum()), o_err_sumsq=float((e * e).sum()),
            delta_err_sum=float(dd[:, j].sum()), dq_err_sq=float(dq_sq[j]),
            dwq_err_sq=None if dwq_sq is None else float(dwq_sq[j]),
        ))
    return out


# ---- results -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class VariantResult:
    name: str
    description: str
    o_bias: float  # mean of O_var − O_hp over every selected element
    o_bias_se: float
    o_rmse: float
    delta_err_sum: float  # Σ over selected steps, layers, heads, batch, tokens of (δ_var − δ_hp)
    delta_err_se: float  # its standard error (s·√n over tokens)
    delta_err_residual: float  # |Σ over biased heads of sign(baseline's Σδ)·Σ_T (δ_var − δ_hp)|
    reduction: float  # 1 − residual / Σ over biased heads of |baseline's Σδ|: share of the bias removed
    delta_p_value: float  # sign test over tokens of δ_var − δ_hp
    dq_err: float  # ‖dQ_var − dQ_hp‖_F over the selection (Eq. 1)
    dwq_err: Optional[float]  # ‖dW_Q,var − dW_Q,hp‖_F (per head D x C blocks), None without X


@dataclass(frozen=True)
class HeadDelta:
    step: int
    layer: int
    head: int
    delta_err_sum: float  # baseline Σ_T (δ_lp − δ_hp) (summed over the batch)
    delta_err_se: float  # its standard error
    t_p_value: float  # one-sample t-test of the per-token errors
    p_value: float  # sign test over the head's tokens


@dataclass(frozen=True)
class LayerDelta:
    layer: int
    delta_err_sum: float  # Σ over steps and heads of the baseline's Σ_T (δ_lp − δ_hp)
    delta_err_abs: float  # Σ over (step, head) of |Σ_T (δ_lp − δ_hp)|


@dataclass(frozen=True)
class IsolateResult:
    variants: list[VariantResult]
    heads: list[HeadDelta]  # largest |delta_err_sum| first
    layers: list[LayerDelta]  # largest delta_err_abs first
    culprits: list[str]  # repairs removing ≥ 90% of the baseline's |Σδ error|
    baseline_block: int
    n_biased_heads: int  # (step, layer, head) items whose baseline Σδ error is significant (p < 0.01)
    accumulation: str
    backend: str


def isolate(
    dump,
    selections: Sequence[LayerSelection],
    *,
    accumulation: str = "ieee",
    backend: str = "emulate",
    progress: Progress = None,
) -> IsolateResult:
    """Replay every selected layer-step under the baseline and each single repair; rank heads and
    layers by the baseline's Σδ error; name the repairs that remove ≥ 90% of it."""
    layers = (load(dump, sel) for sel in selections)
    return isolate_layers(layers, accumulation=accumulation, backend=backend, progress=progress)


def isolate_layers(
    layers: Iterable[LayerTensors],
    *,
    accumulation: str = "ieee",
    backend: str = "emulate",
    progress: Progress = None,
) -> IsolateResult:
    """`isolate` on layer-steps already loaded (or built in memory)."""
    measures: dict[str, list[HeadMeasure]] = {}
    signs: dict[str, list[torch.Tensor]] = {}
    heads: list[HeadDelta] = []
    block, vs = None, []
    for t in layers:
        if t.do is None:
            raise DumpError(f"{t.where}: the dump has no 'do' array; isolate needs dO to compute δ")
        vs = variants(t.q.shape[2], accumulation)
        block = vs[0].config.block_m
        hp = replay_layer(t, hp_config(), backward=False, backend=backend)
        delta_hp = delta_of(t.do, hp.o)  # (B, h, T)
        pk = pk_rows(t.q, t.k, t.scale, t.causal)  # (B, h, T, D)
        base_o = None
        for v in vs:
            out = replay_layer(t, v.config, backward=v.backward, backend=backend)
            if v.name == "baseline":
                base_o = out.o
            if v.backward:  # backward repairs: forward O is the baseline's, δ is the replay's own
                o_var, dd = base_o, out.delta.to(torch.float64) - delta_hp
            else:
                o_var, dd = out.o, delta_error(t.do, out.o, hp.o)
            measures.setdefault(v.name, []).extend(measure_heads(o_var, hp.o, dd, pk, t.x, t.scale))
            signs.setdefault(v.name, []).append(dd.reshape(-1))
            if v.name == "baseline":
                for j, h in enumerate(t.heads):
                    s = sum_se(dd[:, j])
                    heads.append(HeadDelta(t.step, t.layer, h, s.value, s.se, s.p_value, sign_test(dd[:, j]).p_value))
            if progress:
                progress(f"step {t.step} layer {t.layer}: {v.name}")
    if not vs:
        raise UserError("isolate: nothing selected to replay; check --step/--layer/--head against `fa-forensics info`")

    biased = [h.t_p_value < BIASED_HEAD_P or h.p_value < BIASED_HEAD_P for h in heads]  # in measure order
    direction = [(1.0 if h.delta_err_sum >= 0 else -1.0) if b else 0.0 for h, b in zip(heads, biased)]
    base_bias = sum(abs(h.delta_err_sum) for h, b in zip(heads, biased) if b)
    results = [_combine(v, measures[v.name], torch.cat(signs[v.name]), direction, base_bias) for v in vs]
    culprits = [r.name for r in results if r.name != "baseline" and base_bias > 0 and r.reduction >= CULPRIT_REDUCTION]
    heads.sort(key=lambda h: -abs(h.delta_err_sum))
    return IsolateResult(results, heads, _rank_layers(heads), culprits, int(block or 0), sum(biased), accumulation, backend)


def _combine(v: Variant, hm: list[HeadMeasure], dd_all: torch.Tensor, direction: list[float], base_bias: float) -> VariantResult:
    n = sum(m.n_o for m in hm)
    s = sum(m.o_err_sum for m in hm)
    ss = sum(m.o_err_sumsq for m in hm)
    mean = s / n
    var = max(ss / n - mean * mean, 0.0) * n / max(n - 1, 1)
    residual = abs(sum(d * m.delta_err_sum for d, m in zip(direction, hm)))
    dwq = None if any(m.dwq_err_sq is None for m in hm) else sum(m.dwq_err_sq for m in hm) ** 0.5
    return VariantResult(
        name=v.name, description=v.description, o_bias=mean, o_bias_se=(var / n) ** 0.5,
        o_rmse=(ss / n) ** 0.5, delta_err_sum=sum(m.delta_err_sum for m in hm), delta_err_se=sum_se(dd_all).se, delta_err_residual=residual,
        reduction=1.0 - residual / base_bias if base_bias > 0 else float("nan"),
        delta_p_value=sign_test(dd_all).p_value, dq_err=sum(m.dq_err_sq for m in hm) ** 0.5, dwq_err=dwq,
    )


def _rank_layers(heads: list[HeadDelta]) -> list[LayerDelta]:
    by: dict[int, list[float]] = {}
    for h in heads:
        by.setdefault(h.layer, []).append(h.delta_err_sum)
    out = [LayerDelta(l, sum(v), sum(abs(x) for x in v)) for l, v in by.items()]
    return sorted(out, key=lambda l: -l.delta_err_abs)

