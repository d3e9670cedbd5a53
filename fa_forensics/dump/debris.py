"""What a killed writer leaves beside a store, and how a later run tells it from a live writer's files.

A writer builds a store in a hidden staging folder beside it (`.NAME.<random>.tmp`, locked by
`.NAME.<random>.tmp.lock`) while holding `NAME.lock`; a normal end removes all three. A writer killed by
SIGKILL (or a power cut) leaves them, and an `--overwrite` cut between its two renames leaves the previous
dump in `.NAME.<random>.old`. Each lock file records its holder ("pid P on HOST, ..."): a holder whose pid
is not alive on this host is dead, and what it staged is debris. `clean_staging` removes the staging stores
of dead writers (called with NAME.lock held, so no live writer of NAME is staging); `leftovers` lists every
such file for `verify`. A moved-aside old dump is listed, never deleted: it may be the only copy.
"""
from __future__ import annotations

import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from fa_forensics.dump.safe_read import StrPath

_HOLDER_RE = re.compile(r"^pid (\d+) on (\S+?),")


@dataclass(frozen=True)
class Leftover:
    """One file or folder beside a store left by a writer that is not running: `path` and `what` it is."""

    path: str
    what: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "what": self.what}


def read_holder(lock: Path) -> str:
    """The holder line of a lock file ('' when missing, unreadable, a link (never opened) or not a regular file:
    a FIFO planted at its name is opened non-blocking and never read)."""
    try:
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        text = os.pread(fd, 400, 0).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)
    return "".join(c for c in (text.splitlines() or [""])[0] if c.isprintable()).strip()[:200]


def holder_dead(line: str) -> bool:
    """Whether a lock's holder line names a pid on this host that is not alive (unknown holders are alive)."""
    m = _HOLDER_RE.match(line)
    if not m or m.group(2) != socket.gethostname():
        return False
    pid = int(m.group(1))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    return False


def _staged(store: Path) -> list[Path]:
    """Staging folders and their locks, and moved-aside dumps, beside `store` (links included, never followed)."""
    parent, prefix = store.parent, f".{store.name}."
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return [parent / n for n in sorted(names)
            if n.startswith(prefix) and (n.endswith(".tmp") or n.endswith(".tmp.lock") or n.endswith(".old"))]


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def clean_staging(store: Path) -> list[Path]:
    """Remove the staging stores (and their lock files) of writers of `store` that died; return what went.

    Call it only while holding `store`'s own lock: then every staging folder beside it whose lock names a
    dead holder, or that has no lock and no live writer, is debris.
    """
    import shutil

    removed = []
    for path in _staged(Path(store)):
        if not path.name.endswith(".tmp") or not _is_dir(path):
            continue
        lock = path.with_name(path.name + ".lock")
        line = read_holder(lock)
        if line and not holder_dead(line):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(lock) and not os.path.islink(lock):
            os.unlink(lock)
        removed.append(path)
    return removed


def leftovers(store: StrPath) -> list[Leftover]:
    """Files beside `store` left by writers that are not running (for `verify`)."""
    store = Path(store)
    out = []
    own_lock = store.with_name(store.name + ".lock")
    line = read_holder(own_lock)
    if os.path.lexists(own_lock) and (not line or holder_dead(line)):
        holder = line or "no holder recorded"
        out.append(Leftover(str(own_lock), f"lock file of a writer that is not running ({holder})"))
    for path in _staged(store):
        if path.name.endswith(".old"):
            out.append(Leftover(str(path), "a dump moved aside by an --overwrite that did not finish "
                                           "(kept: it may be the only copy)"))
        elif path.name.endswith(".tmp.lock"):
            held = read_holder(path)
            if not held or holder_dead(held):
                holder = held or "no holder"
                out.append(Leftover(str(path), f"lock of a staging store whose writer is not running ({holder})"))
        else:
            held = read_holder(path.with_name(path.name + ".lock"))
            if not held or holder_dead(held):
                out.append(Leftover(str(path), "staging store of a writer that is not running; "
                                               "the next write to this path removes it"))
    return out
