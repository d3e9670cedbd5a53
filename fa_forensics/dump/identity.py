"""Store identity: which model a dump came from, so steps of two models never mix in one store.

The fingerprint hashes the model's architecture (every parameter's name, shape and dtype), not
its weights: the same run captured again later matches, another model does not. It is kept in
the root attributes as `model.fingerprint`; a writer that appends to a store from another model
is refused unless asked (`allow_other_model`).
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fa_forensics.dump.safe_read import StrPath
from fa_forensics.errors import OtherModel

if TYPE_CHECKING:
    import torch


def model_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits of SHA-256 over the model's parameter names, shapes and dtypes."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        for wrapper in ("_orig_mod.", "module."):  # torch.compile and DDP wrap the same model
            while name.startswith(wrapper):
                name = name[len(wrapper):]
        h.update(f"{name} {tuple(p.shape)} {p.dtype}\n".encode())
    return h.hexdigest()[:16]


def describe(model_attrs: Mapping[str, Any]) -> str:
    """'GPT (1.2M parameters, fingerprint 3fa2...)' for messages."""
    parts = [str(model_attrs.get("class") or "a model")]
    extra = []
    if isinstance(model_attrs.get("n_params"), int):
        extra.append(f"{model_attrs['n_params']:,} parameters")
    extra.append(f"fingerprint {model_attrs.get('fingerprint')}")
    return f"{parts[0]} ({', '.join(extra)})"


def check_same_model(path: StrPath, stored: Mapping[str, Any] | None, new: Mapping[str, Any] | None,
                     allow_other_model: bool) -> bool:
    """True if the store has no fingerprint yet and `new` brings one (the caller records it).

    Raises OtherModel (a DumpError) when both have fingerprints that differ, unless allow_other_model.
    """
    stored = stored if isinstance(stored, Mapping) else {}
    new = new if isinstance(new, Mapping) else {}
    stored_fp, new_fp = stored.get("fingerprint"), new.get("fingerprint")
    if new_fp is None:
        return False
    if stored_fp is None:
        return True
    if stored_fp != new_fp and not allow_other_model:
        raise OtherModel(f"{path} holds steps of {describe(stored)}, but this run's model is {describe(new)}")
    return False
