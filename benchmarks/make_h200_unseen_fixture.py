"""Build tests/data/h200_unseen/ from launches recorded by benchmarks/gpu_record_kernels.py (needs those files).

    python benchmarks/make_h200_unseen_fixture.py RECORDS_DIR [tests/data/h200_unseen]

Keeps, per set, batch row 0 and head 0: `d64_bfloat16_full` (non-causal: every key and value, the last 64 query
rows, each kernel's o, lse, dq of those rows), `d128_float16_causal` truncated to its first 256 rows (causal: those
rows' outputs do not depend on later keys; o and dq of rows 192..255) and `compiled` (torch.compile'd SDPA, the
backend SDPA chose: every key, the last 64 rows' o). The layout metadata says what is kept, as in
tests/data/h200_bits (replay/gpu_fidelity.RecordedSet reads it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors import safe_open
from fa_forensics.replay.gpu_fidelity import write_tensors

KEEP = {  # set -> (T kept, first kept output row)
    "d64_bfloat16_full": (1024, 960),
    "d128_float16_causal": (256, 192),
    "compiled": (512, 448),
}
# causal set -> the keys [j0, j1) whose dK and dV are kept: under a causal mask only rows j0.. see them, and their
# P needs only those keys' scores and the rows' lse, so rows j0..T and keys j0..j1 recompute them exactly
KEY_SLICES = {"d128_float16_causal": (832, 896)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src = Path(argv[0])
    dst = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "tests" / "data" / "h200_unseen"
    dst.mkdir(parents=True, exist_ok=True)
    for tag, (t_keep, r0) in KEEP.items():
        with safe_open(str(src / f"{tag}.safetensors"), "pt") as f:
            layout = json.loads(f.metadata()["layout"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        out = {}
        for name in ("q", "do"):
            if f"{tag}.{name}" in t:
                out[f"{tag}.{name}"] = t[f"{tag}.{name}"][:1, :1, r0:t_keep]
        for name in ("k", "v"):
            out[f"{tag}.{name}"] = t[f"{tag}.{name}"][:1, :1, :t_keep]
        for kernel in layout["kernels"]:
            for name in ("o", "dq"):
                if f"{tag}.{kernel}.{name}" in t:
                    out[f"{tag}.{kernel}.{name}"] = t[f"{tag}.{kernel}.{name}"][:1, :1, r0:t_keep]
            if f"{tag}.{kernel}.lse" in t:
                lse = t[f"{tag}.{kernel}.lse"].reshape(*t[f"{tag}.q"].shape[:2], -1)
                out[f"{tag}.{kernel}.lse"] = lse[:1, :1, r0:t_keep]
        kept = dict(layout, batch=0, heads=[0], T=t_keep, o_rows=[r0, t_keep], dq_rows=[r0, t_keep], dkdv_keys=None,
                    q_rows=[r0, t_keep], source=f"{tag}.safetensors")
        write_tensors(dst / f"{tag}.safetensors.xz", out, {"layout": json.dumps(kept)})
        print(tag, sum(v.numel() * v.element_size() for v in out.values()), "bytes")
    for tag, keys in KEY_SLICES.items():
        key_slice(src, dst, tag, keys)
    return 0


def key_slice(src: Path, dst: Path, tag: str, keys: tuple[int, int]) -> None:
    """Batch row 0, head 0 of a causal set: q, do and every kernel's o, lse of rows j0..T; k, v and every kernel's
    dk, dv of keys [j0, j1) (file `<tag>_keys<j0>`)."""
    j0, j1 = keys
    with safe_open(str(src / f"{tag}.safetensors"), "pt") as f:
        layout = json.loads(f.metadata()["layout"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert layout["causal"], "a key slice needs a causal set"
    T = t[f"{tag}.q"].shape[2]
    out = {f"{tag}.{n}": t[f"{tag}.{n}"][:1, :1, j0:T] for n in ("q", "do")}
    out |= {f"{tag}.{n}": t[f"{tag}.{n}"][:1, :1, j0:j1] for n in ("k", "v")}
    for kernel in layout["kernels"]:
        lse = t[f"{tag}.{kernel}.lse"].reshape(*t[f"{tag}.q"].shape[:2], -1)
        out[f"{tag}.{kernel}.o"] = t[f"{tag}.{kernel}.o"][:1, :1, j0:T]
        out[f"{tag}.{kernel}.lse"] = lse[:1, :1, j0:T]
        for name in ("dk", "dv"):
            out[f"{tag}.{kernel}.{name}"] = t[f"{tag}.{kernel}.{name}"][:1, :1, j0:j1]
    kept = dict(layout, batch=0, heads=[0], q_rows=[j0, T], o_rows=[j0, T], dq_rows=None, dkdv_keys=[j0, j1],
                source=f"{tag}.safetensors")
    write_tensors(dst / f"{tag}_keys{j0}.safetensors.xz", out, {"layout": json.dumps(kept)})
    print(f"{tag}_keys{j0}", sum(v.numel() * v.element_size() for v in out.values()), "bytes")


if __name__ == "__main__":
    sys.exit(main())
