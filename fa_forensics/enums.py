"""The words every layer shares, defined once: the str-enums of a replay's knobs, where a replay runs,
and the preset name `auto`.

Each value is the spelling the CLI, the JSON and the dump attributes use; the knobs' meaning is
documented where they are used (replay/config.py's ReplayConfig). The preset names themselves are the
keys of replay/config.py's PRESETS (every list of presets is derived from it).
"""
from __future__ import annotations

import enum

AUTO = "auto"  # the preset (and accumulation) decided per layer-step by matching the stored O


class Precision(str, enum.Enum):
    """A floating-point format a tensor is held in or cast to."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8_E4M3 = "fp8_e4m3"  # e4m3fn: no infinities, saturates at ±448 in the casts we model
    FP8_E5M2 = "fp8_e5m2"


class Rounding(str, enum.Enum):
    """Rounding of the P̄ and O casts."""

    NEAREST_EVEN = "nearest-even"  # what the hardware does
    STOCHASTIC = "stochastic"  # the blog's principled fix (seeded)


class Softmax(str, enum.Enum):
    """Which row-wise shift m is used in P̄ = exp(S - m)."""

    STANDARD = "standard"  # m = running row max
    STABILIZED = "stabilized"  # the paper's Algorithm 3 (β, ε)
    FIXED_OFFSET = "fixed-offset"  # m = row max + offset: App. C's rejected alternative


class KVOrder(str, enum.Enum):
    """Direction in which KV blocks are visited by the forward kernel."""

    FORWARD = "forward"
    REVERSE = "reverse"


class DeltaSource(str, enum.Enum):
    """How the backward pass computes δ (paper §3.2's isolation experiments)."""

    O_LOWP = "o-lowp"  # rowsum(dO ∘ O_lp): O as stored by the forward pass (standard FA2)
    O_HIGHP = "o-highp"  # rowsum(dO ∘ O_hp): O computed entirely in fp32 in the forward pass
    O_RECOMPUTED = "o-recomputed"  # O recomputed in the backward as P̄V / ℓ in fp32
    DP_P = "dp-p"  # rowsum(dP ∘ P), dP = dO Vᵀ: the mathematically equal form without O


class MaskedBlocks(str, enum.Enum):
    """What the forward loop does with a KV block that a row cannot see at all (causal mask)."""

    SKIP = "skip"  # kernels stop at the diagonal: the block leaves m, ℓ and acc untouched
    # the reference code's loop: every block is visited, masked scores are -finfo(s_dtype).max
    # (not -inf), so under the stabilized rule a fully masked block is a "repeated maximum" whose
    # shift is 0: rows with a negative running max get m = 0 and ℓ, acc rescaled
    VISIT = "visit"


class ExpForm(str, enum.Enum):
    """How a kernel forms P̄ and the rescale factor from the raw scores S = q kᵀ (each a single fp32 rounding
    per named operation; exp and exp2 as ExpUnit says)."""

    EXP = "exp"  # s = fp32(S·α), P̄ = exp(fp32(s − m)), rescale exp(fp32(m_prev − m)), m the max of s
    # FlashAttention-2 as published: m the max of raw S, c = fp32(α·log2 e) (host, in double), P̄ =
    # exp2(fma(S, c, −fp32(m·c))) with one rounding, rescale exp2(fp32(fp32(m_prev − m)·c))
    EXP2_FMA = "exp2-fma"
    # PyTorch's vendored FlashAttention-2 (compiled with UNFUSE_FMA): P̄ = exp2(fp32(fp32(S·c) − fp32(m·c)))
    EXP2_MUL = "exp2-mul"
    # the memory-efficient kernel (iterative_softmax): scores scaled once, s = fp32(S·c), m = max s,
    # P̄ = exp2(fp32(s − m)) and the rescale exp2(fp32(m_prev − m)), both in the scaled domain
    EXP2_SCALED = "exp2-scaled"
    # the memory-efficient kernel as PyTorch builds it (kSupportsBias): S·α first, then × fp32(log2 e), two
    # roundings, s = fp32(fp32(S·α)·fp32(log2 e)); m, P̄ and the rescale as exp2-scaled
    EXP2_SCALED_TWICE = "exp2-scaled-twice"


class ExpUnit(str, enum.Enum):
    """Which exponentials and logs the base-2 kernel models (exp_form exp2-*) evaluate: their 2^x, the log of their
    lse, the exp and log of FlashAttention-2's split-KV combine and the exp of the kernels' backward."""

    CORRECTLY_ROUNDED = "correctly-rounded"  # 2^x rounded once to fp32 (numerics.exp2_fp32)
    # the GPU's special function unit as sm_90 computes ex2.approx.ftz / exp2f (numerics.sfu, tabulated on an H200)
    SFU_SM90 = "sfu-sm90"


class RowSum(str, enum.Enum):
    """How the row sum ℓ is accumulated over a block's P̄ (pre-cast fp32 values)."""

    EXACT = "exact"  # summed exactly, rounded once per block: ℓ = fp32(fp32(α·ℓ) + Σ P̄)
    # FlashAttention-2's register layout: 4 threads share a row, thread q holds columns 8t + 2q + {0, 1}
    # of each 8-column MMA tile and adds them in column order into its own fp32 partial, rescaled with
    # the row and carried across KV blocks; one all-reduce at the end: (ℓ₀ + ℓ₂) + (ℓ₁ + ℓ₃)
    MMA_LANES = "mma-lanes"
    # cuDNN on sm_90 (closed source; the order that reproduces its recorded lse and O): the same four threads, each
    # summing its block's columns 8t + 2q + {0, 1} in column order from 0 and folding the sum into its carried
    # partial with one fused multiply-add, fma(α, ℓ_q, s_q); the epilogue reduces (ℓ₀ + ℓ₁) + (ℓ₂ + ℓ₃)
    LANES_FMA = "lanes-fma"
    # the memory-efficient (CUTLASS) kernel: per block, each 32-key warp tile's P̄ summed per thread (keys
    # 8t + 2q + {0, 1} in order), the quad reduced as (s₀ + s₁) + (s₂ + s₃), the warp tiles then added to fp32(α·ℓ)
    # one by one in key order
    CUTLASS_WARPS = "cutlass-warps"


class LseForm(str, enum.Enum):
    """How a base-2 kernel writes its lse (natural log) from its raw row max m (m_s once scaled) and row sum ℓ."""

    FMA_NATURAL = "fma-natural"  # fma(m, α, __logf ℓ): FlashAttention-2 (softmax.h)
    SCALED_DIV = "scaled-div"  # fp32(m_s / log2 e) + logf ℓ: the memory-efficient kernel's epilogue
    SCALED_FMA = "scaled-fma"  # fma(m_s, ln 2, __logf ℓ): cuDNN (closed source: the form its bits fit best)


class Normalize(str, enum.Enum):
    """How the epilogue applies 1/ℓ to the accumulator."""

    DIVIDE = "divide"  # O = fp32(acc / ℓ)
    RECIPROCAL = "reciprocal"  # O = fp32(acc · fp32(1 / ℓ)) (FlashAttention-2, memory-efficient)


class Accumulation(str, enum.Enum):
    """Accumulation model of every matrix product."""

    IEEE = "ieee"  # exact products, fp32 additions in sequential order, one rounding each
    TENSOR_CORE = "tensor-core"  # Khattak & Mikaitis model: groups of F, truncating alignment, RZ


class PScaleMode(str, enum.Enum):
    """How the fp8 P scale S is applied (they give different bits)."""

    EXPONENT_OFFSET = "exponent-offset"  # FlashAttention-3: exp2(s - m + log2 S)
    MULTIPLY = "multiply"  # FlashInfer: exp2(s - m) * S


class GPUModel(str, enum.Enum):
    """Which tensor-core parameters the tensor-core accumulation model uses."""

    H100 = "h100"  # bf16/fp16: F = 16, neab = 2; fp8: F = 32, neab = -10
    A100 = "a100"  # bf16/fp16: F = 8, neab = 1


class BackwardKernel(str, enum.Enum):
    """Which kernel's backward the emulator models (each model and its source: replay/emulate/backward_kernels.py)."""

    REFERENCE = "reference"  # the emulator's FA2 contract (replay/emulate/backward.py): every knob above applies
    FLASH_ATTENTION_2 = "flash-attention-2"  # Dao-AILab FlashAttention-2 (SDPA's FLASH_ATTENTION backend), sm80 code
    SDPA_CUDNN = "sdpa-cudnn"  # SDPA's CUDNN_ATTENTION backend (cuDNN 9 fused flash attention, sm_90)
    SDPA_EFFICIENT = "sdpa-efficient"  # SDPA's EFFICIENT_ATTENTION backend (the xformers / CUTLASS kernel)


class Backend(str, enum.Enum):
    """Where a replay runs."""

    EMULATE = "emulate"  # the CPU reference emulator
    TRITON = "triton"  # the GPU kernels


BACKENDS = tuple(b.value for b in Backend)
ACCUMULATIONS = tuple(a.value for a in Accumulation)

# The values of --accumulation: a model, or `auto` (the model of the preset `match` found), derived from
# Accumulation so that the CLI's choices cannot drift from the models.
AccumulationOrAuto = enum.Enum("AccumulationOrAuto", [(a.name, a.value) for a in Accumulation] + [("AUTO", AUTO)],
                               type=str)


class Engine(str, enum.Enum):
    """Which implementation runs the CPU emulator's arithmetic; every engine gives the spec's bits
    (what each covers and when it falls back: numerics/engines.py)."""

    SPEC = "spec"  # the torch code: the readable specification, runs every input
    COMPILED = "compiled"  # numba kernels where their domain holds, the spec elsewhere (the default)


ENGINES = tuple(e.value for e in Engine)
