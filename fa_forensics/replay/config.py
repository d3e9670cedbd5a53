"""ReplayConfig: every knob the papers turn, as one frozen dataclass.

Semantics follow the hardware: products of bf16 / fp16 / fp8 inputs are exact in fp32 and
accumulate in fp32 (or in the tensor-core model); rounding happens only at the explicit casts
named here. The defaults (preset "bf16") mix two readings: scores, row max m and row sum ℓ in
fp32 as hardware kernels keep them, and the P̄ cast and bf16 P̄V product of the paper's
pure-PyTorch reference code under BF16 autocast; O stored in bf16, fp32 backward. It is neither
kernel exactly: the reference code as run is preset "bf16-autocast" (forward),
"bf16-autocast-train" (forward and backward) and "bf16-autocast-stabilized" (its fix, STABLE=1).
`fa-forensics match` measures which recipe reproduces a dump's stored O.

Never mutate a config: derive one with `dataclasses.replace(cfg, ...)` or `cfg.with_(...)`.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Optional

from fa_forensics.enums import (
    Accumulation,
    BackwardKernel,
    DeltaSource,
    ExpForm,
    ExpUnit,
    GPUModel,
    KVOrder,
    LseForm,
    MaskedBlocks,
    Normalize,
    Precision,
    PScaleMode,
    Rounding,
    RowSum,
    Softmax,
)
from fa_forensics.errors import ConfigError
from fa_forensics.replay.plain_recipe import PlainRecipe, hf_eager


_LOW_PRECISION = {Precision.BF16, Precision.FP16, Precision.FP8_E4M3, Precision.FP8_E5M2}


@dataclass(frozen=True)
class ReplayConfig:
    """Every knob of one attention replay. Field defaults = preset "bf16" (see the module docstring)."""

    # dtypes: inputs, the P̄ cast before P̄V, the P̄V product (and running O accumulator), O as stored
    input_dtype: Precision = Precision.BF16
    p_dtype: Precision = Precision.BF16
    pv_dtype: Precision = Precision.BF16
    o_dtype: Precision = Precision.BF16
    # the autocast reference's low-precision intermediates (fp32 = hardware kernels):
    # s_dtype: the scaled scores, rounded after S = q kᵀ and again after × α (and s − m computed
    # in the promoted dtype of s and m, as PyTorch does); stats_dtype: the running row max m and
    # row sum ℓ, stored in it after every block update; rescale_dtype: the running accumulator
    # rounded to it after × exp(m_prev − m_new), before the block's P̄V is added (oc.mul_ on a
    # bf16 buffer)
    s_dtype: Precision = Precision.FP32
    stats_dtype: Precision = Precision.FP32
    rescale_dtype: Precision = Precision.FP32
    # exp_dtype: what exp and the row-sum update return in the autocast reference. fp32: CUDA
    # autocast runs exp and sum in fp32 (and kernels keep them there); bf16: CPU autocast leaves
    # them in bf16: P̄ and α rounded after exp, rowsum(P̄) of the rounded P̄ rounded, α·ℓ rounded
    exp_dtype: Precision = Precision.FP32
    # fp8 P scale S: P̄ is multiplied by S before its cast, O divided by S·ℓ in the epilogue
    p_scale: float = 1.0
    p_scale_mode: PScaleMode = PScaleMode.EXPONENT_OFFSET
    # tiling: None = no tiling (block = the whole sequence)
    block_m: Optional[int] = None
    block_n: Optional[int] = None
    kv_order: KVOrder = KVOrder.FORWARD
    masked_blocks: MaskedBlocks = MaskedBlocks.SKIP
    # each block's row sum Σ_t P̄ is clamped from below at this value before it enters ℓ (the
    # reference code's `.clamp(min=1e-10)`; it matters only when ℓ is tiny, e.g. a stabilized
    # shift above the row max or a row rescaled by a fully masked block)
    row_sum_floor: float = 0.0
    causal: Optional[bool] = None  # None = take it from the dump / caller
    scale: Optional[float] = None  # softmax scale α; None = from the dump, else 1/sqrt(D)
    # soft-cap of the scaled scores, s = cap·tanh(S·α / cap) before the mask (Gemma 2, FlashAttention-2's
    # softcap; replay/emulate/softcap.py); None = no cap, else from the dump's `softcap` fact where it has one
    softcap: Optional[float] = None
    # softmax shift
    softmax: Softmax = Softmax.STANDARD
    beta: float = 2.0
    eps: float = 1e-3
    offset: float = 0.0  # only for Softmax.FIXED_OFFSET: m = rowmax + offset
    # rounding of the P̄ and O casts
    rounding: Rounding = Rounding.NEAREST_EVEN
    seed: int = 0  # for stochastic rounding
    # backward
    delta: DeltaSource = DeltaSource.O_LOWP
    ds_dtype: Precision = Precision.FP32  # dtype dS is cast to before dQ = dS K and dK = dSᵀ Q
    # the autocast reference's backward (fp32 = hardware kernels): dp_dtype rounds dP = dO Vᵀ;
    # delta_dtype rounds dO ∘ O elementwise before δ's row sum; grad_dtype rounds each (query
    # block, KV block) product of dQ, dK, dV and the buffers they are added into, block by block
    # (zeros_like(q) buffers in bf16); ds_alpha: α multiplies P before dS is formed,
    # dS = fp32(P·α)·fp32(dP − δ), instead of scaling dQ and dK after their products
    dp_dtype: Precision = Precision.FP32
    delta_dtype: Precision = Precision.FP32
    grad_dtype: Precision = Precision.FP32
    ds_alpha: bool = False
    # accumulation model of every matrix product
    accumulation: Accumulation = Accumulation.IEEE
    gpu: GPUModel = GPUModel.H100
    # kernel models (docs/gpu-fidelity.md): how P̄ is formed, how ℓ is summed, how 1/ℓ is applied, and
    # FlashAttention-2's split-KV: the key blocks are cut into kv_splits contiguous runs of
    # ceil(n_blocks / kv_splits) blocks, each run's O (fp32, normalized) and lse are combined as its
    # combine kernel does (emulate/split_kv.py)
    exp_form: ExpForm = ExpForm.EXP
    exp_unit: ExpUnit = ExpUnit.CORRECTLY_ROUNDED  # the GPU kernel presets: sfu-sm90 (numerics/sfu.py, libdevice.py)
    lse_form: LseForm = LseForm.FMA_NATURAL  # how a base-2 kernel writes its lse (emulate/kernel_ops.kernel_lse)
    row_sum: RowSum = RowSum.EXACT
    normalize: Normalize = Normalize.DIVIDE
    kv_splits: int = 1
    # mma_k: the K of the MMA instruction the kernel issues, where smaller than the tensor core's group (the
    # memory-efficient kernel's mma.sync m16n8k8 sums 8 products per instruction): the tensor-core model's
    # groups are then mma_k long, in every product of the forward and the backward; None = the tensor core's
    mma_k: Optional[int] = None

    # ---- backward kernel models ----------------------------------------------------------------
    # backward_kernel: "reference" runs the contract of replay/emulate/backward.py with the backward knobs
    # above; a named kernel runs that kernel's backward as modelled from its source (tile order, exp form,
    # where the softmax scale and the casts sit: replay/emulate/backward_kernels.py), on the forward's O
    # and lse, with the products in `accumulation` / `gpu`; the knobs delta, ds_dtype, dp_dtype,
    # delta_dtype, grad_dtype and ds_alpha do not apply to it (the kernel fixes them), and it writes dQ,
    # dK, dV in input_dtype as the kernel does.
    backward_kernel: BackwardKernel = BackwardKernel.REFERENCE
    # bwd_key_splits: the memory-efficient backward's num_splits_key, the CTAs that share one head's key blocks
    # (emulate/efficient_schedule.py: it sets the order of the dQ sum and, without a mask, of the dK, dV sums);
    # None = PyTorch's heuristic from the launch: the batch, heads and keys of the tensors replayed, or of the layer
    # as stored when an analysis replays some of its heads (layers/selection.replay_layer); 1 = deterministic mode
    bwd_key_splits: Optional[int] = None
    # ---- end of the backward kernel models -------------------------------------------------------

    # ---- attention written as plain tensor ops (replay/eager.py) ------------------------------------
    # plain: the recorded op sequence (replay/plain_recipe.py) run instead of the tiled online softmax: the
    # normalized P rounded to p_dtype before P·V, each product one GEMM; None = the kernels' form.
    # plain_reexec: run those ops with torch on this CPU (the bit oracle of CPU captures); False: the emulator's
    # model of them (exact sums rounded once)
    plain: Optional[PlainRecipe] = None
    plain_reexec: bool = False

    def __post_init__(self) -> None:
        # Accept plain strings for enum fields (from the CLI or JSON) and normalize them.
        for f in dataclasses.fields(self):
            kind = _ENUM_FIELDS.get(f.name)
            value = getattr(self, f.name)
            if kind is not None and not isinstance(value, kind):
                try:
                    object.__setattr__(self, f.name, kind(value))
                except ValueError:
                    choices = ", ".join(m.value for m in kind)
                    raise ConfigError(f"ReplayConfig.{f.name}={value!r} is not one of: {choices}") from None
        if not (math.isfinite(self.p_scale) and self.p_scale > 0):
            raise ConfigError(f"ReplayConfig.p_scale={self.p_scale!r} must be a positive finite number")
        for name in ("block_m", "block_n"):
            b = getattr(self, name)
            if b is not None and (not isinstance(b, int) or b < 1):
                raise ConfigError(f"ReplayConfig.{name}={b!r} must be a positive integer or None (no tiling)")
        if self.softmax is Softmax.STABILIZED and not self.beta > 1:
            raise ConfigError(f"ReplayConfig.beta={self.beta!r} must be > 1 for the stabilized softmax (the paper uses "
                              "2 to 8)")
        if not (math.isfinite(self.row_sum_floor) and self.row_sum_floor >= 0):
            raise ConfigError(f"ReplayConfig.row_sum_floor={self.row_sum_floor!r} must be a finite number >= 0")
        if not self.eps >= 0:
            raise ConfigError(f"ReplayConfig.eps={self.eps!r} must be >= 0")
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise ConfigError(f"ReplayConfig.scale={self.scale!r} must be a positive finite number or None")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ConfigError(f"ReplayConfig.softcap={self.softcap!r} must be a positive finite number or None")
        if not isinstance(self.kv_splits, int) or not 1 <= self.kv_splits <= 128:
            raise ConfigError(f"ReplayConfig.kv_splits={self.kv_splits!r} must be an integer from 1 to 128")
        if self.bwd_key_splits is not None and (type(self.bwd_key_splits) is not int
                                                or not 1 <= self.bwd_key_splits <= 1024):
            raise ConfigError(f"ReplayConfig.bwd_key_splits={self.bwd_key_splits!r} must be an integer from 1 to 1024 "
                              "or None (PyTorch's heuristic)")
        if self.bwd_key_splits is not None and self.backward_kernel is not BackwardKernel.SDPA_EFFICIENT:
            raise ConfigError(f"ReplayConfig.bwd_key_splits={self.bwd_key_splits} splits the memory-efficient kernel's "
                              f"backward; it needs backward_kernel=sdpa-efficient, not {self.backward_kernel.value} "
                              "(on the command line: a preset sdpa-efficient or sdpa-efficient-fp16)")
        if self.mma_k is not None and (not isinstance(self.mma_k, int) or not 1 <= self.mma_k <= 64):
            raise ConfigError(f"ReplayConfig.mma_k={self.mma_k!r} must be an MMA instruction's K (1 to 64) or None")
        if self.plain is not None and not isinstance(self.plain, PlainRecipe):
            raise ConfigError(f"ReplayConfig.plain={self.plain!r} must be a PlainRecipe or None")
        if self.plain_reexec and self.plain is None:
            raise ConfigError("ReplayConfig.plain_reexec re-executes a recorded op sequence; set plain (a PlainRecipe)")
        if self.plain is not None and (self.is_kernel_model or self.p_scale != 1.0):
            raise ConfigError("ReplayConfig.plain replays attention written in torch ops; it does not combine with "
                              "the kernel-model knobs or a P scale")
        if self.is_kernel_model:
            self._check_kernel_model()

    @property
    def is_kernel_model(self) -> bool:
        """True when a kernel-model knob (exp_form, exp_unit, lse_form, row_sum, normalize, kv_splits, mma_k) differs
        from the default."""
        return (self.exp_form is not ExpForm.EXP or self.exp_unit is not ExpUnit.CORRECTLY_ROUNDED
                or self.lse_form is not LseForm.FMA_NATURAL or self.row_sum is not RowSum.EXACT
                or self.normalize is not Normalize.DIVIDE or self.kv_splits != 1 or self.mma_k is not None)

    def without_kernel_model(self) -> ReplayConfig:
        """This config on the same tiles with every forward kernel-model knob at its default (the emulator's exp,
        exact row sums, O / ℓ, one pass over the keys, the tensor core's own groups)."""
        return self.with_(exp_form=ExpForm.EXP, exp_unit=ExpUnit.CORRECTLY_ROUNDED, lse_form=LseForm.FMA_NATURAL,
                          row_sum=RowSum.EXACT, normalize=Normalize.DIVIDE, kv_splits=1, mma_k=None)

    def with_reference_backward(self) -> ReplayConfig:
        """This config with the emulator's reference backward in place of a kernel's (and without that kernel's
        backward knobs)."""
        return self.with_(backward_kernel=BackwardKernel.REFERENCE, bwd_key_splits=None)

    def _check_kernel_model(self) -> None:
        """The kernel models describe hardware kernels: fp32 scores and statistics, the standard softmax,
        nearest-even casts, an fp32 P̄V accumulator and no P scale."""
        bad = []
        if self.softmax is not Softmax.STANDARD:
            bad.append(f"softmax={self.softmax.value}")
        if any(d is not Precision.FP32 for d in (self.s_dtype, self.stats_dtype, self.rescale_dtype, self.exp_dtype)):
            bad.append("s_dtype / stats_dtype / rescale_dtype / exp_dtype below fp32")
        if self.pv_dtype is not Precision.FP32:
            bad.append(f"pv_dtype={self.pv_dtype.value}")
        if self.masked_blocks is not MaskedBlocks.SKIP or self.row_sum_floor != 0.0:
            bad.append("the reference code's masked-block loop")
        if self.p_scale != 1.0:
            bad.append(f"p_scale={self.p_scale}")
        if self.rounding is not Rounding.NEAREST_EVEN:
            bad.append(f"rounding={self.rounding.value}")
        if self.kv_splits > 1 and self.block_n is None:
            bad.append("kv_splits without block_n")
        if self.exp_unit is not ExpUnit.CORRECTLY_ROUNDED and self.exp_form is ExpForm.EXP:
            bad.append(f"exp_unit={self.exp_unit.value} with exp_form=exp (the unit models the base-2 forms)")
        if self.lse_form is not LseForm.FMA_NATURAL and self.exp_form is ExpForm.EXP:
            bad.append(f"lse_form={self.lse_form.value} with exp_form=exp (the lse forms are the base-2 kernels')")
        if bad:
            raise ConfigError("ReplayConfig: the kernel-model knobs (exp_form, exp_unit, lse_form, row_sum, "
                              f"normalize, kv_splits, mma_k) model hardware kernels and do not combine with "
                              f"{', '.join(bad)}; drop one or the other")

    # ---- derived configs -------------------------------------------------------------------
    def with_(self, **changes) -> ReplayConfig:
        """A copy with some fields changed (alias of dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> ReplayConfig:
        """A named recipe; see PRESETS for the list. A kernel's tile may follow the name after '@'
        (`sdpa-cudnn-sm90@block_n=128`, `flash-attn-2@block_m=64,block_n=256,kv_splits=4`): the
        preset with those tiling fields (block_m, block_n, kv_splits, kv_order, bwd_key_splits) replaced."""
        base, _, tile = name.partition("@")
        try:
            factory = PRESETS[base]
        except KeyError:
            raise ConfigError(f"unknown replay preset {base!r}; choose one of: {', '.join(PRESETS)}") from None
        cfg = factory()
        return cfg.with_(**parse_tile(tile, name)) if tile else cfg

    @property
    def is_low_precision(self) -> bool:
        """True when any cast in the forward pass rounds below fp32."""
        casts = (self.input_dtype, self.p_dtype, self.pv_dtype, self.o_dtype, self.s_dtype, self.stats_dtype,
                 self.rescale_dtype, self.exp_dtype)
        return any(d in _LOW_PRECISION for d in casts)

    @property
    def has_reference_backward(self) -> bool:
        """True when any backward knob of the autocast reference code differs from the kernels'."""
        return (self.ds_alpha
                or any(d is not Precision.FP32 for d in (self.dp_dtype, self.delta_dtype, self.grad_dtype)))

    def describe(self) -> str:
        """One line naming the fields that differ from the defaults."""
        default = ReplayConfig()
        diffs = []
        for f in dataclasses.fields(self):
            v, d = getattr(self, f.name), getattr(default, f.name)
            if v != d:
                diffs.append(f"{f.name}={v.value if isinstance(v, enum.Enum) else v}")
        return ", ".join(diffs) or "preset bf16 (the defaults)"


_TILE_FIELDS = {"block_m": int, "block_n": int, "kv_splits": int, "kv_order": str, "bwd_key_splits": int}


def parse_tile(text: str, name: str) -> dict:
    """The tiling fields of a preset name's '@' suffix ("block_n=128,kv_splits=4")."""
    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        kind = _TILE_FIELDS.get(key.strip())
        if kind is None or not value.strip():
            raise ConfigError(f"replay preset {name!r}: {part!r} is not a tiling field; write KEY=VALUE with KEY "
                              f"one of {', '.join(_TILE_FIELDS)} (e.g. sdpa-cudnn-sm90@block_n=128)")
        try:
            fields[key.strip()] = kind(value.strip())
        except ValueError:
            raise ConfigError(f"replay preset {name!r}: {key.strip()}={value.strip()!r} must be {kind.__name__}") \
                from None
    return fields


def tile_suffix(config: ReplayConfig, base: ReplayConfig) -> str:
    """The '@' suffix naming where config's tiling differs from its preset's (empty when it does not)."""
    parts = []
    for key in _TILE_FIELDS:
        value = getattr(config, key)
        if value != getattr(base, key):
            parts.append(f"{key}={value.value if isinstance(value, enum.Enum) else value}")
    return "@" + ",".join(parts) if parts else ""


_ENUM_FIELDS = {
    "input_dtype": Precision,
    "p_dtype": Precision,
    "pv_dtype": Precision,
    "o_dtype": Precision,
    "p_scale_mode": PScaleMode,
    "kv_order": KVOrder,
    "masked_blocks": MaskedBlocks,
    "softmax": Softmax,
    "rounding": Rounding,
    "delta": DeltaSource,
    "ds_dtype": Precision,
    "dp_dtype": Precision,
    "delta_dtype": Precision,
    "grad_dtype": Precision,
    "s_dtype": Precision,
    "stats_dtype": Precision,
    "rescale_dtype": Precision,
    "exp_dtype": Precision,
    "accumulation": Accumulation,
    "gpu": GPUModel,
    "exp_form": ExpForm,
    "exp_unit": ExpUnit,
    "lse_form": LseForm,
    "row_sum": RowSum,
    "normalize": Normalize,
    "backward_kernel": BackwardKernel,
}

_FP32 = Precision.FP32


def _fp8(scale: float) -> ReplayConfig:
    # The FP8 paper's kernel-faithful setting: Q, K, V fp32 to isolate the P cast; P̄·S cast to E4M3;
    # ℓ from the pre-cast fp32 P̄; O accumulated from the cast P̄ in fp32; epilogue O / (S·ℓ); block 64.
    return ReplayConfig(
        input_dtype=_FP32, p_dtype=Precision.FP8_E4M3, pv_dtype=_FP32, o_dtype=_FP32,
        p_scale=scale, block_m=64, block_n=64,
    )


_BF16 = Precision.BF16


def _bf16_autocast() -> ReplayConfig:
    # The paper's reference code's forward (pure-PyTorch FA2 under CUDA BF16 autocast, blocks of
    # 512): S, m, ℓ and the rescaled O accumulator in bf16 too; its fully masked blocks are skipped,
    # which is exact for the standard softmax.
    return ReplayConfig(s_dtype=_BF16, stats_dtype=_BF16, rescale_dtype=_BF16, block_m=512, block_n=512)


def _bf16_autocast_train() -> ReplayConfig:
    # The reference code as it trains: the forward's loop as run (every KV block visited, masked
    # scores -finfo(bf16).max, block row sums clamped at 1e-10) and its backward (bf16 dP, δ from
    # bf16(dO ∘ O), dS = P·α·(dP − δ) cast to bf16, dQ, dK, dV accumulated block by block in bf16).
    return _bf16_autocast().with_(
        masked_blocks=MaskedBlocks.VISIT, row_sum_floor=1e-10,
        ds_dtype=_BF16, dp_dtype=_BF16, delta_dtype=_BF16, grad_dtype=_BF16, ds_alpha=True)


def _bf16_autocast_cpu() -> ReplayConfig:
    # The reference code as it trains under CPU autocast: CPU autocast's op lists cast matmuls to
    # bf16 as CUDA's do, but leave exp and sum out of the fp32 list, so P̄, α and ℓ's updates are
    # bf16 too (exp_dtype). The backward knobs are CUDA's (match compares O only).
    return _bf16_autocast_train().with_(exp_dtype=_BF16)


def _hw_kernel(**tile) -> ReplayConfig:
    # a hardware kernel: fp32 scores, statistics and P̄V accumulator, P̄ cast to the input dtype,
    # tensor-core products, 2^x from the special function unit, O rounded once after 1/ℓ
    return ReplayConfig(pv_dtype=_FP32, accumulation=Accumulation.TENSOR_CORE, exp_unit=ExpUnit.SFU_SM90, **tile)


def _sdpa_cudnn_sm90() -> ReplayConfig:
    # cuDNN's fused flash attention on sm_90 (SDPA's CUDNN_ATTENTION; closed source): 128-key tiles in
    # forward order, 2^x of the once-scaled scores less their max, per-thread row sums fused into the rescale
    # (lanes-fma), O times 1/ℓ; modelled from measurement (docs/gpu-fidelity.md); its backward: backward_kernels.py
    return _hw_kernel(block_m=128, block_n=128, exp_form=ExpForm.EXP2_SCALED, lse_form=LseForm.SCALED_FMA,
                      row_sum=RowSum.LANES_FMA, normalize=Normalize.RECIPROCAL,
                      backward_kernel=BackwardKernel.SDPA_CUDNN)


def _sdpa_efficient() -> ReplayConfig:
    # the memory-efficient (xformers / CUTLASS) kernel behind SDPA's EFFICIENT_ATTENTION (kernel_forward.h):
    # 64 x 64 tiles for head dim <= 64 (64 x 128 up to 128), forward order; the scores times α, then (in
    # iterative_softmax) times log2 e, exp2f of them less their max; ℓ summed per thread, quad and warp tile
    # (s_prime); output times 1/s_prime; every product an mma.sync m16n8k8 (gemm_kernel_utils.h DefaultGemmType
    # for 16-bit inputs on sm75+): 8-term groups
    return _hw_kernel(block_m=64, block_n=64, exp_form=ExpForm.EXP2_SCALED_TWICE, lse_form=LseForm.SCALED_DIV,
                      row_sum=RowSum.CUTLASS_WARPS, normalize=Normalize.RECIPROCAL, mma_k=8,
                      backward_kernel=BackwardKernel.SDPA_EFFICIENT)


def _flash_attn_2(exp_form: ExpForm) -> ReplayConfig:
    # FlashAttention-2's forward (flash_fwd_kernel.h, softmax.h): 128 x 128 tiles for head dim <= 64 without
    # dropout, key blocks from last to first, exp2 of S·α·log2 e less the scaled row max, per-thread row-sum
    # partials, O times 1/ℓ
    return _hw_kernel(block_m=128, block_n=128, kv_order=KVOrder.REVERSE, exp_form=exp_form,
                      row_sum=RowSum.MMA_LANES, normalize=Normalize.RECIPROCAL,
                      backward_kernel=BackwardKernel.FLASH_ATTENTION_2)


def _fp32() -> ReplayConfig:
    return ReplayConfig(input_dtype=_FP32, p_dtype=_FP32, pv_dtype=_FP32, o_dtype=_FP32)


def _fp16_reading() -> ReplayConfig:
    # preset bf16's reading in fp16: fp16 inputs, P̄, P̄V product and O; scores, m and ℓ in fp32
    fp16 = Precision.FP16
    return ReplayConfig(input_dtype=fp16, p_dtype=fp16, pv_dtype=fp16, o_dtype=fp16)


def _eager(reexec: bool) -> ReplayConfig:
    # attention written in torch ops (Hugging Face's eager_attention_forward unless the layer recorded its own op
    # sequence: fidelity/plain_facts.py): bf16 inputs, scores and P, softmax in fp32, one GEMM per product
    return ReplayConfig(pv_dtype=_FP32, plain=hf_eager(), plain_reexec=reexec)


def _stabilized(config: ReplayConfig) -> ReplayConfig:
    # the paper's fix, Algorithm 3 with β = 2, ε = 1e-3 (STABLE=1 in its reference code)
    return config.with_(softmax=Softmax.STABILIZED, beta=2.0, eps=1e-3)


def _fp16(factory):
    return lambda: factory().with_(input_dtype=Precision.FP16, p_dtype=Precision.FP16, o_dtype=Precision.FP16)


PRESETS = {
    "bf16": lambda: ReplayConfig(),
    "fp32": _fp32,
    # preset bf16 with Algorithm 3; the paper's fix as it ran is "bf16-autocast-stabilized"
    "stabilized": lambda: ReplayConfig(softmax=Softmax.STABILIZED),
    # hardware flash-attention kernels: P̄ cast to bf16, fp32 accumulator, O rounded once after 1/ℓ
    "bf16-hw": lambda: ReplayConfig(pv_dtype=_FP32, block_m=128, block_n=64, accumulation=Accumulation.TENSOR_CORE),
    "stochastic": lambda: ReplayConfig(rounding=Rounding.STOCHASTIC),
    "bf16-autocast": _bf16_autocast,
    "bf16-autocast-train": _bf16_autocast_train,
    "bf16-autocast-cpu": _bf16_autocast_cpu,
    # the paper's fix as run (STABLE=1: Algorithm 3 with β = 2, ε = 1e-3 inside the loop above), under CUDA
    # and under CPU autocast
    "bf16-autocast-stabilized": lambda: _stabilized(_bf16_autocast_train()),
    "bf16-autocast-cpu-stabilized": lambda: _stabilized(_bf16_autocast_cpu()),
    # an fp32 run with the paper's fix; fp16 runs read as preset bf16 reads bf16 ones
    "fp32-stabilized": lambda: _stabilized(_fp32()),
    "fp16": _fp16_reading,
    "fp16-stabilized": lambda: _stabilized(_fp16_reading()),
    # kernels users train with (docs/gpu-fidelity.md); their tiles per head dim: replay/kernel_recipes.py
    "sdpa-cudnn-sm90": _sdpa_cudnn_sm90,
    "sdpa-efficient": _sdpa_efficient,
    # PyTorch's vendored FlashAttention-2 (SDPA's FLASH_ATTENTION) is compiled with UNFUSE_FMA
    "sdpa-flash": lambda: _flash_attn_2(ExpForm.EXP2_MUL),
    "flash-attn-2": lambda: _flash_attn_2(ExpForm.EXP2_FMA),
    "sdpa-cudnn-sm90-fp16": _fp16(_sdpa_cudnn_sm90),
    "sdpa-efficient-fp16": _fp16(_sdpa_efficient),
    "sdpa-flash-fp16": _fp16(lambda: _flash_attn_2(ExpForm.EXP2_MUL)),
    # attention written in torch ops (HF eager, timm, minGPT, ...), its recorded op sequence run again with torch on
    # this CPU, or as the emulator models it (replay/eager.py)
    "eager-reexec": lambda: _eager(True),
    "eager": lambda: _eager(False),
    "fp8-s1": lambda: _fp8(1.0),
    "fp8-s256": lambda: _fp8(256.0),
    "fp8-s448": lambda: _fp8(448.0),
}
