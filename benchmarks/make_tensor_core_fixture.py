"""Build tests/data/tensor_core_mma/published.safetensors from the published tensor-core measurements.

Source: github.com/north-numerical-computing/MATLAB-tensor-core (the validation data of Khattak & Mikaitis,
"Accurate Models of NVIDIA Tensor Cores", arXiv 2512.07004), folder model_validation/<GPU>/<format>/:
a_*.txt and b_*.txt hold one dot product's K inputs per line (fp32 hex of values of the input format),
c_*_fp32.txt the fp32 addend and d_*_fp32.txt the fp32 output of one MMA instruction (binary strings),
d = a·b + c (for fp8 on the H100 / H200 the addend was zero). This keeps the first ROWS lines of each case,
as the input format's bit patterns (a, b) and fp32 (c, d).

Usage: python benchmarks/make_tensor_core_fixture.py REPO_CHECKOUT OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROWS = 500
CASES = [("A100", "bf16"), ("A100", "fp16"), ("H100", "bf16"), ("H100", "fp16"), ("H200", "bf16"),
         ("H100", "E4M3"), ("H100", "E5M2")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}


def _hex_rows(path: Path) -> torch.Tensor:
    rows = [[int(x, 16) for x in line.split()] for line in path.read_text().splitlines()[:ROWS] if line.strip()]
    return torch.from_numpy(np.array(rows, dtype=np.uint32).view(np.float32))


def _binary_rows(path: Path) -> torch.Tensor:
    vals = [int(line.strip(), 2) for line in path.read_text().splitlines()[:ROWS] if line.strip()]
    return torch.from_numpy(np.array(vals, dtype=np.uint32).view(np.float32))


def build(repo: Path, out: Path) -> Path:
    tensors, layout = {}, {}
    for gpu, fmt in CASES:
        folder = repo / "model_validation" / gpu / fmt
        a, b = _hex_rows(folder / f"a_{gpu}_{fmt}.txt"), _hex_rows(folder / f"b_{gpu}_{fmt}.txt")
        for name, x in (("a", a), ("b", b)):
            low = x.to(DTYPES[fmt])
            if not torch.equal(low.float(), x):
                raise ValueError(f"{gpu}/{fmt}: {name} holds values outside {fmt}")
            tensors[f"{gpu}.{fmt}.{name}"] = low
        zero_addend = fmt.startswith("E") and gpu in ("H100", "H200")
        c = _binary_rows(folder / f"c_{gpu}_fp32.txt")
        tensors[f"{gpu}.{fmt}.c"] = torch.zeros_like(c) if zero_addend else c
        tensors[f"{gpu}.{fmt}.d"] = _binary_rows(folder / f"d_{gpu}_fp32.txt")
        layout[f"{gpu}.{fmt}"] = {"K": a.shape[1], "rows": a.shape[0], "zero_addend": zero_addend}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "published.safetensors"
    save_file(tensors, str(path), metadata={"layout": json.dumps(layout)})
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
