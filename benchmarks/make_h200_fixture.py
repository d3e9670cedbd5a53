"""Build tests/data/h200_bits/ from the bits recorded on an H200 (a folder of sdpa_<set>.safetensors files and
gpu_h200_train.zarr.tar, as described in that folder's README).

    python benchmarks/make_h200_fixture.py FOLDER [--out tests/data/h200_bits]

The trimmed copy lets the test suite check the replay against real GPU outputs without a GPU and without the
recorded folder. What is kept, and why those rows and keys are enough, is in the fixture's README.md; every file
also says it in its metadata (`layout`, JSON), so tests read the slices from the file, not from constants.

Trimming rests on causality: output row i depends only on keys 0..i, so the LAST rows of O and dQ see every
key block (every rescale and every tile boundary), and the FIRST keys' dK and dV collect from every query row.
Truncating the inputs to the first T' rows leaves O and dQ of rows < T' unchanged (they never see later keys);
dK and dV are changed by truncation (later query rows contribute), so truncated sets store none.
"""
from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from fa_forensics.replay.gpu_fidelity import write_tensors

KERNELS = ("cudnn", "efficient", "flash", "paper", "paper_stable")
TAIL = 128  # rows of O / dQ kept: the last ones
HEAD_KEYS = 128  # keys of dK / dV kept: the first ones

# set name -> (tag, batch, heads, T' (None: full), rows of o/dq kept (None: all), keep dk/dv, gradients kept).
# Sets without gradients keep no dO either; sizes are chosen so that the whole fixture stays under 3 MB.
SETS = {
    "gpt2": ("gpt2", 0, [0], None, TAIL, True, True),
    "ties": ("ties", 0, [0], None, TAIL, True, True),
    "d128": ("d128", 0, [0], 192, 64, False, True),
    "fp16": ("fp16", 0, [0], 256, TAIL, False, True),
    "sample_dumps.planted": ("planted.s0l0", 0, [0], None, None, False, False),
    "sample_dumps.demo": ("demo.s296l1", 0, [0], None, None, False, False),
}
SCALES = {"planted.s0l0": 0.125, "demo.s296l1": 0.1767766952966369}
TRAIN_LAYER_STEPS = [(10, 3)]  # (step, layer) of the training capture kept
TRAIN_BATCH, TRAIN_HEADS = 0, [0, 1]


def _trim_set(src: Path, tag: str, batch: int, heads: list[int], t_keep, rows, keep_dkdv: bool, grads: bool):
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(src), framework="pt") as f:
        names = set(f.keys())
        full_t = f.get_slice(f"{tag}.q").get_shape()[2]
        t = t_keep or full_t

        def get(name):
            return f.get_tensor(name)[batch:batch + 1, heads][:, :, :t].contiguous()

        for name in ("q", "k", "v", "do") if grads else ("q", "k", "v"):
            out[f"{tag}.{name}"] = get(f"{tag}.{name}")
        row0 = t - rows if rows is not None else 0
        kernels = [b for b in KERNELS if f"{tag}.{b}.o" in names]
        for b in kernels:
            out[f"{tag}.{b}.o"] = get(f"{tag}.{b}.o")[:, :, row0:].contiguous()
            if grads:
                out[f"{tag}.{b}.dq"] = get(f"{tag}.{b}.dq")[:, :, row0:].contiguous()
            if keep_dkdv:
                out[f"{tag}.{b}.dk"] = get(f"{tag}.{b}.dk")[:, :, :HEAD_KEYS].contiguous()
                out[f"{tag}.{b}.dv"] = get(f"{tag}.{b}.dv")[:, :, :HEAD_KEYS].contiguous()
            if f"{tag}.{b}.lse" in names:
                lse = f.get_tensor(f"{tag}.{b}.lse")
                lse = lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2])  # (B, H, T): cuDNN's has a trailing 1
                out[f"{tag}.{b}.lse"] = lse[batch:batch + 1, heads][:, :, :t][:, :, row0:].contiguous()
        d = out[f"{tag}.q"].shape[-1]
        layout = {
            "tag": tag, "source": src.name, "batch": batch, "heads": heads, "T": t, "T_recorded": full_t,
            "o_rows": [row0, t], "dq_rows": [row0, t] if grads else None,
            "dkdv_keys": [0, HEAD_KEYS] if keep_dkdv else None, "kernels": kernels,
            "causal": True, "scale": SCALES.get(tag, d ** -0.5),
            "dtype": str(out[f"{tag}.q"].dtype).replace("torch.", ""),
        }
    return out, layout


def _trim_training(tar_path: Path):
    """The training capture's kept layer-steps in the project's safetensors import naming, with the run's
    attributes (device, torch version, autocast, dtype) as JSON metadata so tests can rebuild a faithful dump."""
    import zarr

    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
        root = zarr.open_group(str(Path(tmp) / "gpu.zarr"), mode="r")
        run_attrs = dict(root.attrs)["fa_forensics"]
        out, layer_attrs = {}, {}
        for step, layer in TRAIN_LAYER_STEPS:
            g = root[f"step_{step:09d}/layer_{layer:03d}"]
            attrs = dict(g.attrs)
            for name in ("q", "k", "v", "o"):
                a = torch.from_numpy(g[name][TRAIN_BATCH:TRAIN_BATCH + 1].view("uint16").astype("int16"))
                a = a.view(torch.bfloat16)[:, TRAIN_HEADS].contiguous()
                out[f"step{step}.layer{layer}.{name}"] = a
            attrs["heads"] = [attrs["heads"][h] for h in TRAIN_HEADS]
            attrs["arrays"] = ["q", "k", "v", "o"]
            layer_attrs[f"{step}.{layer}"] = attrs
    metadata = {
        "causal": "true", "scale": "0.125",
        "run_attrs": json.dumps(run_attrs), "layer_attrs": json.dumps(layer_attrs),
        **{f"layer{layer}.heads": ",".join(str(h) for h in TRAIN_HEADS) for _, layer in TRAIN_LAYER_STEPS},
    }
    return out, metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path,
                    help="folder with the recorded sdpa_<set>.safetensors and gpu_h200_train.zarr.tar")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/data/h200_bits")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (tag, batch, heads, t_keep, rows, keep_dkdv, grads) in SETS.items():
        src = args.folder / f"sdpa_{name.split('.')[0]}.safetensors"
        tensors, layout = _trim_set(src, tag, batch, heads, t_keep, rows, keep_dkdv, grads)
        dst = write_tensors(args.out / f"{tag}.safetensors.xz", tensors, {"layout": json.dumps(layout)})
        print(f"{dst.name}: {dst.stat().st_size / 1e3:.0f} kB")
    tensors, metadata = _trim_training(args.folder / "gpu_h200_train.zarr.tar")
    dst = write_tensors(args.out / "train_capture.safetensors.xz", tensors, metadata)
    print(f"{dst.name}: {dst.stat().st_size / 1e3:.0f} kB")
    total = sum(p.stat().st_size for p in args.out.glob("*.safetensors.xz"))
    print(f"total {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
