"""Compile every replay kernel for a GPU target without a GPU (triton.compile + ASTSource).

Run in a process where TRITON_INTERPRET is unset (interpreted kernels cannot be compiled):
    python -m fa_forensics.replay.triton.compile_check [--arch 90]
It compiles the forward for the paper-default (bf16), stabilized, fp8 and autocast (S, m, ℓ and
the rescaled accumulator rounded to bf16) configs, the δ kernel for each δ source and both
backward kernels, with fp32 and bf16 recomputed scores, down to PTX and cubin (ptxas ships with
triton), and prints one line per kernel variant. Exit code 0 when all compiled.
"""
from __future__ import annotations

import argparse
import re
import sys

# fp32 → bf16 roundings in PTX (scalar or paired): a cast point x.to(bf16).to(fp32) must survive
# compilation as one of these, never be folded away
_BF16_ROUNDING = re.compile(r"cvt\.rn\.bf16(?:x2)?\.f32")


def bf16_roundings(ptx: str) -> int:
    """How many fp32 → bf16 round-to-nearest-even conversions a kernel's PTX contains."""
    return len(_BF16_ROUNDING.findall(ptx))


def _sig(names_types: dict) -> dict:
    return dict(names_types)


def compile_all(arch: int = 90) -> list[str]:
    """Compile the kernels for cuda sm_<arch>; returns one line per compiled kernel."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fa_forensics.replay.triton import kernels

    target = GPUTarget("cuda", arch, 32)
    done = []

    def build(fn, sig, consts, label):
        src = ASTSource(fn=fn, signature=sig | {k: "constexpr" for k in consts}, constexprs=consts)
        ck = triton.compile(src, target=target, options={"num_warps": 4, "enable_fp_fusion": False})
        assert "cubin" in ck.asm and len(ck.asm["cubin"]) > 0
        ptx = ck.asm["ptx"]
        done.append(f"{fn.__name__:14s} {label}: sm_{arch} ok ({len(ptx)} chars of PTX, {bf16_roundings(ptx)} bf16 "
                    "roundings)")

    _build_forward(build, tl, kernels)
    _build_delta(build, tl, kernels)
    _build_backward(build, tl, kernels)
    return done


def _build_forward(build, tl, kernels) -> None:
    """The forward kernel's variants: bf16 hardware and paper recipes, stabilized, autocast, fp8 P."""
    fwd_sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "STATS": "*i32",
               "T": "i32", "H": "i32", "scale": "fp32", "beta": "fp32", "eps": "fp32", "offset": "fp32",
               "p_scale": "fp32", "log2_p_scale": "fp32"}
    no_autocast = dict(S_DTYPE=tl.float32, STATS_DTYPE=tl.float32, SUB_DTYPE=tl.float32, RESCALE_DTYPE=tl.float32)
    base = dict(D=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, REVERSE=False, SOFTMAX="standard",
                P_DTYPE=tl.bfloat16, DOT_PV_DTYPE=tl.bfloat16, PV_FP32=True, PV_DTYPE=tl.float32, O_DTYPE=tl.bfloat16,
                P_SCALED=False, P_SCALE_MODE="exponent-offset", L_SUM_DTYPE=tl.float32) | no_autocast
    build(kernels.attn_fwd, fwd_sig, base, "bf16 hardware")
    build(kernels.attn_fwd, fwd_sig, base | dict(PV_FP32=False, PV_DTYPE=tl.bfloat16, L_SUM_DTYPE=tl.float64),
          "bf16 paper (pv bf16, exact ℓ)")
    build(kernels.attn_fwd, fwd_sig, base | dict(SOFTMAX="stabilized", REVERSE=True), "stabilized, reverse KV")
    autocast = base | dict(PV_FP32=False, PV_DTYPE=tl.bfloat16, L_SUM_DTYPE=tl.float64, S_DTYPE=tl.bfloat16,
                           STATS_DTYPE=tl.bfloat16, SUB_DTYPE=tl.bfloat16, RESCALE_DTYPE=tl.bfloat16)
    build(kernels.attn_fwd, fwd_sig, autocast, "bf16-autocast (S, m, ℓ, rescale bf16)")
    build(kernels.attn_fwd, fwd_sig, autocast | dict(SOFTMAX="stabilized"), "bf16-autocast stabilized (bf16 ε test)")
    build(kernels.attn_fwd, fwd_sig, base | dict(S_DTYPE=tl.bfloat16, RESCALE_DTYPE=tl.bfloat16),
          "S and rescale bf16, fp32 stats and accumulator")
    fp8_sig = fwd_sig | {"Q": "*fp32", "K": "*fp32", "V": "*fp32", "O": "*fp32"}
    for mode in ("exponent-offset", "multiply"):
        build(kernels.attn_fwd, fp8_sig, base | dict(P_DTYPE=tl.float8e4nv, DOT_PV_DTYPE=tl.float32, O_DTYPE=tl.float32,
                                                     P_SCALED=True, P_SCALE_MODE=mode), f"fp8 P, S via {mode}")


def _build_delta(build, tl, kernels) -> None:
    """The δ kernel, for each δ source (and dp-p on bf16 scores)."""
    delta_sig = {"O": "*bf16", "DO": "*bf16", "Q": "*bf16", "K": "*bf16", "V": "*bf16", "LSE": "*fp32",
                 "DELTA": "*fp32", "T": "i32", "scale": "fp32"}
    for source in ("o", "dp-p", "o-recomputed"):
        build(kernels.attn_delta, delta_sig,
              dict(D=64, BLOCK_D=64, BLOCK_M=32, BLOCK_N=64, CAUSAL=True, DELTA_SOURCE=source,
                                                  S_DTYPE=tl.float32), f"δ from {source}")
    build(kernels.attn_delta, delta_sig,
          dict(D=64, BLOCK_D=64, BLOCK_M=32, BLOCK_N=64, CAUSAL=True, DELTA_SOURCE="dp-p",
                                              S_DTYPE=tl.bfloat16), "δ from dp-p, bf16 S")


def _build_backward(build, tl, kernels) -> None:
    """The dK/dV and dQ kernels, on fp32 and bf16 scores."""
    bwd = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DELTA": "*fp32"}
    dkdv_sig = bwd | {"DK": "*fp32", "DV": "*fp32", "T": "i32", "scale": "fp32", "p_scale": "fp32"}
    dq_sig = bwd | {"DQ": "*fp32", "T": "i32", "scale": "fp32"}
    tiles = dict(D=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True)
    for s_dtype, s_label in ((tl.float32, "fp32 S"), (tl.bfloat16, "bf16 S")):
        build(kernels.attn_bwd_dkdv, dkdv_sig,
              tiles | dict(P_DTYPE=tl.bfloat16, DOT_DV_DTYPE=tl.bfloat16, P_SCALED=False, DS_DTYPE=tl.bfloat16,
                           DOT_DS_DTYPE=tl.bfloat16, S_DTYPE=s_dtype), f"bf16 dS, {s_label}")
        build(kernels.attn_bwd_dq, dq_sig, tiles | dict(DS_DTYPE=tl.float32, DOT_DS_DTYPE=tl.float32, S_DTYPE=s_dtype),
              f"fp32 dS (ieee dot), {s_label}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    for line in compile_all(args.arch):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
