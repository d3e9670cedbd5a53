"""fa-forensics: forensics of low-precision (BF16/FP8) flash attention.

Library entry points (imported lazily so `import fa_forensics` stays cheap):
- `fa_forensics.capture(model, out=..., steps=...)`: record Q, K, V, O, dO, X during training.
- `fa_forensics.open_dump(path)`: lazy reader of a dump store.
- `fa_forensics.replay(q, k, v, config, do=None)` and `fa_forensics.ReplayConfig`: replay attention.
- `fa_forensics.stable_attention(q, k, v, causal=True, beta=2.0, eps=1e-3)`: the paper's fix.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "capture": ("fa_forensics.capture", "capture"),
    "open_dump": ("fa_forensics.dump", "open_dump"),
    "replay": ("fa_forensics.replay", "replay"),
    "ReplayConfig": ("fa_forensics.replay.config", "ReplayConfig"),
    "stable_attention": ("fa_forensics.replay.stable", "stable_attention"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'fa_forensics' has no attribute {name!r}")
