"""Compile the training-speed kernels for a GPU target without a GPU: the table's tiles, the autotune set and
the levers (fast_tiles.KernelOptions), with their static cost.

Run in a process where TRITON_INTERPRET is unset (interpreted kernels cannot be compiled):
    python -m fa_forensics.replay.triton.fast_compile_check [--arch 90] [--quick]
(--quick: the table's 16-bit tiles at D 128 and the levers; without it also D 64, fp32 and every
autotune config.) Prints one line per variant: kernel, constexprs, tiles, shared memory, registers,
SASS instructions (cuobjdump, shipped with triton; PTX lines where it is missing). Then, per table
entry, what the fix adds to the forward's code: stabilized minus plain instructions with the same tiles.
Exit code 0 when every kernel the table launches compiled and fits the target's shared memory (sm_90:
227 KiB per block). A lever that does not compile on this Triton is reported, not failed: its switch
is off by default, and benchmarks/gpu_speed.py reports it the same way on the device.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}  # bytes of shared memory one block may use


@dataclass
class Built:
    label: str
    shared: int
    registers: int  # -1: unknown
    stack: int  # bytes of local memory per thread (spilled registers); -1: unknown
    instructions: int
    unit: str  # "SASS" or "PTX"
    required: bool
    warp_specialized: bool = False  # the compiler split the warps into producer and consumer groups
    error: str = ""


def ptx_instructions(ptx: str) -> int:
    """Static instruction count of a PTX listing (no directives, labels, braces or comments)."""
    skip = ("//", ".", "$", "{", "}", "(", ")")
    return sum(1 for line in ptx.splitlines() if line.strip() and not line.strip().startswith(skip))


def _cuobjdump() -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def sass_profile(cubin: bytes) -> tuple[collections.Counter, int, int] | None:
    """(opcode counts, registers per thread, stack bytes per thread) of a cubin, from cuobjdump; None without it."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M))
    ops.pop("NOP", None)
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return ops, int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def compile_all(arch: int = 90, quick: bool = False) -> list[Built]:
    """Every variant, compiled (or its error, for levers)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fa_forensics.replay.triton import fast_attention as fa
    from fa_forensics.replay.triton import fast_tiles
    from fa_forensics.replay.triton import monitor_kernel as mk

    target = GPUTarget("cuda", arch, 32)
    done: list[Built] = []

    def build(fn, sig, consts, tiles, label, required=True):
        # as the JIT specializes a launch: 16-byte aligned pointers and T a multiple of 16 (the loads
        # are then pipelined with cp.async, and shared memory grows with num_stages)
        aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(sig.items())
                   if kind.startswith("*") or name in ("T", "Tk")}
        meta = tiles.meta() if hasattr(tiles, "meta") else {}
        src = ASTSource(fn=fn, signature=sig | {k: "constexpr" for k in consts | meta},
                        constexprs=consts | meta, attrs=aligned)
        label = f"{fn.__name__} {label} {meta} w{tiles.num_warps} s{tiles.num_stages}"
        try:
            ck = triton.compile(src, target=target, options={"num_warps": tiles.num_warps,
                                                             "num_stages": tiles.num_stages})
        except Exception as exc:  # a lever this Triton cannot build: said, and the check goes on
            if required:
                raise
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            done.append(Built(label, 0, -1, -1, 0, "", False, error=first[:160]))
            return
        assert len(ck.asm["cubin"]) > 0
        profile = sass_profile(ck.asm["cubin"])
        if profile is None:
            count, regs, stack, unit = ptx_instructions(ck.asm["ptx"]), -1, -1, "PTX"
        else:
            count, regs, stack, unit = sum(profile[0].values()), profile[1], profile[2], "SASS"
        specialized = "setmaxnreg" in ck.asm["ptx"] or ck.metadata.num_warps > tiles.num_warps
        done.append(Built(label, int(ck.metadata.shared), regs, stack, count, unit, required, specialized))

    def fwd_sig(dt, tma=False, D=64):
        kv = f"tensordesc<{dt[1:]}[1,{fa.STABLE_BLOCK_N},{D}]>" if tma else dt
        return {"Q": dt, "K": kv, "V": kv, "O": dt, "LSE2": "*fp32", "MAX2": "*fp32", "T": "i32", "qk_scale": "fp32",
                "eps_raw": "fp32", "beta_m1": "fp32", "max_extra2": "fp32"}

    def fwd(D, dt, tiles, causal=True, even=True, stable=True, tie="count", tma=False, ws=False, row_max=False,
            required=True, label=""):
        consts = dict(D=D, BLOCK_N=fa.STABLE_BLOCK_N, CAUSAL=causal, EVEN=even, STABLE=stable,
                      DOT_PRECISION="ieee" if dt == "*fp32" else "tf32", TIE_TEST=tie, USE_TMA=tma,
                      WARP_SPECIALIZE=ws, ROW_MAX=row_max)
        what = f"D{D} {dt[1:]} {'causal' if causal else 'full'}{'' if even else ' uneven'} " \
               f"{'stable' if stable else 'plain'}{label}"
        build(fa.fast_attn_fwd, fwd_sig(dt, tma, D), consts, tiles, what, required)

    bwd_sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "DQ": "*bf16", "DK": "*bf16", "DV": "*bf16",
               "LSE2": "*fp32", "DELTA": "*fp32", "T": "i32", "sm_scale": "fp32", "qk_scale": "fp32"}
    small = triton.Config({}, num_warps=4, num_stages=1)
    for D in ((128,) if quick else (64, 128)):
        tiles = fast_tiles.fwd_tiles(D, True, _bf16())
        fwd(D, "*bf16", tiles)  # the table's tiles: stabilized and plain, the fix's static cost
        fwd(D, "*bf16", tiles, stable=False)
        fwd(D, "*bf16", tiles, causal=False, even=False)
        fwd(D, "*bf16", tiles, row_max=True, label=" row_max")
        for name, kw in (("top2", dict(tie="top2")), ("tma", dict(tma=True)), ("tma+top2", dict(tma=True, tie="top2")),
                         ("warp_specialize", dict(ws=True)), ("tma+warp_specialize", dict(tma=True, ws=True))):
            fwd(D, "*bf16", tiles, required=False, label=f" lever {name}", **kw)
        build(fa.fast_attn_bwd, bwd_sig, dict(D=D, CAUSAL=True, EVEN=True, DOT_PRECISION="tf32"),
              fast_tiles.bwd_tiles(D, True, _bf16()), f"D{D} causal")
        build(fa.fast_attn_delta, {"O": "*bf16", "DO": "*bf16", "DELTA": "*fp32", "T": "i32"},
              dict(D=D, BLOCK_M=64), small, f"D{D}")
        mon_sig = {"Q": "*bf16", "K": "*bf16", "ROWS": "*i32", "ROWMAX": "*fp32", "NEAR": "*i32", "ONES": "*i32",
                   "ROWSUM": "*fp32", "T": "i32", "Tk": "i32", "H": "i32", "n_rows": "i32", "scale": "fp32",
                   "eps": "fp32"}
        for sampled, block_m, counts in ((False, 64, True), (True, 16, True), (False, 64, False)):
            build(mk.monitor_rows, mon_sig, dict(D=D, BLOCK_M=block_m, BLOCK_N=64, CAUSAL=True,
                                                 SCORE_DTYPE=tl.bfloat16, P_DTYPE=tl.bfloat16, DOT_PRECISION="tf32",
                                                 SAMPLED=sampled, COUNTS=counts),
                  triton.Config({}, num_warps=4, num_stages=3),
                  f"D{D} bf16 scores {'sampled' if sampled else 'all'} rows{'' if counts else ', pass 1 only'}")
        if quick:
            continue
        fp32_tiles = fast_tiles.fwd_tiles(D, True, _fp32())
        fwd(D, "*fp32", fp32_tiles)
        for tiles in fast_tiles.fwd_autotune_set():
            fwd(D, "*bf16", tiles, label=" autotune set")
        for tiles in fast_tiles.bwd_autotune_set():
            build(fa.fast_attn_bwd, bwd_sig, dict(D=D, CAUSAL=True, EVEN=True, DOT_PRECISION="tf32"), tiles,
                  f"D{D} causal autotune set")
    return done


def _bf16():
    import torch

    return torch.bfloat16


def _fp32():
    import torch

    return torch.float32


def fix_costs(built: list[Built]) -> list[str]:
    """Per forward config compiled both ways: stabilized minus plain instructions, the same tiles."""
    by_label = {b.label: b for b in built if not b.error}
    lines = []
    for label, b in by_label.items():
        if " stable " in label and "lever" not in label and "row_max" not in label:
            plain = by_label.get(label.replace(" stable ", " plain "))
            if plain is not None:
                extra = b.instructions - plain.instructions
                lines.append(f"fix cost {label.replace(' stable', '')}: {plain.instructions} → {b.instructions} "
                             f"{b.unit} instructions (+{extra}, +{100 * extra / plain.instructions:.1f} %)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--quick", action="store_true", help="the table's tiles at D 128 and the levers only")
    args = parser.parse_args(argv)
    limit = SHARED_LIMIT.get(args.arch)
    too_big = 0
    built = compile_all(args.arch, args.quick)
    for b in built:
        if b.error:
            print(f"{b.label}: sm_{args.arch} lever not built by this Triton: {b.error}")
            continue
        fits = limit is None or b.shared <= limit
        too_big += b.required and not fits
        ws = (f", warp-specialized: {'yes' if b.warp_specialized else 'no'}" if "warp_specialize" in b.label
              else "")
        print(f"{b.label}: sm_{args.arch} ok, shared {b.shared} B{'' if fits else ' EXCEEDS ' + str(limit)}, "
              f"{b.registers} registers, {b.stack} B stack, {b.instructions} {b.unit} instructions{ws}")
    for line in fix_costs(built):
        print(line)
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main())
