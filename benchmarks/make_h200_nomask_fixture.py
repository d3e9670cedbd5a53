"""Build tests/data/h200_bwd/d64_bfloat16_full_rows.safetensors.xz from the recorded H200 launches (needs them).

tests/data/h200_unseen/d64_bfloat16_full keeps every key and value of the non-causal d64 bf16 launch but the query
rows 960..1023 only: enough for dQ of those rows, not for dK / dV, which sum over every query row. This adds, for
the memory-efficient kernel (batch 0, head 0), q, dO, O and lse of rows 0..959, dK and dV of two key blocks and dQ
of one query block, so that a test recomputes them as the kernel did. Without a mask the kernel splits the keys
over CTAs that each start their walk over the query blocks at a different block (docs/gpu-fidelity.md): key blocks
5 and 10 start mid-walk and wrap around, and query block 5 is reached by the key blocks in the order 5, 4, .., 0,
15, .., 6, so these outputs tell the kernel's schedule from a plain ascending or descending one.

Usage: python benchmarks/make_h200_nomask_fixture.py RECORDS_DIR [OUT_DIR]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors import safe_open

from fa_forensics.replay.gpu_fidelity import write_tensors

TAG = "d64_bfloat16_full"
KERNEL = "efficient"
ROWS = (0, 960)  # q, do, o, lse rows added (tests/data/h200_unseen has 960..1024)
KEY_BLOCKS = ((320, 384), (640, 704))  # dK, dV kept: key blocks 5 and 10 of 64
DQ_ROWS = (320, 384)  # dQ kept: query block 5 of 64


def build(records: Path, out: Path) -> Path:
    with safe_open(str(records / f"{TAG}.safetensors"), "pt") as f:
        layout = json.loads(f.metadata()["layout"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    head = lambda name: t[f"{TAG}.{name}"][:1, :1]  # noqa: E731
    keep = {f"{TAG}.{name}": head(name)[:, :, ROWS[0]:ROWS[1]].contiguous() for name in ("q", "do")}
    keep[f"{TAG}.{KERNEL}.o"] = head(f"{KERNEL}.o")[:, :, ROWS[0]:ROWS[1]].contiguous()
    lse = t[f"{TAG}.{KERNEL}.lse"].reshape(*t[f"{TAG}.q"].shape[:2], -1)
    keep[f"{TAG}.{KERNEL}.lse"] = lse[:1, :1, ROWS[0]:ROWS[1]].contiguous()
    for name in ("dk", "dv"):
        keep[f"{TAG}.{KERNEL}.{name}"] = head(f"{KERNEL}.{name}")[:, :, [j for a, b in KEY_BLOCKS
                                                                     for j in range(a, b)]].contiguous()
    keep[f"{TAG}.{KERNEL}.dq"] = head(f"{KERNEL}.dq")[:, :, DQ_ROWS[0]:DQ_ROWS[1]].contiguous()
    kept = {"tag": TAG, "source": f"{TAG}.safetensors", "batch": 0, "heads": [0], "q_rows": list(ROWS),
            "o_rows": list(ROWS), "dkdv_keys": [list(b) for b in KEY_BLOCKS], "dq_rows": list(DQ_ROWS),
            "kernels": [KERNEL], "causal": False, "scale": layout["scale"], "dtype": layout["dtype"],
            "T_recorded": layout["T_recorded"], "launch_batch": layout["launch_batch"],
            "launch_heads": layout["launch_heads"], "note": layout["note"]}
    out.mkdir(parents=True, exist_ok=True)
    return write_tensors(out / f"{TAG}_rows.safetensors.xz", keep, {"layout": json.dumps(kept)})


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.strip().splitlines()[-1])
    default = Path(__file__).resolve().parents[1] / "tests" / "data" / "h200_bwd"
    print(build(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else default))
