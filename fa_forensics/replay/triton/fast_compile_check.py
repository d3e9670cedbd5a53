"""Compile the training-speed kernels for a GPU target without a GPU, with every autotune config.

Run in a process where TRITON_INTERPRET is unset (interpreted kernels cannot be compiled):
    python -m fa_forensics.replay.triton.fast_compile_check [--arch 90] [--quick]
(--quick: only the largest config of each kernel, D 128.)
Prints one line per variant: kernel, config, shared memory it needs. Exit code 0 when all compiled
and each fits the target's shared memory (sm_90: 227 KiB per block; a config that does not fit
would only be skipped by the autotuner, but a shape with none left would fail on the GPU).
"""
from __future__ import annotations

import argparse
import sys

SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}  # bytes of shared memory one block may use


def ptx_instructions(ptx: str) -> int:
    """Static instruction count of a PTX listing (no directives, labels, braces or comments): with the
    same config, stable minus plain is what the fix adds to the forward's code."""
    skip = ("//", ".", "$", "{", "}", "(", ")")
    return sum(1 for line in ptx.splitlines() if line.strip() and not line.strip().startswith(skip))


def compile_all(arch: int = 90, quick: bool = False) -> list[tuple[str, int]]:
    """(label, shared bytes) for every compiled variant."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fa_forensics.replay.triton import fast_attention as fa
    from fa_forensics.replay.triton import monitor_kernel as mk

    target = GPUTarget("cuda", arch, 32)
    done = []

    def build(fn, sig, consts, config, label):
        # as the JIT specializes a launch: 16-byte aligned pointers and T a multiple of 16 (the loads
        # are then pipelined with cp.async, and shared memory grows with num_stages)
        aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(sig.items())
                   if kind.startswith("*") or name in ("T", "Tk")}
        src = ASTSource(fn=fn, signature=sig | {k: "constexpr" for k in consts}, constexprs=consts, attrs=aligned)
        opts = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        ck = triton.compile(src, target=target, options=opts)
        assert len(ck.asm["cubin"]) > 0
        label = f"{fn.__name__} {label} {config.kwargs} w{config.num_warps} s{config.num_stages}"
        done.append((f"{label} ({ptx_instructions(ck.asm['ptx'])} PTX instructions)", int(ck.metadata.shared)))

    def fwd_sig(dt):
        return {"Q": dt, "K": dt, "V": dt, "O": dt, "LSE2": "*fp32", "T": "i32", "qk_scale": "fp32",
                "eps_raw": "fp32", "beta_m1": "fp32", "max_extra2": "fp32"}

    fwd_configs = fa._fwd_configs()[2:3] if quick else fa._fwd_configs()  # [2]: 128 rows, 4 stages
    bwd_configs = fa._bwd_configs()[1:2] if quick else fa._bwd_configs()  # [1]: the largest tiles
    for D in ((128,) if quick else (64, 128)):
        for i, config in enumerate(fwd_configs):
            for stable in ((True, False) if i == 0 else (True,)):
                consts = dict(D=D, BLOCK_N=fa.STABLE_BLOCK_N, CAUSAL=True, EVEN=True, STABLE=stable,
                              DOT_PRECISION="tf32") | config.kwargs
                build(fa.fast_attn_fwd, fwd_sig("*bf16"), consts, config, f"D{D} causal stable={stable}")
        config = fwd_configs[0]
        consts = dict(D=D, BLOCK_N=fa.STABLE_BLOCK_N, CAUSAL=False, EVEN=False, STABLE=True,
                      DOT_PRECISION="tf32") | config.kwargs
        build(fa.fast_attn_fwd, fwd_sig("*bf16"), consts, config, f"D{D} not causal, uneven T")
        bwd_sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "DQ": "*bf16", "DK": "*bf16", "DV": "*bf16",
                   "LSE2": "*fp32", "DELTA": "*fp32", "T": "i32", "sm_scale": "fp32", "qk_scale": "fp32"}
        for config in bwd_configs:
            consts = dict(D=D, CAUSAL=True, EVEN=True, DOT_PRECISION="tf32") | config.kwargs
            build(fa.fast_attn_bwd, bwd_sig, consts, config, f"D{D} causal")
        delta_sig = {"O": "*bf16", "DO": "*bf16", "DELTA": "*fp32", "T": "i32"}
        build(fa.fast_attn_delta, delta_sig, dict(D=D, BLOCK_M=64), triton.Config({}, num_warps=4, num_stages=1),
              f"D{D}")
        mon_sig = {"Q": "*bf16", "K": "*bf16", "ROWMAX": "*fp32", "NEAR": "*i32", "ONES": "*i32", "ROWSUM": "*fp32",
                   "T": "i32", "Tk": "i32", "scale": "fp32", "eps": "fp32"}
        build(mk.monitor_rows, mon_sig, dict(D=D, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, SCORE_DTYPE=tl.bfloat16,
                                             P_DTYPE=tl.bfloat16, DOT_PRECISION="tf32"),
              triton.Config({}, num_warps=4, num_stages=3), f"D{D} bf16 scores")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--quick", action="store_true", help="only the largest config of each kernel, D 128")
    args = parser.parse_args(argv)
    limit = SHARED_LIMIT.get(args.arch)
    too_big = 0
    for label, shared in compile_all(args.arch, args.quick):
        fits = limit is None or shared <= limit
        too_big += not fits
        print(f"{label}: sm_{args.arch} ok, shared {shared} B{'' if fits else ' EXCEEDS ' + str(limit)}")
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main())
