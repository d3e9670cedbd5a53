"""The trimmed H200 training capture (tests/data/h200_bits/train_capture, see its README) written as a dump."""
from __future__ import annotations

import json
from pathlib import Path

from fa_forensics.dump.writer import DumpWriter
from fa_forensics.replay.gpu_fidelity import read_tensors

BITS = Path(__file__).resolve().parents[1] / "data" / "h200_bits"
_KEPT_ATTRS = ("module", "scale", "causal", "dtype", "heads", "dropout_p", "autocast", "input_dtype", "head_dim")


def write_training_capture(dst: Path) -> Path:
    """The capture's Q, K, V and O of every recorded step and layer as a dump at `dst`, with the run's recorded
    attributes (device cuda:0, bf16 autocast) and the layer attributes a dump keeps; `dst`."""
    tensors, meta = read_tensors(BITS / "train_capture.safetensors.xz")
    with DumpWriter(dst, json.loads(meta["run_attrs"])) as w:
        for key, attrs in json.loads(meta["layer_attrs"]).items():
            step, layer = (int(x) for x in key.split("."))
            la = {k: v for k, v in attrs.items() if k in _KEPT_ATTRS}
            la["n_heads"] = len(la["heads"])
            for name in ("q", "k", "v", "o"):
                w.write_array(step, layer, name, tensors[f"step{step}.layer{layer}.{name}"], layer_attrs=la)
            w.complete_step(step)
    return dst
