"""Build tests/data/h200_bwd/gpt2_keys768.safetensors from the recorded H200 bits (needs the recorded files).

tests/data/h200_bits keeps the O and lse of the last 128 query rows of the `gpt2` set and dK / dV of its first
128 keys, which every query row feeds: too little to recompute those dK / dV (that needs every row's O and lse).
This adds, per SDPA kernel (cudnn, efficient, flash), the O and lse of rows 768..895 and dK, dV of keys 768..831:
with the last 128 rows already there, rows 768..1023 are every row that sees those keys (causal), two query tiles
of 128 (four of 64), so a test recomputes these dK and dV exactly as the kernel did.

Usage: python benchmarks/make_h200_backward_fixture.py RECORDED_DIR OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from fa_forensics.replay.gpu_fidelity import write_tensors

ROWS = (768, 896)  # O and lse rows added (the fixture has 896..1024)
KEYS = (768, 832)  # dK, dV keys kept
KERNELS = ("cudnn", "efficient", "flash")


def build(recorded: Path, out: Path) -> Path:
    t = load_file(str(recorded / "sdpa_gpt2.safetensors"))
    keep = {}
    for kern in KERNELS:
        lse = t[f"gpt2.{kern}.lse"]
        lse = lse[..., 0] if lse.dim() == 4 else lse  # cuDNN returns (B, H, T, 1)
        keep[f"gpt2.{kern}.o"] = t[f"gpt2.{kern}.o"][:1, :1, ROWS[0]:ROWS[1]].contiguous()
        keep[f"gpt2.{kern}.lse"] = lse[:1, :1, ROWS[0]:ROWS[1]].contiguous()
        for g in ("dk", "dv"):
            keep[f"gpt2.{kern}.{g}"] = t[f"gpt2.{kern}.{g}"][:1, :1, KEYS[0]:KEYS[1]].contiguous()
    layout = {"tag": "gpt2", "source": "sdpa_gpt2.safetensors", "batch": 0, "heads": [0], "o_rows": list(ROWS),
              "dkdv_keys": list(KEYS), "kernels": list(KERNELS), "causal": True, "scale": 0.125}
    out.mkdir(parents=True, exist_ok=True)
    return write_tensors(out / "gpt2_keys768.safetensors.xz", keep, {"layout": json.dumps(layout)})


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
