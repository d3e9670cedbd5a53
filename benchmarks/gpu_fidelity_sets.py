"""The replay against full recorded GPU sets: for every kernel of every set, the share of bit-identical O (its
preset at the recorded launch, replay/gpu_fidelity.kernel_preset) and, where the set has gradients, of dQ, dK, dV
recomputed by the kernel's backward model from the recorded O and lse (and, `*_replay`, from the replay's own O
and lse, as an analysis runs it), and of the recorded lse.

    python benchmarks/gpu_fidelity_sets.py FILE.safetensors ... [--json OUT]

FILEs: sets in the layout of ../shared/gpu_reference/sdpa_*.safetensors or of benchmarks/gpu_record_kernels.py.
Prints one JSON line per (set, kernel). CPU only; minutes for T 1024.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from fa_forensics.replay import ReplayConfig
from fa_forensics.replay.emulate.backward_kernels import kernel_backward
from fa_forensics.replay.emulate.forward import forward
from fa_forensics.replay.gpu_fidelity import H200_SMS, KERNEL_PRESETS, kernel_preset, read_tensors


def _share(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() == b.float()).double().mean())


def load(path: str) -> tuple[dict, dict]:
    tensors, meta = read_tensors(path)
    return (json.loads(meta["layout"]) if "layout" in meta else {}), tensors


SAMPLE_SCALES = {"planted.s0l0": 0.125, "demo.s296l1": 32 ** -0.5}  # sdpa_sample_dumps: the dumps' stored scales


def measure(path: str) -> list[dict]:
    layout, t = load(path)
    tags = sorted(key[: -len(".q")] for key in t if key.endswith(".q"))
    return [row for tag in tags for row in measure_set(tag, layout, t)]


def measure_set(tag: str, layout: dict, t: dict) -> list[dict]:
    causal = bool(layout.get("causal", True))
    g = lambda name: t[f"{tag}.{name}"]  # noqa: E731
    q16 = g("q")
    B, H, T, D = q16.shape
    scale = float(layout.get("scale", SAMPLE_SCALES.get(tag, D ** -0.5)))
    q, k, v = (g(n).float() for n in ("q", "k", "v"))
    kernels = sorted({key[len(tag) + 1:].split(".")[0] for key in t
                      if key.startswith(tag + ".") and key.endswith(".o")})
    rows = []
    for kernel in kernels:
        if kernel not in KERNEL_PRESETS or kernel.startswith("paper"):
            continue
        name = kernel_preset(kernel, D, str(q16.dtype).replace("torch.", ""), B, H, T, H200_SMS)
        config = ReplayConfig.preset(name)
        fwd = forward(q, k, v, config, causal=causal, scale=scale, generator=None)
        o_ref = g(f"{kernel}.o")
        row = {"set": tag, "kernel": kernel, "preset": name, "o": _share(fwd.o.to(o_ref.dtype), o_ref)}
        if f"{tag}.{kernel}.lse" in t:
            lse_ref = g(f"{kernel}.lse").float().reshape(B, H, -1)[..., :T]
            row["lse"] = _share(fwd.lse, lse_ref)
            if f"{tag}.do" in t and f"{tag}.{kernel}.dq" in t:
                _, dq, dk, dv = kernel_backward(q, k, v, g("do").float(), o_ref.float(), lse_ref, config,
                                                causal=causal, scale=scale)
                for n, got in (("dq", dq), ("dk", dk), ("dv", dv)):
                    row[n] = _share(got, g(f"{kernel}.{n}"))
                # the whole preset, as an analysis of a dump runs it: the backward on the replay's own O and lse
                _, dq, dk, dv = kernel_backward(q, k, v, g("do").float(), fwd.o, fwd.lse, config, causal=causal,
                                                scale=scale)
                for n, got in (("dq", dq), ("dk", dk), ("dv", dv)):
                    row[f"{n}_replay"] = _share(got, g(f"{kernel}.{n}"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for path in args.files for r in measure(path)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
