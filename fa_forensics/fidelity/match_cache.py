"""Where `match` keeps its results: beside the evidence, never in it, and only where nobody else can write.

A match result depends only on the stored bytes of one layer-step and the recipes tried, so it is
kept in a content-addressed file `<cache dir>/match/<fingerprint>.json` (the sha256 of those bytes
and recipes, `fidelity.match.fingerprint`): a changed dump has another fingerprint and is matched
again, a copy of a dump finds its original's result. A dump is never written.

The cache directory is $FA_FORENSICS_CACHE_DIR, else $XDG_CACHE_HOME/fa-forensics, else
~/.cache/fa-forensics; FA_FORENSICS_CACHE_DIR=off (or `--match-cache off`) keeps nothing. Files
are written symlink-safe: a temporary file made in the target directory, then renamed over the
target (a rename replaces a link, never follows it); a target or `match` directory that is a
symbolic link is refused with a warning, and reads take a regular file only (O_NOFOLLOW, never blocking on
a FIFO or reading a device: `dump.safe_read`). A folder on the way to the cache directory that is a link
another user planted in a sticky world-writable folder is refused in one line (`check_parent_links`). As ssh
refuses a key in a folder others control, the cache directory and its `match` folder are refused (nothing read,
nothing written, one warning) when either is writable by group or others or owned by another user than the one
running (or root). What is read is still never believed: `fidelity.stored_match` re-checks it.

A dump may carry a match in its layer groups' attributes (`replay_match`, fingerprinted over the
recipe list `_IN_DUMP_RECIPES`; the bundled sample dumps do): `in_dump` reads it when its
fingerprint fits the stored bytes. It is never written.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Optional

from fa_forensics.dump.safe_files import atomic_write, check_parent_links
from fa_forensics.dump.safe_read import FileTooLarge, NotRegularFile, read_regular
from fa_forensics.errors import TargetUnwritable

ENV_DIR = "FA_FORENSICS_CACHE_DIR"
OFF = "off"
IN_DUMP_ATTR = "replay_match"
_IN_DUMP_VERSION = 1
# The recipes an in-dump match (format version 1) is fingerprinted over, in the order tried: a record of what
# that version tried, kept as written (not the current candidate list: a dump carrying it must keep matching).
_IN_DUMP_RECIPES = (
    ("bf16-autocast-train", "ieee"), ("bf16-autocast-train", "tensor-core"), ("bf16-autocast-stabilized", "ieee"),
    ("bf16-autocast-stabilized", "tensor-core"), ("bf16-autocast", "ieee"), ("bf16-autocast", "tensor-core"),
    ("bf16-hw", "ieee"), ("bf16-hw", "tensor-core"), ("bf16", "ieee"), ("bf16", "tensor-core"), ("stabilized", "ieee"),
    ("stabilized", "tensor-core"), ("fp32", "ieee"), ("fp8-s1", "ieee"), ("fp8-s256", "ieee"), ("fp8-s448", "ieee"),
)

_MAX_ENTRY_BYTES = 64 * 2**20  # a match entry is a few kB; a larger file is not one of ours
_override: Optional[str] = None  # set by the CLI's --match-cache; wins over the environment


class MatchCacheWarning(UserWarning):
    """The match cache could not be read or written, or what it held was refused; the result stands."""


def set_cache_dir(value: Optional[str]) -> None:
    """Redirect the cache (a directory) or switch it off ("off"); None restores the default."""
    global _override
    _override = None if value is None else str(value)


def cache_dir() -> Optional[Path]:
    """The directory match results go to, or None when the cache is off."""
    value = _override if _override is not None else os.environ.get(ENV_DIR)
    if value is not None:
        return None if value.strip().lower() == OFF or not value.strip() else Path(value).expanduser() / "match"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fa-forensics" / "match"


def data_hash(t, extra: object) -> str:
    """sha256 of the stored q, k, v, o (and mask) bytes of a layer-step and `extra` (a repr'd tuple)."""
    import torch  # here: setting the cache directory (every command's end) stays light

    h = hashlib.sha256()
    for x in (t.q, t.k, t.v, t.o, t.mask):
        if x is None:
            h.update(b"none")
            continue
        h.update(str((tuple(x.shape), str(x.dtype))).encode())
        h.update(x.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr(extra).encode())
    return h.hexdigest()


def warn(message: str) -> None:
    warnings.warn(MatchCacheWarning(f"match cache: {message}"), stacklevel=3)


def _not_trusted(folder: Path) -> Optional[str]:
    """Why `folder` may hold files planted by someone else (ssh's rule), or None (it is safe, or absent)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    if st.st_uid not in (os.getuid(), 0):
        return f"{folder} is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{folder} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} " \
               f"(mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _refused(root: Path) -> bool:
    """True (with one warning) when the cache directory or its `match` folder is not the user's alone."""
    why = _not_trusted(root.parent) or _not_trusted(root)
    if why is not None:
        warn(f"{why}; refused: nothing is read from or written to it (use a folder only you can write: "
             f"chmod go-w, or set {ENV_DIR})")
    return why is not None


def read(key: str) -> Optional[dict]:
    """The cached entry of fingerprint `key`, or None (absent, unreadable, refused, or a link: not followed)."""
    root = cache_dir()
    if root is None:
        return None
    path = root / f"{key}.json"
    check_parent_links(root, "match_cache", include_last=True)  # a link planted on the way: one line, exit 2
    if root.is_symlink():
        return None  # refused; `write` says so
    if _refused(root):
        return None
    try:  # a regular file only, never blocking on a FIFO or reading a device
        entry = json.loads(read_regular(path, _MAX_ENTRY_BYTES, follow=False))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            warn(f"{path} is a symbolic link; not followed, the layer-step is matched again")
        return None
    except (NotRegularFile, FileTooLarge) as exc:
        warn(f"{exc}; not read, the layer-step is matched again")
        return None
    except (ValueError, RecursionError):
        warn(f"{path} is not readable JSON; the layer-step is matched again")
        return None
    if not isinstance(entry, dict) or entry.get("fingerprint") != key:
        warn(f"{path} does not hold the entry its name says; the layer-step is matched again")
        return None
    return entry


def write(key: str, entry: dict) -> None:
    """Keep `entry` under fingerprint `key`; a failure is one warning, never an error."""
    root = cache_dir()
    if root is None:
        return
    target = root / f"{key}.json"
    check_parent_links(root, "match_cache", include_last=True)  # a link planted on the way: one line, exit 2
    try:
        for folder in (root.parent, root):  # made private; a folder that exists is only checked
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if root.is_symlink():
            warn(f"{root} is a symbolic link; nothing written there")
            return
        if _refused(root):
            return
        if target.is_symlink():
            warn(f"{target} is a symbolic link; not followed, not replaced")
            return
        atomic_write(target, json.dumps({**entry, "fingerprint": key}), "match cache", mode=0o600)
    except TargetUnwritable as exc:  # a link planted there, a full disk, a read-only folder
        warn(f"cannot write {target} ({exc.reason}); the result is not kept "
             f"(set {ENV_DIR} to a writable directory, or to 'off')")
    except OSError as exc:
        warn(f"cannot write in {root} ({exc.strerror or exc}); the result is not kept "
             f"(set {ENV_DIR} to a writable directory, or to 'off')")


def in_dump_name(accumulation: Optional[str]) -> str:
    """The layer attribute a dump keeps its match in (one per accumulation restriction)."""
    return IN_DUMP_ATTR if accumulation is None else f"{IN_DUMP_ATTR}_{accumulation}"


def in_dump_attrs(dump, step: int, layer: int) -> dict:
    """{accumulation restriction (None: both models): attribute value} of every match the layer group carries."""
    try:
        attrs = dict(dump._layer(step, layer).attrs)
    except Exception:  # a stand-in without zarr groups
        return {}
    out: dict[Optional[str], object] = {}
    for name, value in attrs.items():
        if name == IN_DUMP_ATTR:
            out[None] = value
        elif name.startswith(IN_DUMP_ATTR + "_"):
            out[name[len(IN_DUMP_ATTR) + 1:]] = value
    return out


def in_dump_fits(cached, t, accumulation: Optional[str]) -> bool:
    """The match a layer carries was made from these stored bytes (its fingerprint fits them)."""
    if not isinstance(cached, dict) or not isinstance(cached.get("fingerprint"), str):
        return False
    recipes = [list(r) for r in _IN_DUMP_RECIPES if accumulation is None or r[1] == accumulation]
    key = data_hash(t, (_IN_DUMP_VERSION, t.scale, t.causal, [tuple(r) for r in recipes]))
    return cached["fingerprint"] == key


def in_dump(dump, step: int, layer: int, t, accumulation: Optional[str]) -> Optional[dict]:
    """The match kept in the layer group's attributes, when its fingerprint fits the stored bytes:
    {heads, candidates[]}, or None."""
    cached = in_dump_attrs(dump, step, layer).get(accumulation)
    return cached if in_dump_fits(cached, t, accumulation) else None
