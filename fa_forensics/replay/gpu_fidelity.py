"""Replay against bits recorded on a GPU: which recipe models each SDPA backend as it ran, and how much of the
recorded O it reproduces.

A recorded set is a safetensors file with `<tag>.q`, `<tag>.k`, `<tag>.v` (B, H, T, D) and per kernel
`<tag>.<kernel>.o`, and a JSON metadata entry `layout` saying which rows of O are kept (`o_rows`, half-open),
the scale, the causal flag, the stored dtype, and the launch shape the kernel ran with (`batch`, `heads`,
`T_recorded`, which decide FlashAttention-2's split count). tests/data/h200_bits/ holds such sets (its README
says how they were made); benchmarks/gpu_validate.py records new ones on a GPU. A set may be stored compressed with
xz (`.safetensors.xz`, as the fixtures are: GPU bits compress to about 55 %); `read_tensors` reads either.
"""
from __future__ import annotations

import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from fa_forensics.replay.config import ReplayConfig
from fa_forensics.replay.emulate.forward import forward
from fa_forensics.replay.emulate.split_kv import flash_num_splits
from fa_forensics.replay.kernel_recipes import flash_tile

# SDPA backend / recorded kernel -> the preset that models it (bf16; fp16 twins end in -fp16)
KERNEL_PRESETS = {
    "cudnn": "sdpa-cudnn-sm90",
    "efficient": "sdpa-efficient",
    "flash": "sdpa-flash",
    "paper": "bf16-autocast-train",
    "paper_stable": "bf16-autocast-stabilized",
}
H200_SMS = 132


@dataclass(frozen=True)
class RecordedSet:
    """One recorded input set: its layout metadata and tensors (fp32 views are made on use)."""

    tag: str
    layout: dict
    tensors: dict

    @classmethod
    def load(cls, path) -> RecordedSet:
        found = cls._read(path)
        if found is None:
            raise ValueError(f"{path}: no `layout` metadata; not a recorded set")
        return found

    @classmethod
    def _read(cls, path) -> Optional[RecordedSet]:
        """The set in a file, or None when the file has no `layout` (not a recorded set)."""
        tensors, metadata = read_tensors(path)
        if "layout" not in metadata:
            return None
        layout = json.loads(metadata["layout"])
        return cls(layout["tag"], layout, tensors)

    @property
    def kernels(self) -> list[str]:
        return list(self.layout["kernels"])

    def launch(self) -> tuple[int, int, int]:
        """(batch, heads, seqlen) of the recorded launch (not of the trimmed copy)."""
        b, h = self.layout.get("launch_batch"), self.layout.get("launch_heads")
        q = self.tensors[f"{self.tag}.q"]
        return (b or q.shape[0], h or q.shape[1], self.layout.get("T_recorded", q.shape[2]))


def kernel_preset(kernel: str, head_dim: int, dtype: str, batch: int, heads: int, seqlen: int,
                  sm_count: int = H200_SMS, dropout: bool = False) -> str:
    """The preset (with its tile) that models `kernel` as it ran at this launch shape: FlashAttention-2's
    one-pass tile or its split-KV forward with the split count PyTorch picks for this GPU."""
    fp16 = dtype == "float16" and kernel in ("cudnn", "efficient", "flash")
    name = KERNEL_PRESETS[kernel] + ("-fp16" if fp16 else "")
    if kernel == "flash":
        splits = flash_num_splits(batch, heads, seqlen, seqlen, head_dim, sm_count, dropout)
        if splits > 1:
            split_bn = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
            return f"{name}@block_m=64,block_n={split_bn},kv_splits={splits}"
        bm, bn = flash_tile(head_dim, dropout)
        return f"{name}@block_m={bm},block_n={bn}"
    if kernel == "efficient" and head_dim > 64:
        return f"{name}@block_m=64,block_n=128" if head_dim <= 128 else f"{name}@block_m=32,block_n=128"
    return name


def replay_o(rec: RecordedSet, config: ReplayConfig) -> torch.Tensor:
    """The replayed O (fp32 holding o_dtype values) of the set's kept rows."""
    q, k, v = (rec.tensors[f"{rec.tag}.{n}"].float() for n in ("q", "k", "v"))
    r0, r1 = rec.layout["o_rows"]
    causal = bool(rec.layout.get("causal", True))
    n_keys = r1 if causal else k.shape[-2]
    return forward(q[..., r0:r1, :], k[..., :n_keys, :], v[..., :n_keys, :], config, causal=causal,
                   scale=float(rec.layout["scale"]), generator=None, row0=r0).o


def o_agreement(rec: RecordedSet, kernel: str, config: ReplayConfig) -> float:
    """Share of the recorded O's elements the replay reproduces bit for bit (in the recorded dtype)."""
    ref = rec.tensors[f"{rec.tag}.{kernel}.o"]
    got = replay_o(rec, config).to(ref.dtype)
    return float((got.view(torch.int16) == ref.view(torch.int16)).double().mean())


def recorded_sets(folder) -> list[RecordedSet]:
    """Every recorded set (*.safetensors or *.safetensors.xz with a `layout`) in a folder, by name."""
    paths = sorted([*Path(folder).glob("*.safetensors"), *Path(folder).glob("*.safetensors.xz")])
    return [rec for rec in map(RecordedSet._read, paths) if rec is not None]


def read_tensors(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, or of one compressed with xz (a name ending in .xz)."""
    from safetensors import safe_open
    from safetensors.torch import load

    path = Path(path)
    if path.suffix != ".xz":
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})
    data = lzma.decompress(path.read_bytes())
    header = int.from_bytes(data[:8], "little")  # the format: a u64 header length, the JSON header, the data
    metadata = json.loads(data[8:8 + header]).get("__metadata__") or {}
    return load(data), metadata


def write_tensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write tensors and metadata as safetensors, compressed with xz when the name ends in .xz."""
    from safetensors.torch import save, save_file

    path = Path(path)
    tensors = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    if path.suffix == ".xz":
        path.write_bytes(lzma.compress(save(tensors, metadata=metadata), preset=9 | lzma.PRESET_EXTREME))
    else:
        save_file(tensors, str(path), metadata=metadata)
    return path


def gpt2_like_inputs(batch: int, heads: int, seqlen: int, head_dim: int, dtype: torch.dtype, seed: int = 0,
                     device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k ~ 1.5·N(0,1), v ~ N(0,1) in `dtype` (B, H, T, D): the recorded `gpt2` set's recipe."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, heads, seqlen, head_dim)
    q, k = (1.5 * torch.randn(shape, generator=g) for _ in range(2))
    v = torch.randn(shape, generator=g)
    return tuple(x.to(dtype).to(device) for x in (q, k, v))


def record_set(path, tag: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, outputs: dict, *, scale: float,
               causal: bool, note: str = "", do: Optional[torch.Tensor] = None) -> Path:
    """Write a recorded set (all rows kept) whose launch shape is q's: `outputs` maps kernel -> its O (B, H, T, D),
    or -> {tensor name: tensor} (o, and dq, dk, dv, lse where recorded); `do` the gradient the backward ran with."""
    B, H, T, _ = q.shape
    per_kernel = {kernel: out if isinstance(out, dict) else {"o": out} for kernel, out in outputs.items()}
    tensors = {f"{tag}.q": q, f"{tag}.k": k, f"{tag}.v": v} | ({} if do is None else {f"{tag}.do": do})
    tensors |= {f"{tag}.{kernel}.{name}": t for kernel, ts in per_kernel.items() for name, t in ts.items()}
    grads = any("dq" in ts for ts in per_kernel.values())
    layout = {"tag": tag, "batch": None, "heads": list(range(H)), "T": T, "T_recorded": T, "o_rows": [0, T],
              "dq_rows": [0, T] if grads else None, "dkdv_keys": [0, T] if grads else None,
              "kernels": list(per_kernel), "causal": causal, "scale": scale,
              "dtype": str(q.dtype).replace("torch.", ""), "launch_batch": B, "launch_heads": H, "note": note}
    return write_tensors(path, tensors, {"layout": json.dumps(layout)})


def agreement_rows(rec: RecordedSet, sm_count: int = H200_SMS) -> list[dict]:
    """Per kernel of a recorded set: the preset that models it at the recorded launch and the share of O it
    reproduces bit for bit (tensor-core products)."""
    q = rec.tensors[f"{rec.tag}.q"]
    batch, heads, seqlen = rec.launch()
    rows = []
    for kernel in rec.kernels:
        name = kernel_preset(kernel, q.shape[-1], str(q.dtype).replace("torch.", ""), batch, heads, seqlen, sm_count)
        share = o_agreement(rec, kernel, ReplayConfig.preset(name).with_(accumulation="tensor-core"))
        rows.append({"set": rec.tag, "kernel": kernel, "preset": name, "o_bits_equal": share})
    return rows
