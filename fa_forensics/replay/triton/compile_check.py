"""Compile every replay kernel for a GPU target without a GPU (triton.compile + ASTSource).

Run in a process where TRITON_INTERPRET is unset (interpreted kernels cannot be compiled):
    python -m fa_forensics.replay.triton.compile_check [--arch 90]
It compiles the forward for the paper-default (bf16), stabilized and fp8 configs, the δ kernel
for each δ source and both backward kernels, down to PTX and cubin (ptxas ships with triton),
and prints one line per kernel. Exit code 0 when all compiled.
"""
from __future__ import annotations

import argparse
import sys


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
        done.append(f"{fn.__name__:14s} {label}: sm_{arch} ok ({len(ck.asm['ptx'])} chars of PTX)")

    fwd_sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "STATS": "*i32",
               "T": "i32", "H": "i32", "scale": "fp32", "beta": "fp32", "eps": "fp32", "offset": "fp32",
               "p_scale": "fp32", "log2_p_scale": "fp32"}
    base = dict(D=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, REVERSE=False, SOFTMAX="standard",
                P_DTYPE=tl.bfloat16, DOT_PV_DTYPE=tl.bfloat16, PV_FP32=True, PV_DTYPE=tl.float32, O_DTYPE=tl.bfloat16,
                P_SCALED=False, P_SCALE_MODE="exponent-offset", L_SUM_DTYPE=tl.float32)
    build(kernels.attn_fwd, fwd_sig, base, "bf16 hardware")
    build(kernels.attn_fwd, fwd_sig, base | dict(PV_FP32=False, PV_DTYPE=tl.bfloat16, L_SUM_DTYPE=tl.float64), "bf16 paper (pv bf16, exact ℓ)")
    build(kernels.attn_fwd, fwd_sig, base | dict(SOFTMAX="stabilized", REVERSE=True), "stabilized, reverse KV")
    fp8_sig = fwd_sig | {"Q": "*fp32", "K": "*fp32", "V": "*fp32", "O": "*fp32"}
    for mode in ("exponent-offset", "multiply"):
        build(kernels.attn_fwd, fp8_sig, base | dict(P_DTYPE=tl.float8e4nv, DOT_PV_DTYPE=tl.float32, O_DTYPE=tl.float32,
                                                     P_SCALED=True, P_SCALE_MODE=mode), f"fp8 P, S via {mode}")
    delta_sig = {"O": "*bf16", "DO": "*bf16", "Q": "*bf16", "K": "*bf16", "V": "*bf16", "LSE": "*fp32", "DELTA": "*fp32",
                 "T": "i32", "scale": "fp32"}
    for source in ("o", "dp-p", "o-recomputed"):
        build(kernels.attn_delta, delta_sig, dict(D=64, BLOCK_D=64, BLOCK_M=32, BLOCK_N=64, CAUSAL=True, DELTA_SOURCE=source),
              f"δ from {source}")
    bwd = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "LSE": "*fp32", "DELTA": "*fp32"}
    build(kernels.attn_bwd_dkdv, bwd | {"DK": "*fp32", "DV": "*fp32", "T": "i32", "scale": "fp32", "p_scale": "fp32"},
          dict(D=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, P_DTYPE=tl.bfloat16, DOT_DV_DTYPE=tl.bfloat16,
               P_SCALED=False, DS_DTYPE=tl.bfloat16, DOT_DS_DTYPE=tl.bfloat16), "bf16 dS")
    build(kernels.attn_bwd_dq, bwd | {"DQ": "*fp32", "T": "i32", "scale": "fp32"},
          dict(D=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, DS_DTYPE=tl.float32, DOT_DS_DTYPE=tl.float32), "fp32 dS (ieee dot)")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    for line in compile_all(args.arch):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
