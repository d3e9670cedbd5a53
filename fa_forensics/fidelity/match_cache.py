"""Where `match` keeps its results: beside the evidence, never in it, and only where nobody else can write.

A match result depends only on the stored bytes of one layer-step and the recipes tried, so it is
kept in a content-addressed file `<cache dir>/match/<fingerprint>.json` (the sha256 of those bytes
and recipes, `fidelity.match.fingerprint`): a changed dump has another fingerprint and is matched
again, a copy of a dump finds its original's result. A dump is never written.

The cache directory is $FA_FORENSICS_CACHE_DIR, else $XDG_CACHE_HOME/fa-forensics, else
~/.cache/fa-forensics; FA_FORENSICS_CACHE_DIR=off (or `--match-cache off`) keeps nothing. Files
are written symlink-safe: a temporary file made in the target directory, then renamed over the
target (a rename replaces a name, never follows it); a link at an entry's name is left in place with a
warning. A folder on the way to the cache directory that is a link another user planted in a sticky
world-writable folder is refused in one line (`check_parent_links`). The cache directory and its `match`
folder, their files and the key follow one ownership rule (`fidelity.cache_auth`: a folder the user's or
root's and writable by nobody else, a link judged by its target; a file the user's, writable by nobody else,
with one link), and every entry is sealed with an HMAC under the user's key: an entry that breaks the rule
or whose seal does not fit is one warning and is not read. What is read is still re-checked against the
stored bits (`fidelity.stored_match`).

A dump may carry a match in its layer groups' attributes (`replay_match`, fingerprinted over the
recipe list `IN_DUMP_RECIPES`; the bundled sample dumps do): `in_dump` reads it when its
fingerprint fits the stored bytes. It is never written. That fingerprint has no secret, so it says only
which bytes the match was made from: `fidelity.stored_match` takes nothing from it but the recipe it names
as reproducing 100 %, re-checked.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from pathlib import Path
from typing import Optional

from fa_forensics.dump.safe_files import atomic_write, check_parent_links
from fa_forensics.errors import TargetUnwritable
from fa_forensics.fidelity import cache_auth

ENV_DIR = "FA_FORENSICS_CACHE_DIR"
OFF = "off"
IN_DUMP_ATTR = "replay_match"
_IN_DUMP_VERSION = 1
# The recipes an in-dump match (format version 1) is fingerprinted over, in the order tried: a record of what
# that version tried, kept as written (not the current candidate list: a dump carrying it must keep matching).
IN_DUMP_RECIPES = (
    ("bf16-autocast-train", "ieee"), ("bf16-autocast-train", "tensor-core"), ("bf16-autocast-stabilized", "ieee"),
    ("bf16-autocast-stabilized", "tensor-core"), ("bf16-autocast", "ieee"), ("bf16-autocast", "tensor-core"),
    ("bf16-hw", "ieee"), ("bf16-hw", "tensor-core"), ("bf16", "ieee"), ("bf16", "tensor-core"), ("stabilized", "ieee"),
    ("stabilized", "tensor-core"), ("fp32", "ieee"), ("fp8-s1", "ieee"), ("fp8-s256", "ieee"), ("fp8-s448", "ieee"),
)

_MAX_ENTRY_BYTES = 4 * 2**20  # a match entry is a few kB (at most 256 candidates); a larger file is not ours
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


def _refusal(root: Path) -> Optional[str]:
    """Why the cache directory or its `match` folder (`root`) may hold files planted by someone else, or None."""
    return cache_auth.folder_refusal(root.parent) or cache_auth.folder_refusal(root)


def _refuse(why: str) -> None:
    warn(f"{why}; refused: nothing is read from or written to it (use a folder only you can write: "
         f"chmod go-w, or set {ENV_DIR})")


def read(key: str) -> Optional[dict]:
    """The cached entry of fingerprint `key` (its HMAC checked and removed), or None: absent, unreadable, in a
    folder or file the ownership rule refuses, or not written by this user's fa-forensics (one warning each)."""
    root = cache_dir()
    if root is None:
        return None
    path = root / f"{key}.json"
    check_parent_links(root, "match_cache", include_last=True)  # a link planted on the way: one line, exit 2
    why = _refusal(root)
    if why is not None:
        _refuse(why)
        return None
    try:  # a regular file of the user's, with one name, never blocking on a FIFO or reading a device
        raw = cache_auth.read_owned(path, _MAX_ENTRY_BYTES)
        if raw is None:
            return None
        secret = cache_auth.existing_key(root.parent)
    except cache_auth.Refused as exc:
        warn(f"{exc}; not read, the layer-step is matched again")
        return None
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError):
        warn(f"{path} is not readable JSON; the layer-step is matched again")
        return None
    if not isinstance(entry, dict) or entry.get("fingerprint") != key:
        warn(f"{path} does not hold the entry its name says; the layer-step is matched again")
        return None
    if secret is None or not cache_auth.unseal(entry, secret):
        warn(f"{path} is not sealed with this user's key (written by someone else, edited since, or by another "
             f"version); ignored, the layer-step is matched again")
        return None
    entry.pop(cache_auth.MAC_FIELD)
    return entry


def _prepare(root: Path) -> Optional[str]:
    """Make the cache directory and its `match` folder where absent (mode 700), never inside a folder of another
    user; why not, or why one that exists is refused (None: both are ready and the user's alone)."""
    for folder in (root.parent, root):
        why = cache_auth.folder_refusal(folder)
        if why is not None:
            return why
        if not folder.exists():
            why = cache_auth.creation_refusal(folder)
            if why is not None:
                return why
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            why = cache_auth.folder_refusal(folder)
            if why is not None:
                return why
    return None


def _set_aside(target: Path) -> bool:
    """Make room for a new entry at `target` in the user's own `match` folder: a file there the ownership rule
    refuses (another user's, writable by others, a second name of a file, a FIFO) loses that name, and what it
    shares its data with is left as it was. False (with one warning) for a symbolic link: left in place."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return True
    if stat.S_ISLNK(st.st_mode):
        warn(f"{target} is a symbolic link; not followed, not replaced")
        return False
    if cache_auth.file_refusal(target, st) is not None:
        os.unlink(target)
    return True


def write(key: str, entry: dict) -> None:
    """Keep `entry` under fingerprint `key`, sealed with the user's key; a failure is one warning, never an
    error."""
    root = cache_dir()
    if root is None:
        return
    target = root / f"{key}.json"
    check_parent_links(root, "match_cache", include_last=True)  # a link planted on the way: one line, exit 2
    try:
        why = _prepare(root)
        if why is not None:
            _refuse(why)
            return
        secret = cache_auth.user_key(root.parent)
        if not _set_aside(target):
            return
        record = cache_auth.seal({**entry, "fingerprint": key}, secret)
        atomic_write(target, json.dumps(record), "match cache", mode=0o600)
    except cache_auth.Refused as exc:
        warn(f"{exc}; the result is not kept (set {ENV_DIR} to a folder only you can write, or to 'off')")
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
    return cached["fingerprint"] == in_dump_fingerprint(t, accumulation)


def in_dump_fingerprint(t, accumulation: Optional[str]) -> str:
    """The fingerprint an in-dump match of these stored bytes carries. Anyone can compute it (it has no secret):
    it says which bytes a match was made from, never that the match is right."""
    recipes = [tuple(r) for r in IN_DUMP_RECIPES if accumulation is None or r[1] == accumulation]
    return data_hash(t, (_IN_DUMP_VERSION, t.scale, t.causal, recipes))


def in_dump(dump, step: int, layer: int, t, accumulation: Optional[str]) -> Optional[dict]:
    """The match kept in the layer group's attributes, when its fingerprint fits the stored bytes:
    {heads, candidates[]}, or None."""
    cached = in_dump_attrs(dump, step, layer).get(accumulation)
    return cached if in_dump_fits(cached, t, accumulation) else None
