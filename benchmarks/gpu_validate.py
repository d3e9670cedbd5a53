"""GPU validation of the Triton replay kernels (needs a CUDA GPU; nothing here runs on the CPU).

(a) Bit agreement with the CPU emulator: for each (step, layer) of a dump (default: the sample
    dump), replay the paper-default bf16 config and the bf16-hw config on the GPU and on the
    emulator in `ieee` and in `tensor-core` mode (gpu model from --gpu), and report the fraction
    of bit-identical entries of O, δ and dQ. Expected differences: exp2.approx vs torch.exp (P's
    last fp32 bit), the hardware's tree reduction of ℓ vs the emulator's fp64 sum, the MMA's
    internal order vs the models, FMA contraction (disabled in replay kernels).
(c) Which replay recipe reproduces SDPA's kernels: for each (step, layer), O of
    F.scaled_dot_product_attention under each SDPA backend (flash, efficient, cudnn, math; one
    at a time with torch.nn.attention.sdpa_kernel, skipped where unavailable) on the stored bf16
    Q, K, V, compared bit for bit with the emulator's O under every `match` recipe
    (fidelity.match.candidate_recipes, --gpu's tensor-core model): the share of equal elements.
(d) The kernel models on new launches (`kernel_grid`): benchmarks/gpu_record_kernels.py records head dims 64
    and 128, bf16 and fp16, causal and not, and a torch.compile'd call (O, lse, dQ, dK, dV of each SDPA backend)
    to --record-dir, then benchmarks/gpu_fidelity_sets.py replays each under the preset that models the backend
    at that launch (the H200's SM count deciding FlashAttention-2's split count). The replay on the CPU takes
    minutes: on a lent GPU, record only (gpu_record_kernels.py) and replay the files elsewhere. With dropout
    (p 0.1) O depends on the kernel's Philox mask, which the replay does not model: the recorder keeps only
    whether two runs with the same seed agree bit for bit.
(b) Throughput at GPT-2 shapes (B 8, H 12, T 1024, D 64, causal, bf16): the forward of
    F.scaled_dot_product_attention, of the plain Triton kernel (standard softmax, planned once
    outside the timed call) and of stable_attention (stabilized), and the backward of SDPA and of
    stable_attention (the plain kernel has no autograd wrapper, so only its forward is timed), side
    by side in one run with triton.testing.do_bench; reported as TFLOP/s and as ratios to SDPA and
    stabilized/plain (forward).
    FLOPs (causal halves them): forward 2 matmuls × 2·B·H·T²·D / 2 = 2·B·H·T²·D;
    backward 5 matmuls (S recompute, dP, dV, dQ, dK) → 5·B·H·T²·D (dK/dV and dQ kernels both
    recompute S and dP here: 7·B·H·T²·D executed, 5 counted, the FA2 convention).

Usage: python benchmarks/gpu_validate.py [--dump sample_dumps/planted.zarr | --safetensors F]
                                         [--gpu h100] [--max-layers 2] [--json out.json]
                                         [--record-dir DIR] [--only kernels]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch


def _load_pairs(args):
    """[(label, q, k, v, do, causal, scale)] from a dump or a safetensors export."""
    if args.safetensors:
        from safetensors.torch import load_file

        t = load_file(args.safetensors)
        return [("safetensors", t["q"], t["k"], t["v"], t.get("do"), True, None)]
    from fa_forensics.dump import open_dump

    dump = open_dump(args.dump)
    out = []
    for step, layer, heads in dump.select()[: args.max_layers]:
        info = dump.layer_info(step, layer)
        q, k, v = (dump.read(step, layer, n, heads=heads) for n in ("q", "k", "v"))
        do = dump.read(step, layer, "do", heads=heads) if dump.has(step, layer, "do") else None
        out.append((f"step {step} layer {layer}", q, k, v, do, bool(info.causal), info.scale))
    return out


def agreement(args) -> list[dict]:
    from fa_forensics.replay import ReplayConfig, replay

    rows = []
    for label, q, k, v, do, causal, scale in _load_pairs(args):
        for preset in ("bf16", "bf16-hw"):
            cfg = ReplayConfig.preset(preset).with_(gpu=args.gpu)
            gpu = replay(q.cuda(), k.cuda(), v.cuda(), cfg, None if do is None else do.cuda(), backend="triton",
                         causal=causal, scale=scale)
            for acc in ("ieee", "tensor-core"):
                emu = replay(q, k, v, cfg.with_(accumulation=acc), do, backend="emulate", causal=causal, scale=scale)
                row = {"input": label, "preset": preset, "emulator_accumulation": acc}
                for f in ("o", "delta", "dq"):
                    a, b = getattr(gpu, f), getattr(emu, f)
                    row[f"{f}_bit_agreement"] = None if a is None else float((a.float() == b.float()).float().mean())
                rows.append(row)
                print(json.dumps(row))
    return rows


def sdpa_match(args) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa_forensics.fidelity.match import candidate_recipes, compare_o
    from fa_forensics.replay import replay

    rows = []
    for label, q, k, v, _do, causal, scale in _load_pairs(args):
        q16, k16, v16 = (x.to(torch.bfloat16).cuda() for x in (q, k, v))
        emulated = {}
        for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    o = F.scaled_dot_product_attention(q16, k16, v16, is_causal=causal, scale=scale).cpu()
            except (RuntimeError, AttributeError) as exc:
                rows.append({"input": label, "sdpa_backend": name, "unavailable": str(exc).splitlines()[0]})
                continue
            for recipe in candidate_recipes(q.shape[-1], k.shape[-2]):
                key = (recipe.preset, recipe.accumulation)
                if key not in emulated:
                    cfg = recipe.config().with_(gpu=args.gpu)
                    emulated[key] = replay(q, k, v, cfg, backend="emulate", causal=causal, scale=scale).o
                share, max_err, _ = compare_o(emulated[key], o)
                rows.append({"input": label, "sdpa_backend": name, "preset": recipe.preset,
                             "accumulation": recipe.accumulation, "o_bits_equal": share, "max_abs_err": max_err})
            best = max((r for r in rows if r.get("sdpa_backend") == name and r.get("input") == label and "preset" in r),
                       key=lambda r: r["o_bits_equal"])
            print(json.dumps({"input": label, "sdpa_backend": name, "best": best}))
    return rows


def kernel_grid(args) -> list[dict]:
    """(d): record SDPA's kernels on new launches (benchmarks/gpu_record_kernels.py) and replay them
    (benchmarks/gpu_fidelity_sets.py): O, lse, dQ, dK, dV shares per set and kernel."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_fidelity_sets
    import gpu_record_kernels

    paths, facts = gpu_record_kernels.record(Path(args.record_dir))
    rows = [{"recorded": facts}]
    for path in paths:
        rows += gpu_fidelity_sets.measure(str(path))
    return rows


def throughput(args) -> dict:
    import triton.testing

    from fa_forensics.replay import ReplayConfig
    from fa_forensics.replay.stable import stable_attention
    from fa_forensics.replay.triton import launch

    B, H, T, D = 8, 12, 1024, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    fwd_flops = 2 * B * H * T * T * D  # 4·B·H·T²·D halved by the causal mask
    bwd_flops = 5 * B * H * T * T * D  # 10·B·H·T²·D halved

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    plain_cfg = ReplayConfig(pv_dtype="fp32", causal=True, scale=D ** -0.5, block_m=64, block_n=64)
    plain_plan = launch.plan_for(plain_cfg, T, D, exact_l=False, fp_fusion=True)  # planned once, outside the timed call

    def plain(q, k, v):  # the same kernels and settings as stable_attention, standard softmax
        return launch.forward(q, k, v, plain_cfg, plain_plan, causal=True, scale=D ** -0.5)[0]

    results = {"shape": dict(B=B, H=H, T=T, D=D, causal=True, dtype="bf16"),
               "flops": {"forward": fwd_flops, "backward": bwd_flops}}
    for name, fn in (("sdpa", sdpa), ("triton_plain", plain), ("stable_attention", stable_attention)):
        ms_f = triton.testing.do_bench(lambda: fn(q, k, v))
        entry = {"forward_ms": ms_f, "forward_tflops": fwd_flops / ms_f * 1e-9}
        if name != "triton_plain":
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            o = fn(qg, kg, vg)
            ms_b = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
            entry |= {"backward_ms": ms_b, "backward_tflops": bwd_flops / ms_b * 1e-9}
        results[name] = entry
        print(name, json.dumps(entry))
    s, p, st = results["sdpa"], results["triton_plain"], results["stable_attention"]
    results["ratios"] = {
        "stable_forward_vs_sdpa": s["forward_ms"] / st["forward_ms"],
        "stable_backward_vs_sdpa": s["backward_ms"] / st["backward_ms"],
        "stable_forward_vs_plain": p["forward_ms"] / st["forward_ms"],
    }
    print("ratios (speed, > 1 = faster than the reference):", json.dumps(results["ratios"]))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="GPU validation of the Triton replay kernels")
    parser.add_argument("--dump", default="sample_dumps/planted.zarr")
    parser.add_argument("--safetensors", default=None)
    parser.add_argument("--gpu", default="h100", choices=("h100", "a100"))
    parser.add_argument("--max-layers", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--record-dir", default="gpu_records", help="where (d) writes its recorded launches")
    parser.add_argument("--only", choices=("kernels",), default=None, help="run only (d), the kernel models (minutes)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_validate: no CUDA GPU here; run it on a machine with one", file=sys.stderr)
        return 2
    report = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    if args.only != "kernels":
        report |= {"agreement": agreement(args), "sdpa_match": sdpa_match(args)}
    report["kernel_grid"] = kernel_grid(args)
    if args.only != "kernels":
        report["throughput"] = throughput(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
