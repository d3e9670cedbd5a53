"""A zarr group's child as the kind of node the dump layout says it is.

zarr gives `Array | Group` for any key; the layout fixes which each key is (steps, layers and the timeline are
groups, tensors and timeline series are arrays). A node of the other kind is a malformed store: a DumpError
names it, where an attribute error deep inside an analysis would not.
"""
from __future__ import annotations

import zarr
from zarr.storage import LocalStore

from fa_forensics.errors import DumpError


def child_group(parent: zarr.Group, key: str) -> zarr.Group:
    """`parent[key]`, which the layout says is a group."""
    node = parent[key]
    if not isinstance(node, zarr.Group):
        raise DumpError(_wrong_kind(parent, key, "an array", "a group"))
    return node


def child_array(parent: zarr.Group, key: str) -> zarr.Array:
    """`parent[key]`, which the layout says is an array."""
    node = parent[key]
    if not isinstance(node, zarr.Array):
        raise DumpError(_wrong_kind(parent, key, "a group", "an array"))
    return node


def _wrong_kind(parent: zarr.Group, key: str, found: str, wanted: str) -> str:
    path = f"{parent.path}/{key}" if parent.path else key
    where = parent.store.root / path if isinstance(parent.store, LocalStore) else path
    return f"damaged: {where}: {found} where the dump holds {wanted}; re-capture it"
