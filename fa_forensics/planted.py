"""`synth`: plant a dump whose failure mechanism is known, so analyses can be checked against truth.

What is planted (paper §3.3.2 and the blog's "two big, one small" mechanism), in the chosen heads:
- exact ties: in each planted row the maximum score is attained exactly K times. The K tied keys
  are identical bf16 vectors (one non-zero coordinate), so their fp32 scores are bit-identical and
  P̄ = exp(S - m) = 1 exactly K times; every other score sits `GAP_RANGE` = 12 to 16 below the
  maximum (drawn per row, as maxima vary in real training: a single shared maximum would make
  the stabilized shift β·r_m act like App. C's fixed offset), so the residue Σ P̄·V of the rest
  is well below half a bf16 ulp of the tied sum;
- one V feature ("planted feature") that is negative for a fraction `v_skew` of the tokens, with
  magnitudes in [1, 2): two of them sum into [2, 4) (a carry), so half the tied sums sit exactly
  half-way between two bf16 values and the negative residue rounds them away from zero;
- dO negative in that feature, so δ_lp - δ_hp = rowsum(dO ∘ (O_lp - O_hp)) is biased positive;
- in X, a few input features (columns) that stand out: large, with one sign, in every token and step.
Other heads are plain N(0, 1); with `sink_strength` Δ they get the FP8 paper's sinks instead:
the first SINK_TOKENS keys score Δ above N(0, 1) noise. `previous_token_heads` are heads of the kind language
models learn: every query attends mostly to the key just before it, so each row's dominant key is a different one
(no two rows share their maximum).

The stored O is the BF16 reference output (`bf16_reference`): the emulator's replay under preset "bf16".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fa_forensics.errors import ConfigError, InvalidSetting, TargetExists

GAP_RANGE = (12.0, 16.0)  # score of the tied keys above the bulk of the others, per row (natural-log units)
ANCHOR_K = 4.0  # the one non-zero coordinate of a tied key
SIGMA_K = 0.15  # other keys of a planted head: N(0, SIGMA_K²) per coordinate
N_GROUPS = 8  # tie groups per (step, layer, batch, head)
# Each tie group also gets keys scoring a little below the maximum, whose V is exactly 0 in the
# planted feature: they put real mass in ℓ (≈ 2.5 instead of ≈ 2, as in real rows) without adding
# residue to the planted feature's sum. With ℓ ≈ 2 the division O = Ō/ℓ would keep the carry bit
# of the tied sum, and the final O cast would repeat the tie even with P̄V computed in fp32.
N_DISTRACTORS = 2
DISTRACTOR_FRACTION = 0.875  # exact in bf16: distractor scores are 0.875·r_m, P̄ = exp(-r_m/8)
SINK_TOKENS = 4
N_STANDOUT = 2
# previous-token heads: the key before each query scores log(t + 1) + U(PREVIOUS_LEAD) above the scale of the others,
# so it holds most of row t's mass whatever t (with Gaussian key codes the other scores spread with sd ≈ lead/√D,
# so the key before holds the row maximum in (nearly) every row for D ≥ 32, and most of the mass for D ≥ 64)
PREVIOUS_LEAD = (1.0, 3.0)
PREVIOUS_QUERY_NOISE = 0.25  # sd of the query's component off the previous key's code


@dataclass(frozen=True)
class SynthSpec:
    """Sizes and knobs of a planted dump (the `synth` command's options)."""

    seq: int = 256
    heads: int = 4
    head_dim: int = 64
    batch: int = 2
    steps: int = 4
    layers: int = 1
    ties: int = 2
    sink_strength: float | None = None
    v_skew: float = 1.0
    planted_heads: tuple[int, ...] = (1,)
    seed: int = 0
    tie_groups: int = N_GROUPS  # tie groups per (step, layer, batch, planted head)
    tie_start: float = 0.0  # the groups' keys are drawn from this fraction of T on: rows before it have no tie
    previous_token_heads: tuple[int, ...] = ()  # heads whose every query attends mostly to the key before it

    def __post_init__(self) -> None:
        def need(ok: bool, setting: str, reason: str) -> None:
            if not ok:
                raise InvalidSetting(setting, reason)

        need(self.seq >= 16, "seq",
             f"{self.seq} is too short; use at least {max(16, 2 * (self.ties + N_DISTRACTORS) * N_GROUPS)}")
        for name in ("heads", "batch", "steps", "layers"):
            need(getattr(self, name) >= 1, name, f"must be at least 1, got {getattr(self, name)}")
        need(1 <= self.tie_groups <= N_GROUPS, "tie_groups", f"{self.tie_groups} must be between 1 and {N_GROUPS}")
        need(self.head_dim >= 2 * self.tie_groups, "head_dim",
             f"{self.head_dim} is too small; use at least {2 * self.tie_groups}")
        need(1 <= self.ties <= 16, "ties", f"{self.ties} must be between 1 and 16")
        need((self.ties + N_DISTRACTORS) * self.tie_groups <= self.seq // 2, "ties",
             f"{self.ties} ties need a sequence of at least {2 * (self.ties + N_DISTRACTORS) * self.tie_groups}")
        need(0.0 <= self.tie_start < 1.0, "tie_start", f"{self.tie_start} must be a fraction in [0, 1)")
        need(0.0 <= self.v_skew <= 1.0, "v_skew", f"{self.v_skew} must be a fraction in [0, 1]")
        need(len(self.planted_heads) > 0, "planted_heads", "must name at least one head")
        bad = [h for h in self.planted_heads if not 0 <= h < self.heads]
        need(not bad, "planted_heads", f"{bad} not in 0..{self.heads - 1}; pick heads below the number of heads")
        bad = [h for h in self.previous_token_heads if not 0 <= h < self.heads or h in self.planted_heads]
        need(not bad, "previous_token_heads",
             f"{bad} not in 0..{self.heads - 1} or planted; pick heads below the number of heads, not planted ones")
        need(self.sink_strength is None or math.isfinite(self.sink_strength), "sink_strength",
             "must be a finite number")


# --------------------------------------------------------------------------------------------
# The BF16 reference forward (the emulator's default config), used for the stored O and checks
# --------------------------------------------------------------------------------------------
def bf16_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_lp bf16, O_hp fp32), each (B, H, T, D), from bf16-valued q, k, v: the emulator's replays
    under the presets "bf16" and "fp32" (ieee accumulation), so the stored O is reproducible bit for
    bit on any machine and by `match`.

    S = α·Q Kᵀ (fp32), P̄ = bf16(exp(S − rowmax S)), ℓ = rowsum of the pre-cast P̄ (fp32),
    Ō = bf16(P̄ @ V, fp32 sums in key order), O_lp = bf16(Ō / ℓ). O_hp is the same with no casts.
    """
    from fa_forensics.replay import ReplayConfig, replay

    alpha = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    o_lp = replay(q, k, v, ReplayConfig.preset("bf16"), causal=causal, scale=alpha).o
    o_hp = replay(q, k, v, ReplayConfig.preset("fp32"), causal=causal, scale=alpha).o
    return o_lp, o_hp


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------
def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def _planted_qk(spec: SynthSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """q, k (T, D) fp32 of one planted head, and its tie layout (groups, first tied row)."""
    T, D, K, n_groups = spec.seq, spec.head_dim, spec.ties, spec.tie_groups
    alpha = 1.0 / math.sqrt(D)
    per_group = K + N_DISTRACTORS
    window = max(per_group * n_groups, T // 4)
    start = min(int(spec.tie_start * T), T - window)  # keys before `start` belong to no group
    drawn = start + torch.randperm(window, generator=g)[: per_group * n_groups].view(n_groups, per_group)
    positions, distractors = drawn[:, :K].sort(dim=1).values, drawn[:, K:]
    ready = drawn.max(dim=1).values  # (G,) row from which each group and its distractors are visible (causal)
    order = ready.argsort()  # groups ordered by when they are complete
    positions, distractors, ready = positions[order], distractors[order], ready[order]
    dims = torch.randperm(D, generator=g)[:n_groups]  # one direction per group
    k = torch.randn(T, D, generator=g) * SIGMA_K
    for grp, extra, d in zip(positions, distractors, dims):
        k[grp] = 0.0
        k[grp, d] = ANCHOR_K  # K identical key vectors -> bit-identical scores
        k[extra] = 0.0
        k[extra, d] = ANCHOR_K * DISTRACTOR_FRACTION  # score (1 - fraction)·r_m below the max: P̄ ≈ 0.2-0.3
    q = torch.randn(T, D, generator=g)
    first = int(ready[0])
    rows = torch.arange(first, T)
    n_ready = (ready[None, :] <= rows[:, None]).sum(dim=1)  # (rows,)
    choice = (torch.rand(len(rows), generator=g) * n_ready).long()
    lo, hi = GAP_RANGE
    gap = lo + (hi - lo) * torch.rand(len(rows), generator=g)  # (rows,) the row maximum r_m ≈ gap
    t_q = _bf16(gap / (alpha * ANCHOR_K)).float()  # q's anchor coordinate: α·t_q·ANCHOR_K ≈ gap
    q[rows, dims[choice]] = t_q
    layout = {"groups": positions.tolist(), "distractors": distractors.tolist(), "first_tied_row": first,
              "n_tied_rows": int(T - first)}
    return q, k, layout


def _planted_vdo(spec: SynthSpec, feature: int, g: torch.Generator,
                 zero_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """v, dO (T, D) of one planted head: the planted feature has magnitudes in [1, 2) (v) and [2, 4) (dO)."""
    T, D = spec.seq, spec.head_dim
    v = torch.randn(T, D, generator=g)
    mantissa = torch.randint(0, 128, (T,), generator=g).float()
    sign = torch.where(torch.rand(T, generator=g) < spec.v_skew, -1.0, 1.0)
    v[:, feature] = sign * (1.0 + mantissa / 128.0)  # exact in bf16: two of them carry into [2, 4)
    v[zero_rows, feature] = 0.0  # distractor keys add to ℓ, not to the planted feature's sum
    do = torch.randn(T, D, generator=g) * 0.5
    do[:, feature] = -2.0 * (1.0 + torch.rand(T, generator=g))
    return v, do


def _sink_qk(spec: SynthSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (T, D) with the first SINK_TOKENS keys scoring `sink_strength` above N(0, 1) noise (coordinate 0)."""
    T, D = spec.seq, spec.head_dim
    alpha = 1.0 / math.sqrt(D)
    q = torch.randn(T, D, generator=g)
    k = torch.randn(T, D, generator=g)
    c = float(_bf16(torch.tensor(math.sqrt(D))))
    q[:, 0] = c
    k[:, 0] = 0.0
    k[:SINK_TOKENS, 0] = spec.sink_strength / (alpha * c)
    return q, k


def _previous_token_qk(spec: SynthSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (T, D) of a previous-token head: keys are random codes N(0, 1); query t is its previous key's code scaled
    so that their score is log(t + 1) + U(PREVIOUS_LEAD), plus N(0, PREVIOUS_QUERY_NOISE²) noise (query 0 sees only
    itself)."""
    T, D = spec.seq, spec.head_dim
    alpha = 1.0 / math.sqrt(D)
    k = torch.randn(T, D, generator=g)
    previous = k[(torch.arange(T) - 1).clamp(min=0)]  # (T, D)
    lo, hi = PREVIOUS_LEAD
    lead = torch.log(torch.arange(1, T + 1, dtype=torch.float32)) + lo + (hi - lo) * torch.rand(T, generator=g)
    q = (lead / (alpha * (previous * previous).sum(-1)))[:, None] * previous
    q = q + PREVIOUS_QUERY_NOISE * torch.randn(T, D, generator=g)
    return q, k


def _standout(spec: SynthSpec, C: int, g: torch.Generator) -> dict[int, float]:
    """feature -> signed mean of the stand-out input features of X (same for every step)."""
    feats = torch.randperm(C, generator=g)[:N_STANDOUT].tolist()
    means = ((15.0 + 10.0 * torch.rand(N_STANDOUT, generator=g))
             * torch.where(torch.rand(N_STANDOUT, generator=g) < 0.5, -1.0, 1.0))
    return {int(f): float(m) for f, m in zip(feats, means)}


@dataclass(frozen=True)
class PlantedStep:
    """The tensors of one (step, layer): q, k, v, o, do (B, H, T, D) bf16, x (B, T, C) bf16."""

    tensors: dict[str, torch.Tensor]
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)  # "b{b}.h{h}" -> tie layout


def plant_step(spec: SynthSpec, feature: int, standout: dict[int, float], g: torch.Generator) -> PlantedStep:
    """Generate one (step, layer) of a planted dump."""
    B, H, T, D = spec.batch, spec.heads, spec.seq, spec.head_dim
    C = H * D
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(4))  # plain heads: N(0, 1)
    layouts: dict[str, dict[str, Any]] = {}
    for b in range(B):
        for h in range(H):
            if h in spec.planted_heads:
                q[b, h], k[b, h], layouts[f"b{b}.h{h}"] = _planted_qk(spec, g)
                zero_rows = [t for grp in layouts[f"b{b}.h{h}"]["distractors"] for t in grp]
                v[b, h], do[b, h] = _planted_vdo(spec, feature, g, zero_rows)
            elif h in spec.previous_token_heads:
                q[b, h], k[b, h] = _previous_token_qk(spec, g)
            elif spec.sink_strength is not None:
                q[b, h], k[b, h] = _sink_qk(spec, g)
    x = torch.randn(B, T, C, generator=g)
    for f, mean in standout.items():
        x[:, :, f] = mean + 0.5 * torch.randn(B, T, generator=g)
    q, k, v, do, x = (_bf16(t) for t in (q, k, v, do, x))
    o, _ = bf16_reference(q, k, v, causal=True)
    return PlantedStep({"q": q, "k": k, "v": v, "o": o, "do": do, "x": x}, layouts)


def synth(out, spec: SynthSpec, *, overwrite: bool = False) -> dict[str, Any]:
    """Write a planted dump to `out`; return its ground truth (also stored in the root attrs)."""
    from fa_forensics.dump import DumpWriter
    from fa_forensics.dump.safe_files import refuse_link
    from fa_forensics.dump.staging import staged_store
    from fa_forensics.dump.writer import _existing_format
    from pathlib import Path

    out = Path(out)
    refuse_link(out, "out")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not overwrite:
            raise TargetExists(out, "out")
        if not out.is_dir() or _existing_format(out) is None:
            raise TargetExists(out, "out", foreign=True)
    g = torch.Generator().manual_seed(spec.seed)
    feature = int(torch.randint(0, spec.head_dim, (1,), generator=g))
    standout = _standout(spec, spec.heads * spec.head_dim, g)
    truth: dict[str, Any] = {
        "planted_heads": list(spec.planted_heads),
        "planted_feature": feature,
        "ties": spec.ties,
        "v_skew": spec.v_skew,
        "standout_x_features": sorted(standout),
        "standout_x_means": {str(f): m for f, m in sorted(standout.items())},
        "sink_strength": spec.sink_strength,
        "sink_heads": ([h for h in range(spec.heads) if h not in (*spec.planted_heads, *spec.previous_token_heads)]
                       if spec.sink_strength is not None else []),
        "previous_token_heads": list(spec.previous_token_heads),
        "sink_tokens": list(range(SINK_TOKENS)) if spec.sink_strength is not None else [],
        "score_gap_range": list(GAP_RANGE),
        "seed": spec.seed,
        "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(spec).items()},
        "ties_layout": {},
    }
    run_attrs = {
        "device": "cpu",
        "amp_dtype": "bfloat16",
        "model": {"name": "synth", "n_layer": spec.layers, "n_head": spec.heads, "head_dim": spec.head_dim,
                  "d_model": spec.heads * spec.head_dim, "seq_len": spec.seq},
        "capture": {"source": "synth", "steps": list(range(spec.steps)), "layers": list(range(spec.layers)),
                    "heads": None, "batch": f"0:{spec.batch}"},
    }
    steps: list[PlantedStep] = []
    for s in range(spec.steps):
        for l in range(spec.layers):
            ps = plant_step(spec, feature, standout, g)
            steps.append(ps)
            for key, layout in ps.layouts.items():
                truth["ties_layout"][f"step{s}.layer{l}.{key}"] = layout
    run_attrs["ground_truth"] = truth
    # Written aside and renamed into place: an --overwrite that fails midway (disk full, Ctrl-C)
    # leaves the old dump as it was, never a half-written one in its place.
    needed = sum(t.numel() * t.element_size() for ps in steps for t in ps.tensors.values())
    with staged_store(out, "out", needed, overwrite=overwrite) as tmp, DumpWriter(tmp, run_attrs) as writer:
        it = iter(steps)
        for s in range(spec.steps):
            for l in range(spec.layers):
                ps = next(it)
                for name, tensor in ps.tensors.items():
                    attrs = {"module": f"synth.layer{l}.attn", "causal": True}
                    writer.write_array(s, l, name, tensor, layer_attrs=attrs)
            writer.complete_step(s)
    return truth


# --------------------------------------------------------------------------------------------
# Check that a dump's planted heads carry the bias (pure; used by tests and the synth command)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlantedCheck:
    """The planted mechanism as the BF16 reference sees it, over every planted (step, layer, batch, head).

    o_bias_*: O_lp - O_hp in the planted feature, per row; delta_*: δ_lp - δ_hp, per row
    (δ = rowsum(dO ∘ O)); feature_rank: rank (1 = largest) of the planted feature by
    Σ_T dO·(O_lp - O_hp) among all head features.
    """

    feature: int
    rows: int
    o_bias_mean: float
    o_bias_se: float
    o_bias_negative_fraction: float
    o_bias_sign_p: float  # one-sided sign test, H1: more negative than positive
    delta_sum: float
    delta_se_of_sum: float
    delta_positive_fraction: float
    delta_sign_p: float  # one-sided sign test, H1: more positive than negative
    feature_rank: int
    top_features: list[int]


def _sign_p(successes: int, n: int) -> float:
    from scipy.stats import binomtest

    return float(binomtest(successes, n, 0.5, alternative="greater").pvalue) if n else 1.0


def check_planted(dump, *, heads: list[int] | None = None) -> PlantedCheck:
    """Recompute O_lp, O_hp with `bf16_reference` from a planted dump's q, k, v and measure the planted bias."""
    truth = dump.ground_truth
    if not truth:
        raise ConfigError(f"{dump.path} has no ground truth; it was not made by `fa-forensics synth`")
    feature = int(truth["planted_feature"])
    heads = heads if heads is not None else list(truth["planted_heads"])
    o_err, d_err, feat = [], [], None
    for s, l, hs in dump.select(heads=heads):
        info = dump.layer_info(s, l)
        q, k, v, do = (dump.read(s, l, n, heads=hs) for n in ("q", "k", "v", "do"))
        o_lp, o_hp = bf16_reference(q, k, v, causal=info.causal, scale=info.scale)
        err = o_lp.double() - o_hp.double()  # (B, h, T, D)
        o_err.append(err[..., feature].flatten())
        d_err.append((do.double() * err).sum(-1).flatten())
        contrib = (do.double() * err).sum(dim=(0, 1, 2))  # (D,)
        feat = contrib if feat is None else feat + contrib
    o = torch.cat(o_err)
    d = torch.cat(d_err)
    n_o = int((o != 0).sum())
    n_d = int((d != 0).sum())
    order = feat.argsort(descending=True).tolist()
    return PlantedCheck(
        feature=feature,
        rows=len(o),
        o_bias_mean=float(o.mean()),
        o_bias_se=float(o.std() / math.sqrt(len(o))),
        o_bias_negative_fraction=float((o < 0).sum() / max(n_o, 1)),
        o_bias_sign_p=_sign_p(int((o < 0).sum()), n_o),
        delta_sum=float(d.sum()),
        delta_se_of_sum=float(d.std() * math.sqrt(len(d))),
        delta_positive_fraction=float((d > 0).sum() / max(n_d, 1)),
        delta_sign_p=_sign_p(int((d > 0).sum()), n_d),
        feature_rank=order.index(feature) + 1,
        top_features=order[:5],
    )
