"""What integrity costs: "write every chunk" (+ zstd checksums) against "a manifest of chunk checksums".

Both catch a chunk that is lost (the silent failure: zarr reads a missing chunk as zeros). Measured
side by side, in one run, on one GPT-2-size layer-step (q, k, v, o, do: B 1, H 12, T 1024, D 64 in
bf16 = 12 chunks of 128 KiB each; x: 1 × 1024 × 768 bf16 = 1.5 MiB; 9 MiB in all), median of --repeat runs:

  baseline   zarr's defaults: all-zero chunks skipped, no checksum (what the writer did before)
  every      every chunk written (write_empty_chunks) + zstd frame checksums; the reader's check is
             metadata only (integrity.check_step: zarr.json files and one listing per array)
  manifest   baseline, plus a CRC-32 of every chunk's bytes in the array's attributes at creation;
             the reader's check recomputes the CRC of every chunk it reads

Write = creating the six arrays and writing them; check = what a reader pays, on top of reading the
values, to know that what it read is whole (every: check_step of the step; manifest: CRC over the
9 MiB read). Ratios are against the baseline write and the baseline read of the same data.

    python benchmarks/integrity_cost.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import zarr
import zarr.codecs

B, H, T, D, C = 1, 12, 1024, 64, 768
KEY_ENCODING = {"name": "default", "separator": "."}


def tensors() -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(0)
    out = {n: torch.randn(B, H, T, D, generator=g).to(torch.bfloat16).view(torch.int16).numpy().view("uint16")
           for n in ("q", "k", "v", "o", "do")}
    out["x"] = torch.randn(B, T, C, generator=g).to(torch.bfloat16).view(torch.int16).numpy().view("uint16")
    return out


def chunk_shape(a: np.ndarray) -> tuple[int, ...]:
    return (1, 1, *a.shape[2:]) if a.ndim == 4 else (1, *a.shape[1:])


def chunk_crcs(a: np.ndarray) -> list[int]:
    """CRC-32 of each chunk (one head of one batch row, or one batch row of x), in chunk order."""
    rows = a.reshape(-1, *a.shape[2:]) if a.ndim == 4 else a
    return [zlib.crc32(np.ascontiguousarray(r).tobytes()) for r in rows]


def write(folder: Path, data: dict[str, np.ndarray], variant: str) -> None:
    group = zarr.open_group(str(folder), mode="w")
    for name, a in data.items():
        attrs = {"dtype": "bfloat16"}
        if variant == "manifest":
            attrs["chunk_crc32"] = chunk_crcs(a)
        arr = group.create_array(
            name, shape=a.shape, dtype=a.dtype, chunks=chunk_shape(a), chunk_key_encoding=KEY_ENCODING,
            attributes=attrs,
            compressors=zarr.codecs.ZstdCodec(checksum=variant == "every"),
            config={"write_empty_chunks": variant == "every"},
        )
        arr[...] = a


def read(folder: Path) -> dict[str, np.ndarray]:
    group = zarr.open_group(str(folder), mode="r")
    return {name: group[name][...] for name in ("q", "k", "v", "o", "do", "x")}


def check(folder: Path, variant: str, values: dict[str, np.ndarray]) -> None:
    if variant == "every":
        from fa_forensics.dump.integrity import check_array

        for name in values:
            assert not check_array(folder / name, 0, 0, name)
    elif variant == "manifest":
        group = zarr.open_group(str(folder), mode="r")
        for name, a in values.items():
            assert chunk_crcs(a) == group[name].attrs["chunk_crc32"]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    data = tensors()
    mib = sum(a.nbytes for a in data.values()) / 2**20
    times: dict[str, dict[str, list[float]]] = {v: {"write": [], "read": [],
                                                    "check": []} for v in ("baseline", "every", "manifest")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            order = list(times)[r % 3:] + list(times)[:r % 3]  # interleaved and rotated: the three see the same load
            for variant in order:
                folder = Path(tmp) / f"{variant}_{r}.zarr"
                times[variant]["write"].append(timed(lambda: write(folder, data, variant)))
                values = {}
                times[variant]["read"].append(timed(lambda: values.update(read(folder))))
                times[variant]["check"].append(timed(lambda: check(folder, variant, values)))
    med = {v: {k: statistics.median(ts) for k, ts in d.items()} for v, d in times.items()}
    base_w, base_r = med["baseline"]["write"], med["baseline"]["read"]
    print(f"one layer-step, {mib:.1f} MiB of bf16 in 6 arrays ({5 * B * H + B} chunks); median of {args.repeat}")
    print(f"{'variant':10s} {'write ms':>9s} {'× base':>7s} {'read ms':>8s} {'check ms':>9s} "
          f"{'check / base read':>18s}")
    for v, m in med.items():
        print(f"{v:10s} {m['write'] * 1e3:9.1f} {m['write'] / base_w:7.2f} {m['read'] * 1e3:8.1f} "
              f"{m['check'] * 1e3:9.2f} {m['check'] / base_r:18.3f}")


if __name__ == "__main__":
    main()
