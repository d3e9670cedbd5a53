"""Record SDPA's kernels on a GPU (forward, backward, log-sum-exp) for launches the replay was not fitted to.

    python benchmarks/gpu_record_kernels.py OUT_DIR [--tar]

Sets (inputs made as the recorded `gpt2` set, replay/gpu_fidelity.gpt2_like_inputs; dO ~ 0.01·N(0,1)):
head dim 64 and 128, bf16 and fp16, causal and not, T 1024 (B 1; H 2 at D 64 bf16, else H 1), and
`compiled`: a torch.compile'd attention (B 1, H 2, T 512, D 64, bf16, causal) under SDPA's own backend choice.
For each kernel (flash, efficient, cudnn; forced with torch.nn.attention.sdpa_kernel) it stores O and
dQ, dK, dV of `o.backward(do)` and the log-sum-exp from the backend's aten op where that op is callable.
Files: one safetensors per set, in the layout of ../shared/gpu_reference (keys `<tag>.q`, `<tag>.<kernel>.o`, …)
with the `layout` metadata replay/gpu_fidelity.RecordedSet reads, and `records.json` with, per set and kernel,
whether two forwards agreed bit for bit and whether two dropout (p 0.1) forwards with the same seed did.
--tar packs the files into at most three tars of under 16 MiB each (what a device run can bring back).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tarfile
from pathlib import Path

import torch

DEVICE = "cuda"  # --smoke: "cpu" (checks the code paths; only SDPA's CPU flash backend runs there)
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (--smoke)"


def _lse(kernel: str, q, k, v, causal: bool, scale: float):
    """The backend's log-sum-exp (natural log) from its aten op, or None where the op cannot be called."""
    ops = torch.ops.aten
    try:
        if kernel == "flash":
            return ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[1]
        if kernel == "efficient":
            return ops._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[1]
        return ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[1]
    except (RuntimeError, TypeError, AttributeError) as exc:
        print(f"  lse of {kernel}: not callable ({str(exc).splitlines()[0][:120]})")
        return None


def run_kernel(kernel: str, q, k, v, do, causal: bool, scale: float) -> tuple[dict, dict]:
    """One kernel on one set: its tensors and facts (forward repeatable, dropout repeatable)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tensors, facts = {}, {}
    with sdpa_kernel(getattr(SDPBackend, BACKENDS[kernel])):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
        o.backward(do)
        again = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        facts["forward_repeatable"] = bool(torch.equal(o.detach(), again))
        tensors |= {"o": o.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}
        lse = _lse(kernel, q, k, v, causal, scale)
        if lse is not None:
            tensors["lse"] = lse.float()
        try:
            dropped = []
            for _ in range(2):
                torch.manual_seed(0)
                dropped.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, dropout_p=0.1))
            facts["dropout_repeatable_same_seed"] = bool(torch.equal(dropped[0], dropped[1]))
        except RuntimeError as exc:
            facts["dropout_repeatable_same_seed"] = f"unavailable: {str(exc).splitlines()[0][:120]}"
    return tensors, facts


def save_set(out: Path, tag: str, inputs: dict, per_kernel: dict, causal: bool, scale: float) -> Path:
    """One set in replay/gpu_fidelity.record_set's layout, noting the GPU, versions and date."""
    from fa_forensics.replay.gpu_fidelity import record_set

    note = (f"{_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
            f"{datetime.date.today().isoformat()}")
    return record_set(out / f"{tag}.safetensors", tag, inputs["q"], inputs["k"], inputs["v"], per_kernel,
                      scale=scale, causal=causal, note=note, do=inputs.get("do"))


def compiled_set(out: Path, facts: dict) -> Path:
    """SDPA inside torch.compile, SDPA choosing its backend: the kernel users get from a compiled model."""
    import torch.nn.functional as F

    from fa_forensics.replay.gpu_fidelity import gpt2_like_inputs

    q, k, v = gpt2_like_inputs(1, 2, 512, 64, torch.bfloat16, seed=7, device=DEVICE)
    do = (0.01 * torch.randn(q.shape, generator=torch.Generator().manual_seed(8))).to(torch.bfloat16).to(DEVICE)
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=0.125)
    from torch.nn.attention import SDPBackend

    name = SDPBackend(int(choice)).name
    kernel = {backend: kernel for kernel, backend in BACKENDS.items()}.get(name, name.lower())

    @torch.compile
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125)

    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o = attention(qg, kg, vg)
    o.backward(do)
    facts["compiled"] = {"sdpa_choice": kernel, "choice_code": int(choice)}
    return save_set(out, "compiled", {"q": q, "k": k, "v": v, "do": do},
                    {kernel: {"o": o.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}}, True, 0.125)


def record(out: Path) -> tuple[list[Path], dict]:
    from fa_forensics.replay.gpu_fidelity import gpt2_like_inputs

    out.mkdir(parents=True, exist_ok=True)
    facts = {"gpu": _device_name(), "torch": torch.__version__,
             "cudnn": torch.backends.cudnn.version(), "date": datetime.date.today().isoformat(), "sets": {}}
    paths = []
    for head_dim in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (True, False):
                heads = 2 if (head_dim == 64 and dtype == torch.bfloat16) else 1
                tag = f"d{head_dim}_{str(dtype)[6:]}_{'causal' if causal else 'full'}"
                q, k, v = gpt2_like_inputs(1, heads, 1024, head_dim, dtype, seed=head_dim + 1, device=DEVICE)
                g = torch.Generator().manual_seed(head_dim + 2)
                do = (0.01 * torch.randn(q.shape, generator=g)).to(dtype).to(DEVICE)
                per_kernel, set_facts = {}, {}
                for kernel in BACKENDS:
                    try:
                        per_kernel[kernel], set_facts[kernel] = run_kernel(kernel, q, k, v, do, causal,
                                                                           head_dim ** -0.5)
                    except RuntimeError as exc:
                        set_facts[kernel] = {"unavailable": str(exc).splitlines()[0][:200]}
                facts["sets"][tag] = set_facts
                print(tag, json.dumps(set_facts), flush=True)
                if per_kernel:
                    paths.append(save_set(out, tag, {"q": q, "k": k, "v": v, "do": do}, per_kernel, causal,
                                          head_dim ** -0.5))
    try:
        paths.append(compiled_set(out, facts))
        print("compiled", json.dumps(facts["compiled"]), flush=True)
    except Exception as exc:  # a compile failure must not lose the recorded sets
        facts["compiled"] = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        print("compiled failed:", facts["compiled"]["failed"], flush=True)
    (out / "records.json").write_text(json.dumps(facts, indent=1))
    return paths, facts


def pack(out: Path, paths: list[Path], limit: int = 16_000_000) -> list[Path]:
    """Tars of the recorded files, each under `limit` bytes (records.json goes into the first)."""
    groups, sizes = [[out / "records.json"]], [0]
    for p in sorted(paths, key=lambda p: -p.stat().st_size):
        for i, size in enumerate(sizes):
            if size + p.stat().st_size < limit:
                groups[i].append(p)
                sizes[i] += p.stat().st_size
                break
        else:
            groups.append([p])
            sizes.append(p.stat().st_size)
    tars = []
    for i, group in enumerate(groups):
        tar_path = out / f"records_{i}.tar"
        with tarfile.open(tar_path, "w") as tar:
            for p in group:
                tar.add(p, arcname=p.name)
        tars.append(tar_path)
        for p in group:
            p.unlink()
    return tars


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tar", action="store_true", help="pack into tars of under 16 MB each")
    parser.add_argument("--smoke", action="store_true", help="run on the CPU to check the code (no GPU bits)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_record_kernels: no CUDA GPU here; run it on a machine with one", file=sys.stderr)
        return 2
    paths, _ = record(args.out)
    if args.tar:
        for t in pack(args.out, paths):
            print("wrote", t, t.stat().st_size, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
