"""The FP8 P-cast study (paper 002): sink-induced collapse, reverse KV order, and S = 2^8.

An FP8 attention kernel multiplies the fp32 probabilities P̄ = exp(Z − m) by a static scale S,
casts them to E4M3 (round to nearest even: anything below 2^-10 becomes 0) and accumulates
O from the cast values, while ℓ comes from the pre-cast fp32 P̄ and the epilogue is O/(S·ℓ)
(Algorithm 1 of the paper). A strong attention sink raises the running maximum m, so under
forward KV order most non-sink P̄ fall below 2^-10/S and are silently zeroed ("P-collapse").

What lives here (pure functions → frozen dataclasses; no printing, no plotting):
- the E4M3 number line by exhaustive bit enumeration, and dp(S) (the sawtooth of §5.2);
- δ_k = E[max of k standard normals] by numerical integration, and the closed form
  F(Δ, S) = Φ(Δ + δ_k − 10 ln 2 − ln S) (Corollary 2), with its spread-averaged refinement;
- the kernel-faithful simulation (§6.1): `pcast_attention` on fp32 scores and V;
- `simulate`: Table 1, Fig. 2 and Fig. 3 numbers, the S=1 / S=256 MSE ratio, the paired t-test;
- `run`: the same metrics on the real scores of a captured dump, per layer and head.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
from scipy import integrate, stats

from fa_forensics.analyses.stats import PairedTTest, Ratio, mean_se, paired_ratio, paired_ttest
from fa_forensics.errors import InvalidSetting
from fa_forensics.replay.config import KVOrder

ORDERS = tuple(o.value for o in KVOrder)  # the KV iteration orders, as the replay names them


def _pair(m) -> tuple[float, float]:
    """(mean, se) of a stats.MeanSE."""
    return m.value, m.se
E4M3_MAX = 448.0
LN_UNDERFLOW = 10.0 * math.log(2.0)  # 6.93: P̄·S < 2^-10 rounds to 0 in E4M3
DELTA_FIG3 = 7.0  # the sink strength of the paper's sequence-length sweep (Fig. 3)
N_MAIN_DEFAULT = 4096  # the paper's N for Table 1 / Fig. 2


# ---------------------------------------------------------------------------------------------
# E4M3 number line and dp(S)
# ---------------------------------------------------------------------------------------------

def e4m3_positive_values() -> torch.Tensor:
    """All positive finite E4M3 (e4m3fn) values, sorted, from the 256 bit patterns (126 values)."""
    bits = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = bits.view(torch.float8_e4m3fn).to(torch.float64)  # (256,)
    values = values[torch.isfinite(values) & (values > 0)]
    return torch.unique(values)  # sorted


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 `x` to E4M3 (nearest even, saturating at ±448, NaN kept); returns fp32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


@dataclass(frozen=True)
class DpPoint:
    """dp(S) = (largest E4M3 step met by P̄·S for P̄ ∈ [0, 1]) / S (paper Def. 1, Remark 3)."""

    S: float
    dp: float
    lsb: float  # the largest step (in the scaled domain); for S > 448 the saturation step
    bit_exact: bool  # S is a power of two: ×S and ×1/S are exact in fp32 (Prop. 5)


def dp_of_scale(S: float, values: Optional[torch.Tensor] = None) -> DpPoint:
    """dp(S) by exhaustive enumeration of the E4M3 number line.

    For S ≤ 448 the steps that the scaled range [0, S] meets are the gaps [v_i, v_{i+1}) with
    v_i < S (so S = 2^k itself, the first value of the next binade, adds nothing: dp(2^k) = 2^-4).
    For S > 448 the cast saturates: dp = max(32/S, 2(1 − 448/S)) (Remark 3).
    """
    if not S > 0:
        raise InvalidSetting("scales", f"P scale S must be positive, got {S} (e.g. 1,256,448)")
    v = e4m3_positive_values() if values is None else values
    line = torch.cat([torch.zeros(1, dtype=v.dtype), v])  # (127,) 0 and every positive value
    gaps = line[1:] - line[:-1]  # (126,)
    met = gaps[line[:-1] < min(S, E4M3_MAX)]
    lsb = float(met.max())
    dp = lsb / S
    if S > E4M3_MAX:
        saturation_step = 2.0 * (S - E4M3_MAX)
        lsb = max(lsb, saturation_step)
        dp = max(dp, saturation_step / S)
    k = math.log2(S)
    return DpPoint(S=float(S), dp=dp, lsb=lsb, bit_exact=abs(k - round(k)) < 1e-12)


def dp_curve(scales: Iterable[float]) -> tuple[DpPoint, ...]:
    """dp(S) at every S in `scales` (one enumeration of the number line shared by all)."""
    v = e4m3_positive_values()
    return tuple(dp_of_scale(float(s), v) for s in scales)


# ---------------------------------------------------------------------------------------------
# Closed form
# ---------------------------------------------------------------------------------------------

def _max_normal_density(x: float, k: int) -> float:
    """Density of the maximum of k independent standard normals: k φ(x) Φ(x)^(k−1)."""
    return k * stats.norm.pdf(x) * stats.norm.cdf(x) ** (k - 1)


@functools.lru_cache(maxsize=None)
def expected_max_normal(k: int) -> float:
    """δ_k = E[max of k standard normals], by numerical integration (δ_4 ≈ 1.0294)."""
    if k < 1:
        raise InvalidSetting("n_sinks", f"the number of sink tokens must be ≥ 1, got {k}")
    if k == 1:
        return 0.0
    value, _ = integrate.quad(lambda x: x * _max_normal_density(x, k), -np.inf, np.inf)
    return float(value)


@functools.lru_cache(maxsize=None)
def std_max_normal(k: int) -> float:
    """Standard deviation of the maximum of k standard normals (the per-row spread of m)."""
    if k == 1:
        return 1.0
    second, _ = integrate.quad(lambda x: x * x * _max_normal_density(x, k), -np.inf, np.inf)
    return float(math.sqrt(second - expected_max_normal(k) ** 2))


def closed_form_fraction(delta: float, S: float, k: int) -> float:
    """Corollary 2: F(Δ, S) = Φ(Δ + δ_k − 10 ln 2 − ln S), the forward-order zeroed fraction."""
    return float(stats.norm.cdf(delta + expected_max_normal(k) - LN_UNDERFLOW - math.log(S)))


def closed_form_spread(delta: float, S: float, k: int) -> float:
    """E over rows of Φ(Δ + M_k − 10 ln 2 − ln S), M_k the max of k normals (not its mean).

    The paper's form puts the per-row maximum at its mean Δ + δ_k; averaging Φ over the spread
    of M_k instead raises the fraction where Φ is convex (argument < 0) and lowers it where Φ
    is concave (argument > 0).
    """
    shift = delta - LN_UNDERFLOW - math.log(S)
    if k == 1:
        # M_1 ~ N(0, 1): E Φ(shift + Z) = Φ(shift / √2)
        return float(stats.norm.cdf(shift / math.sqrt(2.0)))
    value, _ = integrate.quad(lambda x: stats.norm.cdf(shift + x) * _max_normal_density(x, k), -np.inf, np.inf)
    return float(value)


def closed_form_reverse(delta: float, S: float, k: int, n: int, block: int) -> float:
    """Leading-order zeroed fraction under reverse order (an estimate, not in the paper).

    Blocks before the sink block see a running max of at most E[max of N−k normals] (Eq. 11),
    the non-sink keys of the sink block (B−k of the N−k non-sink keys) see m ≈ max(Δ + δ_k, that).
    """
    c = LN_UNDERFLOW + math.log(S)
    m_pre = expected_max_normal(max(n - k, 1))
    m_sink = max(delta + expected_max_normal(k), m_pre)
    w_sink = max(min(block, n) - k, 0) / max(n - k, 1)
    return float(w_sink * stats.norm.cdf(m_sink - c) + (1 - w_sink) * stats.norm.cdf(m_pre - c))


# ---------------------------------------------------------------------------------------------
# The kernel-faithful FP8 P-cast attention (Algorithm 1)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PcastKernelOut:
    """Output of one FP8-P-cast attention pass and what its cast zeroed."""

    o: torch.Tensor  # (..., q, d) fp32: O / (S·ℓ)
    n_zeroed: torch.Tensor  # (..., q) int64: counted P̄ > 0 before the cast and 0 after
    mass_zeroed: torch.Tensor  # (..., q) fp32: Σ of zeroed P̄ / ℓ (probability silently lost)
    lse: torch.Tensor  # (..., q) fp32: m + ln ℓ


def block_order(n: int, block: int, order: str) -> list[int]:
    """Start index of every KV block, in the order the kernel visits them."""
    if order not in ORDERS:
        raise InvalidSetting("orders", f"unknown KV order '{order}' (forward, reverse)")
    starts = list(range(0, n, block))
    return starts[::-1] if order == "reverse" else starts


def pcast_attention(
    z: torch.Tensor,
    v: torch.Tensor,
    S: float,
    order: str = "forward",
    block: int = 64,
    counted: Optional[torch.Tensor] = None,
) -> PcastKernelOut:
    """Online-softmax attention with the P̄ cast to E4M3 after ×S, exactly as Algorithm 1.

    z: (..., q, N) fp32 scaled scores (−inf where masked); v: (..., N, d) fp32, broadcastable
    against z's leading dims. ℓ accumulates the pre-cast fp32 P̄, O the cast P̄·V in fp32, and
    the epilogue is O/(S·ℓ). `counted` (bool, broadcastable to z, e.g. (N,) "not a sink") picks
    the keys whose zeroing is counted in n_zeroed.
    """
    if block < 1:
        raise InvalidSetting("block", f"block size must be ≥ 1, got {block} (e.g. 64)")
    z = z.to(torch.float32)
    v = v.to(torch.float32)
    n = z.shape[-1]
    n_blocks = -(-n // block)
    pad = n_blocks * block - n
    visit = torch.tensor(block_order(n, block, order)) // block  # (nb,) block indices in visiting order
    # Every block's elementwise work is done at once (the same fp32 operations as the loop of
    # Algorithm 1, in far fewer passes); only the O and ℓ recurrences below loop over blocks.
    z_b = torch.nn.functional.pad(z, (0, pad), value=-math.inf).unflatten(-1, (n_blocks, block))
    z_b = z_b[..., visit, :]  # (..., q, nb, B) in visiting order
    m_new = torch.cummax(z_b.amax(dim=-1), dim=-1).values  # (..., q, nb) running max after each block
    m_old = torch.cat([torch.full_like(m_new[..., :1], -math.inf), m_new[..., :-1]], dim=-1)
    m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # rows fully masked so far
    alpha = torch.exp(m_old - m_safe)  # (..., q, nb) the correction α; 0 while m = −inf
    p = torch.exp(z_b - m_safe[..., None])  # (..., q, nb, B) fp32 P̄
    row_sum = p.sum(dim=-1)  # (..., q, nb) pre-cast Σ P̄ per block
    S32 = torch.tensor(float(S), dtype=torch.float32)
    p_fp8 = cast_e4m3(p * S32)  # the P-cast
    zeroed = (p_fp8 == 0) & (p > 0)
    if counted is not None:
        counted_b = torch.nn.functional.pad(counted.to(torch.bool), (0, pad), value=False)
        zeroed &= counted_b.unflatten(-1, (n_blocks, block))[..., visit, :]
    n_zeroed = zeroed.sum(dim=(-1, -2))  # (..., q)
    zeroed_sum = torch.where(zeroed, p, 0.0).sum(dim=-1)  # (..., q, nb)
    del z_b, p, zeroed
    v_b = torch.nn.functional.pad(v, (0, 0, 0, pad)).unflatten(-2, (n_blocks, block))[..., visit, :, :]  # (..., nb, B, d)
    pv = p_fp8.movedim(-2, -3) @ v_b  # (..., nb, q, d): P̄_fp8 V_j, fp32 accumulate
    del p_fp8
    ell = torch.zeros_like(row_sum[..., 0])  # (..., q)
    ell_zeroed = torch.zeros_like(ell)
    acc = torch.zeros_like(pv[..., 0, :, :])  # (..., q, d) the fp32 accumulator O
    for j in range(n_blocks):
        a_j = alpha[..., j]
        ell = a_j * ell + row_sum[..., j]  # ℓ from the pre-cast P̄
        ell_zeroed = a_j * ell_zeroed + zeroed_sum[..., j]
        acc = a_j[..., None] * acc + pv[..., j, :, :]
    m = m_new[..., -1]
    o = acc / (S32 * ell)[..., None]
    return PcastKernelOut(o=o, n_zeroed=n_zeroed, mass_zeroed=ell_zeroed / ell, lse=m + torch.log(ell))


def reference_attention(z: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax(z)·v in fp64: returns (o (..., q, d), p (..., q, N))."""
    p = torch.softmax(z.to(torch.float64), dim=-1)
    return p @ v.to(torch.float64), p


# ---------------------------------------------------------------------------------------------
# The simulation (paper §6)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimConfig:
    """The kernel-faithful simulation's knobs (paper defaults)."""

    deltas: tuple[float, ...] = tuple(float(d) for d in range(4, 14))
    seqs: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    n_sinks: int = 4
    block: int = 64
    n_queries: int = 32
    head_dim: int = 128
    scales: tuple[float, ...] = (1.0, 256.0, 448.0)
    orders: tuple[str, ...] = ORDERS
    n_seeds: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.deltas:
            raise InvalidSetting("deltas", "no sink strength given (e.g. 4,5,6,7,8)")
        if not self.seqs or min(self.seqs) < 1:
            raise InvalidSetting("seqs", f"sequence lengths must be ≥ 1, got {list(self.seqs)} (e.g. 4096)")
        if min(self.seqs) <= self.n_sinks:
            raise InvalidSetting("seqs", f"every sequence length must exceed the {self.n_sinks} sink tokens, got {min(self.seqs)}")
        if self.n_sinks < 1:
            raise InvalidSetting("n_sinks", f"must be ≥ 1, got {self.n_sinks}")
        if self.block < 1 or self.n_queries < 1 or self.head_dim < 1:
            raise InvalidSetting("block", f"block, queries and head dimension must be ≥ 1, got {self.block}, {self.n_queries}, {self.head_dim}")
        if self.n_seeds < 1:
            raise InvalidSetting("n_seeds", f"must be ≥ 1, got {self.n_seeds}")
        if not self.scales or min(self.scales) <= 0:
            raise InvalidSetting("scales", f"P scales must be positive, got {list(self.scales)} (e.g. 1,256,448)")
        for o in self.orders:
            if o not in ORDERS:
                raise InvalidSetting("orders", f"unknown KV order '{o}' (forward, reverse)")

    @property
    def n_main(self) -> int:
        """N of the Δ sweep (Table 1, Fig. 2): 4096 when listed, else the largest listed N."""
        return N_MAIN_DEFAULT if N_MAIN_DEFAULT in self.seqs else max(self.seqs)


@dataclass(frozen=True)
class PcastRow:
    """One (Δ, S, order, N) cell: the measured collapse, the closed form and the output MSE."""

    delta: float
    S: float
    order: str
    seq: int
    frac_zeroed: float  # fraction of non-sink P̄ zeroed by the cast (mean over seeds)
    frac_zeroed_se: float
    closed_form: float  # forward: Φ(Δ + δ_k − 10 ln 2 − ln S); reverse: the leading-order estimate
    closed_form_spread: float  # forward: Φ averaged over the per-row max's spread; reverse: = closed_form
    nonsink_mass: float  # exact softmax mass on non-sink keys (mean over rows)
    info_loss: float  # nonsink_mass × frac_zeroed (the paper's "effective information loss")
    mass_zeroed: float  # measured: Σ zeroed P̄ / ℓ (mean over rows)
    mse: float  # mean over seeds of the per-seed MSE of O against the fp64 reference
    mse_se: float
    mse_per_seed: tuple[float, ...]  # the paired instances of the t-test and the ratio
    explanation: Optional[str]  # why measured and closed form differ (None when within 0.02)


@dataclass(frozen=True)
class PcastSimResult:
    """Everything the simulation measured, plus the closed-form inputs."""

    config: SimConfig
    delta_k: float  # E[max of k standard normals], integrated
    sigma_k: float  # its standard deviation
    n_main: int
    rows: tuple[PcastRow, ...]
    dp: tuple[DpPoint, ...]
    ratio: Optional[Ratio]  # MSE forward S=1 / forward S=256 at Δ = 7, N = n_main
    ratio_448: Optional[Ratio]  # MSE forward S=448 / forward S=256 at Δ = 7, N = n_main
    ttest: tuple[PairedTTest, ...]  # forward+S=256 vs reverse+S=256 at every Δ, N = n_main
    notes: tuple[str, ...] = field(default_factory=tuple)

    def row(self, delta: float, S: float, order: str, seq: Optional[int] = None) -> Optional[PcastRow]:
        """The row for (Δ, S, order, N) (N defaults to n_main), or None."""
        seq = self.n_main if seq is None else seq
        for r in self.rows:
            if r.delta == delta and r.S == S and r.order == order and r.seq == seq:
                return r
        return None


DP_SCALES_LISTED = (3.0, 100.0, 250.0, 300.0, 448.0)  # the non-power-of-two S of App. A


def default_dp_scales(user_scales: Sequence[float] = ()) -> tuple[float, ...]:
    """S for the dp table: 2^0..2^9, App. A's non-power-of-two list, and the user's scales."""
    return tuple(sorted(set([2.0 ** k for k in range(10)] + list(DP_SCALES_LISTED) + [float(s) for s in user_scales])))


def _generator(*key: int) -> torch.Generator:
    """A torch generator seeded from a tuple of ints (independent streams per seed and N)."""
    state = int(np.random.SeedSequence([abs(int(x)) for x in key]).generate_state(1)[0])
    return torch.Generator().manual_seed(state)


def _instances(cfg: SimConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per seed: non-sink scores noise (seeds, q, N) and V (seeds, N, d), all N(0, 1), fp32."""
    noise, values = [], []
    for s in range(cfg.n_seeds):
        g = _generator(cfg.seed, s, n)
        noise.append(torch.randn(cfg.n_queries, n, generator=g))
        values.append(torch.randn(n, cfg.head_dim, generator=g))
    return torch.stack(noise), torch.stack(values)


def _explain(delta: float, S: float, order: str, n: int, k: int, measured: float, closed: float,
             spread: float, sigma_k: float) -> Optional[str]:
    """One sentence on why the measured fraction differs from the closed form (None if it does not)."""
    if abs(measured - closed) <= 0.02:
        return None
    if order == "reverse":
        return (f"reverse estimate assumes the pre-sink running max sits at E[max of N−k normals] "
                f"({expected_max_normal(max(n - k, 1)):.2f}); early blocks see a lower max, so the measured "
                f"fraction is {'above' if measured > closed else 'below'} it")
    x = delta + expected_max_normal(k) - LN_UNDERFLOW - math.log(S)
    parts = []
    m_ordinary = expected_max_normal(max(n - k, 1))
    if delta + expected_max_normal(k) < m_ordinary + 1.0 and measured > closed:
        parts.append(f"the sink (Δ+δ_k = {delta + expected_max_normal(k):.2f}) barely exceeds the largest "
                     f"ordinary score (≈{m_ordinary:.2f} for N = {n}), so the running max is often set by "
                     f"non-sink keys and lies above Δ+δ_k")
    side = ("convex (argument < 0): averaging raises the fraction" if x < 0
            else "concave (argument > 0): averaging lowers the fraction")
    parts.append(f"the per-row max Δ+max(k normals) spreads by σ = {sigma_k:.2f} around Δ+δ_k and Φ is {side}; "
                 f"the spread-averaged form gives {spread:.3f}")
    return "; ".join(parts)


def simulate(cfg: SimConfig) -> PcastSimResult:
    """Run the kernel-faithful simulation: the Δ sweep at n_main and the N sweep at Δ = 7.

    Instances (seeds) share their noise across Δ, S and order (common random numbers), so
    configurations are compared pairwise. Vectorized over Δ, seeds and queries; the only
    Python loop is over KV blocks.
    """
    k = cfg.n_sinks
    delta_k = expected_max_normal(k)
    sigma_k = std_max_normal(k)
    n_main = cfg.n_main
    rows: list[PcastRow] = []
    for n in sorted(set(cfg.seqs)):
        deltas = sorted(set(cfg.deltas) | {DELTA_FIG3}) if n == n_main else [DELTA_FIG3]
        noise, v = _instances(cfg, n)  # (seeds, q, N), (seeds, N, d)
        is_sink = torch.arange(n) < k  # (N,)
        delta_t = torch.tensor(deltas, dtype=torch.float32)[:, None, None, None]  # (nΔ, 1, 1, 1)
        z = noise[None] + delta_t * is_sink.to(torch.float32)  # (nΔ, seeds, q, N)
        o_ref, p_ref = reference_attention(z, v)  # (nΔ, seeds, q, d), (nΔ, seeds, q, N)
        nonsink_mass = p_ref[..., k:].sum(dim=-1).mean(dim=(-1, -2))  # (nΔ,)
        del p_ref
        for order in cfg.orders:
            for S in cfg.scales:
                out = pcast_attention(z, v, S, order, cfg.block, counted=~is_sink)
                mse = ((out.o.double() - o_ref) ** 2).mean(dim=(-1, -2))  # (nΔ, seeds)
                frac = out.n_zeroed.double().sum(dim=-1) / (cfg.n_queries * (n - k))  # (nΔ, seeds)
                lost = out.mass_zeroed.double().mean(dim=(-1, -2))  # (nΔ,)
                for i, delta in enumerate(deltas):
                    f_mean, f_se = _pair(mean_se(frac[i].numpy()))
                    e_mean, e_se = _pair(mean_se(mse[i].numpy()))
                    if order == "forward":
                        closed = closed_form_fraction(delta, S, k)
                        spread = closed_form_spread(delta, S, k)
                    else:
                        closed = spread = closed_form_reverse(delta, S, k, n, cfg.block)
                    rows.append(PcastRow(
                        delta=float(delta), S=float(S), order=order, seq=int(n),
                        frac_zeroed=f_mean, frac_zeroed_se=f_se, closed_form=closed, closed_form_spread=spread,
                        nonsink_mass=float(nonsink_mass[i]), info_loss=float(nonsink_mass[i]) * f_mean,
                        mass_zeroed=float(lost[i]), mse=e_mean, mse_se=e_se,
                        mse_per_seed=tuple(float(x) for x in mse[i].tolist()),
                        explanation=_explain(delta, S, order, n, k, f_mean, closed, spread, sigma_k),
                    ))
    result = PcastSimResult(config=cfg, delta_k=delta_k, sigma_k=sigma_k, n_main=n_main, rows=tuple(rows),
                            dp=dp_curve(default_dp_scales(cfg.scales)), ratio=None, ratio_448=None, ttest=())
    return _with_comparisons(result)


def _with_comparisons(res: PcastSimResult) -> PcastSimResult:
    """Add the headline ratios and the paired t-tests to a result (where their rows exist)."""
    def per_seed(delta: float, S: float, order: str) -> Optional[np.ndarray]:
        r = res.row(delta, S, order)
        return None if r is None else np.array(r.mse_per_seed)

    n = res.n_main
    a1, a256, a448 = (per_seed(DELTA_FIG3, S, "forward") for S in (1.0, 256.0, 448.0))
    ratio = paired_ratio(a1, a256, "forward S=1", "forward S=256", DELTA_FIG3, n) if a1 is not None and a256 is not None else None
    ratio_448 = paired_ratio(a448, a256, "forward S=448", "forward S=256", DELTA_FIG3, n) if a448 is not None and a256 is not None else None
    tests = []
    deltas = sorted({r.delta for r in res.rows if r.seq == n})
    for delta in deltas:
        f, r = per_seed(delta, 256.0, "forward"), per_seed(delta, 256.0, "reverse")
        if f is not None and r is not None:
            tests.append(paired_ttest(f, r, "forward S=256", "reverse S=256", delta, n))
    notes = []
    if ratio is None:
        notes.append("the S=1 / S=256 ratio needs --scales with 1 and 256 and --order with forward")
    if not tests:
        notes.append("the paired t-test needs --scales with 256 and --order forward,reverse")
    if res.config.n_seeds < 20:
        notes.append(f"{res.config.n_seeds} seeds: the paper used 20 (sweeps) and 100 (t-tests); raise --seeds for tighter errors")
    return PcastSimResult(config=res.config, delta_k=res.delta_k, sigma_k=res.sigma_k, n_main=n, rows=res.rows,
                          dp=res.dp, ratio=ratio, ratio_448=ratio_448, ttest=tuple(tests), notes=tuple(notes))


def dp_sawtooth(s_min: float = 1.0, s_max: float = 600.0, n: int = 1500) -> tuple[DpPoint, ...]:
    """dp(S) on a dense log grid plus every power of two in range (for the Fig. 1 curve)."""
    grid = set(np.geomspace(s_min, s_max, n).tolist())
    k = math.ceil(math.log2(s_min))
    while 2.0 ** k <= s_max:
        grid.add(2.0 ** k)
        k += 1
    grid |= {s for s in DP_SCALES_LISTED if s_min <= s <= s_max}
    return dp_curve(sorted(grid))


# ---------------------------------------------------------------------------------------------
# Dump mode: the same metrics on a captured head's real scores
# ---------------------------------------------------------------------------------------------

MIN_NONSINK_KEYS = 16  # rows with fewer non-sink keys give no sink-strength estimate
FIX_MSE_RATIO = 1.2  # a head "needs a fix" when forward S=1 is this much worse than the best setting
FIX_MASS_ZEROED = 0.005  # ... or its cast silently drops this fraction of the probability mass


@dataclass(frozen=True)
class HeadSetting:
    """One (S, order) setting on one head's real scores."""

    S: float
    order: str
    frac_zeroed: float  # zeroed non-sink P̄ / all non-sink (unmasked) P̄
    mass_zeroed: float  # mean over rows of Σ zeroed P̄ / ℓ
    closed_form: Optional[float]  # forward: Φ((gap − 10 ln 2 − ln S)/σ) from the measured gap; reverse: None
    mse: float  # mean over query rows of the per-row MSE of O against fp64 (V as captured)
    mse_se: float


@dataclass(frozen=True)
class HeadPcast:
    """The P-cast study on one captured head, with its recommendation."""

    step: int
    layer: int
    head: int
    rows: int  # query rows (batch × T)
    sink_gap: float  # mean over rows of (max score of the first k keys − mean non-sink score) / sd, in sd
    sink_gap_se: float
    sink_strength: float  # sink_gap − δ_k: the paper's Δ (sinks at Δ + N(0,1) have max Δ + δ_k)
    sink_gap_logits: float  # the same gap in natural-log units (what the 2^-10/S threshold sees)
    score_sd: float  # mean over rows of the non-sink score standard deviation (natural-log units)
    settings: tuple[HeadSetting, ...]
    needs_fix: bool
    recommended_S: float
    recommended_order: str
    recommendation: str

    def setting(self, S: float, order: str) -> Optional[HeadSetting]:
        return next((s for s in self.settings if s.S == S and s.order == order), None)


@dataclass(frozen=True)
class PcastDumpResult:
    """Per-head P-cast metrics of a dump."""

    path: str
    n_sinks: int
    block: int
    delta_k: float
    scales: tuple[float, ...]
    orders: tuple[str, ...]
    heads: tuple[HeadPcast, ...]
    dp: tuple[DpPoint, ...] = ()  # dp(S) at the studied scales and the defaults
    warnings: tuple[str, ...] = ()
    replay_fidelity: Optional[dict] = None  # the study casts the dump's own scores: no recipe is replayed


def sink_gap_stats(z: torch.Tensor, allowed: torch.Tensor, k: int) -> tuple[float, float, float, float]:
    """Sink gap of a head from its scores: (gap in sd, its se over rows, gap in logits, mean sd).

    z (R, T) scores; allowed (R, T) bool. Per row with ≥ MIN_NONSINK_KEYS non-sink keys:
    gap = max over the first k keys − mean of the non-sink keys, and their sd.
    """
    nonsink = allowed.clone()
    nonsink[:, :k] = False
    sink = allowed.clone()
    sink[:, k:] = False
    n_ns = nonsink.sum(dim=-1)  # (R,)
    ok = (n_ns >= MIN_NONSINK_KEYS) & sink.any(dim=-1)
    if not bool(ok.any()):
        nan = float("nan")
        return nan, nan, nan, nan
    z64 = z.double()
    mu = torch.where(nonsink, z64, 0.0).sum(-1) / n_ns.clamp(min=1)
    var = torch.where(nonsink, (z64 - mu[:, None]) ** 2, 0.0).sum(-1) / (n_ns - 1).clamp(min=1)
    sd = var.sqrt()
    top = torch.where(sink, z64, -math.inf).amax(dim=-1)
    gap = (top - mu)[ok]
    gap_sd = gap / sd[ok].clamp(min=1e-12)
    g_mean, g_se = _pair(mean_se(gap_sd.numpy()))
    return g_mean, g_se, float(gap.mean()), float(sd[ok].mean())


def _recommend(settings: Sequence[HeadSetting]) -> tuple[bool, float, str, str]:
    """(needs_fix, S, order, one-line reason) from a head's settings.

    Among the settings within max(2 %, 2 se) of the best MSE, prefer S = 256 (bit-exact, smallest
    dp), then any other power of two, then forward order (no kernel change), then the lower MSE.
    """
    best = min(settings, key=lambda s: s.mse)
    tol = max(0.02 * best.mse, 2.0 * (best.mse_se if math.isfinite(best.mse_se) else 0.0))
    good = [s for s in settings if s.mse <= best.mse + tol]
    pick = min(good, key=lambda s: (s.S != 256.0, not math.log2(s.S).is_integer(), s.order != "forward", s.mse))
    base = next((s for s in settings if s.S == 1.0 and s.order == "forward"), None)
    if base is None:
        base = max(settings, key=lambda s: s.frac_zeroed)
    ratio = base.mse / best.mse if best.mse > 0 else float("inf")
    needs = base.mass_zeroed > FIX_MASS_ZEROED or ratio > FIX_MSE_RATIO
    label = f"{base.order} S={base.S:g}"
    if needs:
        rev = next((s for s in settings if s.S == base.S and s.order != base.order), None)
        alt = f"; reverse order alone gives ×{rev.mse / best.mse:.2f}" if rev is not None and base.order == "forward" else ""
        reason = (f"{label} zeroes {base.frac_zeroed:.1%} of non-sink P̄, {base.mass_zeroed:.2%} of the probability "
                  f"mass (MSE ×{ratio:.2f} of the best): "
                  f"use {pick.order} S={pick.S:g}{alt}")
    else:
        reason = (f"no harmful collapse ({label} zeroes {base.frac_zeroed:.1%} of non-sink P̄, "
                  f"{base.mass_zeroed:.2%} of the mass, MSE ×{ratio:.2f} of the best); " + (
                      f"{pick.order} S={pick.S:g} has the lowest MSE" if pick is best else
                      f"{pick.order} S={pick.S:g} is within {pick.mse / best.mse - 1:.1%} of the best ({best.order} S={best.S:g})"))
    return needs, pick.S, pick.order, reason


def analyze_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                 n_sinks: int = 4, block: int = 64, scales: Sequence[float] = (1.0, 256.0, 448.0),
                 orders: Sequence[str] = ORDERS, where: tuple[int, int, int] = (0, 0, 0)) -> HeadPcast:
    """The P-cast study on one head: q, k, v (B, T, D) as captured (any float dtype; used in fp32).

    Scores are scale·Q Kᵀ in fp32 (Q, K, V kept in fp32 to isolate the P cast, as in §6.1).
    """
    q32, k32, v32 = q.to(torch.float32), k.to(torch.float32), v.to(torch.float32)
    B, T, _ = q32.shape
    z = scale * (q32 @ k32.transpose(-1, -2))  # (B, T, T) fp32
    allowed = torch.ones(T, T, dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    z = z.masked_fill(~allowed, -math.inf)
    counted = allowed.clone()
    counted[:, :n_sinks] = False  # (T, T): non-sink keys the row can see
    n_counted = int(counted.sum()) * B
    o_ref, _ = reference_attention(z, v32)  # (B, T, D) fp64
    gap, gap_se, gap_logits, sd = sink_gap_stats(z.reshape(B * T, T), allowed.repeat(B, 1), n_sinks)
    settings = []
    for order in orders:
        for S in scales:
            out = pcast_attention(z, v32, S, order, block, counted=counted)
            row_mse = ((out.o.double() - o_ref) ** 2).mean(dim=-1).reshape(-1)  # (B·T,)
            mse, mse_se = _pair(mean_se(row_mse.numpy()))
            closed = None
            if order == "forward" and math.isfinite(gap_logits) and sd > 0:
                closed = float(stats.norm.cdf((gap_logits - LN_UNDERFLOW - math.log(S)) / sd))
            settings.append(HeadSetting(
                S=float(S), order=order,
                frac_zeroed=float(out.n_zeroed.sum()) / max(n_counted, 1),
                mass_zeroed=float(out.mass_zeroed.double().mean()),
                closed_form=closed, mse=mse, mse_se=mse_se,
            ))
    needs, rec_S, rec_order, reason = _recommend(settings)
    step, layer, head = where
    return HeadPcast(step=step, layer=layer, head=head, rows=B * T, sink_gap=gap, sink_gap_se=gap_se,
                     sink_strength=gap - expected_max_normal(n_sinks), sink_gap_logits=gap_logits, score_sd=sd,
                     settings=tuple(settings), needs_fix=needs, recommended_S=rec_S,
                     recommended_order=rec_order, recommendation=reason)


def run(dump, selections, *, n_sinks: int = 4, block: int = 64, scales: Sequence[float] = (1.0, 256.0, 448.0),
        orders: Sequence[str] = ORDERS) -> PcastDumpResult:
    """`analyze_head` for every head of every `LayerSelection` (from `selection.select`)."""
    from fa_forensics.analyses.selection import load

    if n_sinks < 1 or block < 1:
        raise InvalidSetting("n_sinks", f"sink tokens and block must be ≥ 1, got {n_sinks}, {block}")
    heads, warnings = [], []
    for sel in selections:
        t = load(dump, sel)
        warnings.extend(w for w in t.warnings if w not in warnings)
        for j, h in enumerate(sel.heads):
            q, k, v = (x[:, j] for x in (t.q, t.k, t.v))  # (B, T, D)
            heads.append(analyze_head(q, k, v, scale=t.scale, causal=t.causal, n_sinks=n_sinks, block=block,
                                      scales=scales, orders=orders, where=(sel.step, sel.layer, h)))
    return PcastDumpResult(path=str(dump.path), n_sinks=n_sinks, block=block, delta_k=expected_max_normal(n_sinks),
                           scales=tuple(float(s) for s in scales), orders=tuple(orders), heads=tuple(heads),
                           dp=dp_curve(default_dp_scales(scales)), warnings=tuple(warnings))


def verdict(res: PcastDumpResult) -> str:
    """One sentence: how many heads need another S or KV order, and the first of them."""
    need = [h for h in res.heads if h.needs_fix]
    if not need:
        return f"no head of {len(res.heads)} needs a P-cast fix at the default S = 1, forward order"
    h = need[0]
    return (f"{len(need)} of {len(res.heads)} heads need a P-cast fix; e.g. step {h.step} layer {h.layer} head {h.head}: "
            f"{h.recommended_order} S={h.recommended_S:g}")


def payload(res: PcastDumpResult) -> dict:
    """The --json payload of the dump mode (keys documented in the README)."""
    return {
        "mode": "dump", "dump": res.path, "n_sinks": res.n_sinks, "block": res.block, "delta_k": res.delta_k,
        "scales": list(res.scales), "orders": list(res.orders), "heads": list(res.heads),
        "dp": [{"S": p.S, "dp": p.dp, "lsb": p.lsb, "bit_exact": p.bit_exact} for p in res.dp],
        "warnings": list(res.warnings), "replay_fidelity": res.replay_fidelity, "verdict": verdict(res),
    }
