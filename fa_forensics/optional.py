"""The optional parts of fa-forensics, each installed by one extra of the package.

`require(module, needed_for)` imports an optional module or raises `MissingExtra`, whose one line
names what needs it and the command that installs it (the CLI prints it and exits with code 2).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from fa_forensics.errors import MissingExtra

# top-level module -> the extra of fa-forensics that installs it (pyproject.toml [project.optional-dependencies])
EXTRA_OF = {
    "triton": "gpu",
    "dask": "dask",
    "distributed": "dask",
    "tensorboard": "tensorboard",
}


def require(module: str, needed_for: str) -> ModuleType:
    """`module` imported, or MissingExtra naming `needed_for` and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingExtra(module, EXTRA_OF[top], needed_for, str(exc)) from None
