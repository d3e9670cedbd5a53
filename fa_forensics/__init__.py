"""fa-forensics: forensics of low-precision (BF16/FP8) flash attention.

Library entry points (imported lazily so `import fa_forensics` stays cheap):
- `fa_forensics.capture(model, out=..., steps=...)`: record Q, K, V, O, dO, X during training.
- `fa_forensics.open_dump(path)`: lazy reader of a dump store.
- `fa_forensics.replay(q, k, v, config, do=None)` and `fa_forensics.ReplayConfig`: replay attention
  (`fa_forensics.capture` and `fa_forensics.replay` are packages callable as their functions).
- `fa_forensics.stable_attention(q, k, v, causal=True, beta=2.0, eps=1e-3)`: the paper's fix.
"""
from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

_LAZY = {
    "capture": ("fa_forensics.capture", None),  # the package, callable as its function `capture`
    "open_dump": ("fa_forensics.dump", "open_dump"),
    "replay": ("fa_forensics.replay", None),  # the package, callable as its function `replay`
    "ReplayConfig": ("fa_forensics.replay.config", "ReplayConfig"),
    "stable_attention": ("fa_forensics.replay.stable", "stable_attention"),
}

__all__ = ["__version__", *_LAZY]


class CallableModule(types.ModuleType):
    """A package that is also the function of its own name: `fa_forensics.capture(...)` and
    `fa_forensics.replay(...)` call the functions `capture` and `replay` of those packages.

    Importing a subpackage sets the attribute of the same name on its parent to the package, so a
    function and a subpackage cannot share a name; making the package callable gives one object
    whatever was imported before: `from fa_forensics import replay` works as a function and as a
    package (`replay.ReplayConfig`)."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


def make_callable(module_name: str) -> None:
    """Make the (imported) package `module_name` callable as its function of the same name."""
    sys.modules[module_name].__class__ = CallableModule


def lazy_exports(module_name: str, exports: dict[str, str]):
    """The `__getattr__` (PEP 562) of a package whose names `exports` maps to the module defining each: the
    module is imported when a name is first used, so importing the package (or a light module inside it)
    does not import what its heavy modules import (torch, zarr)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[module_name], name, value)
        return value

    return __getattr__


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'fa_forensics' has no attribute {name!r}")
