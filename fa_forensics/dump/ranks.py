"""The ranks of a multi-rank store: which trees it holds, and the order in which the ranks open it.

Rank 0 writes the root tree and the root attributes (the run description); rank r > 0 writes only
`rank_r/`. A store holds rank 0 always (the root) and every r of a `rank_r/` folder.

Rank 0 creates the store first: it may move an old dump aside (overwrite) or create the root, and
no other rank may touch the path until it has. When the ranks share an initialized process group a
barrier orders them (capture/session.py); otherwise (the session starts before the script creates
its process group, as under `fa-forensics capture`) they order themselves through rank 0's lock
file: once its store is open, rank 0 adds the line `ready RUN_ID` to the lock it holds
(`announce_ready`), and every other rank waits for that line with its own run's id (`wait_for_rank0`),
a bounded wait. The run id is one string all ranks of a run share (the capture command's, or
torchrun's rendezvous id); without one a rank accepts the ready line of a live holder.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Optional

from fa_forensics.dump.lock import lock_path
from fa_forensics.dump.safe_files import open_nofollow
from fa_forensics.dump.safe_read import StrPath
from fa_forensics.dump.schema import ATTRS_KEY, RANK_RE, rank_key
from fa_forensics.errors import DumpError

READY = "ready"
POLL_SECONDS = 0.05


def rank_links_out(path: StrPath) -> dict[int, str]:
    """{r: 'rank_r -> target'} for every `rank_r` folder of the store (or its zarr.json) that is a symbolic link
    leaving the store: another dump's tree linked in is not a rank of this run, it is damage."""
    from fa_forensics.dump.integrity import link_leaving

    out: dict[int, str] = {}
    try:
        entries = [(e.name, Path(e.path)) for e in os.scandir(path) if RANK_RE.match(e.name)]
    except OSError:
        return out
    for name, folder in entries:
        for node in (folder, folder / "zarr.json"):
            target = link_leaving(node, Path(path))
            if target is not None:
                rank = RANK_RE.match(name)
                assert rank is not None  # the entries were chosen by this match
                out[int(rank.group(1))] = f"{node.relative_to(path)} -> {target}"
                break
    return out


def store_ranks(path: StrPath) -> list[int]:
    """The ranks whose trees the store at `path` holds: 0 (the root) and every r of a `rank_r/` folder that stays
    in the store (a link leaving it is damage, `rank_links_out`, never a rank)."""
    try:
        names = [e.name for e in os.scandir(path) if e.is_dir()]
    except OSError:
        return [0]
    leaving = rank_links_out(path)
    return sorted({0, *(r for n in names if (m := RANK_RE.match(n)) and (r := int(m.group(1))) not in leaving)})


def rank_tree_of(path: StrPath) -> Optional[tuple[Path, int]]:
    """(store, r) when `path` is the `rank_r/` folder of a dump store (one rank's tree, not a store of its own),
    else None."""
    from fa_forensics.dump.metadata_checks import read_metadata

    p = Path(path)
    m = RANK_RE.match(p.name)
    if m is None:
        return None
    try:
        attrs = read_metadata(p.parent).get("attributes") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return (p.parent, int(m.group(1))) if isinstance(attrs.get(ATTRS_KEY), dict) else None


def ready_line(run_id: Optional[str]) -> str:
    """The line rank 0 adds to its lock file once the store is open."""
    return f"{READY} {run_id or '-'}"


def _lock_lines(store: Path) -> list[str]:
    """The lines of rank 0's lock file, [] when there is none (never followed through a link)."""
    try:
        fd = open_nofollow(lock_path(store, 0), os.O_RDONLY)
    except OSError:
        return []
    try:
        text = os.pread(fd, 2000, 0).decode(errors="replace")
    except OSError:
        text = ""
    finally:
        os.close(fd)
    return text.splitlines()


def _holder_alive(holder: str) -> bool:
    """False only when the holder line names a process of this host that no longer runs."""
    parts = holder.split()
    if len(parts) < 4 or parts[0] != "pid" or parts[2] != "on" or parts[3].rstrip(",") != socket.gethostname():
        return True
    try:
        os.kill(int(parts[1]), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def rank0_ready(store: StrPath, run_id: Optional[str]) -> bool:
    """True once rank 0 of the run `run_id` holds the store open (its lock file says `ready RUN_ID`)."""
    lines = _lock_lines(Path(store))
    if len(lines) < 2 or not lines[1].startswith(READY + " "):
        return False
    announced = lines[1][len(READY) + 1:].strip()
    if run_id is not None:
        return announced == run_id
    return _holder_alive(lines[0])


def wait_for_rank0(store: StrPath, rank: int, run_id: Optional[str], timeout: float) -> None:
    """Return once rank 0 of this run has opened the store; a DumpError after `timeout` seconds."""
    deadline = time.monotonic() + float(timeout)
    while not rank0_ready(store, run_id):
        if time.monotonic() >= deadline:
            raise DumpError(f"rank {rank} waited {timeout:g} s for rank 0 to create {store}, in vain: rank 0 did not "
                            f"start its capture or stopped before (see its output); run all ranks with the same "
                            f"capture settings")
        time.sleep(POLL_SECONDS)


def other_rank_trees(store: StrPath) -> list[str]:
    """The `rank_r/` folders (r > 0) in a store: trees other ranks wrote."""
    return [rank_key(r) for r in store_ranks(store) if r > 0]
