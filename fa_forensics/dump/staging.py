"""Build a store beside its destination and move it into place only when it is complete.

`staged_store(dst, setting, needed, overwrite=...)` holds `dst`'s lock (so no capture writes it meanwhile, and
the staging stores of writers killed earlier are removed), decides under that lock whether `dst` may be written
(a store that appeared since the caller looked is refused unless `overwrite`: two writers of one path never both
succeed), yields a fresh hidden staging folder beside `dst`, and, when the block ends without an error, renames
the staging folder to `dst` (an existing dump there, already checked replaceable, is moved aside and deleted once
the new one is in place). A block that fails leaves `dst` as it was and no staging folder: zarr writes a chunk's
folders and file in worker threads, and one failed write (a full disk) does not stop the others, which would
create the staging folder again after it was deleted; so the writes still in flight are waited for first. A full
disk is worded as DiskFull naming `needed` bytes.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fa_forensics.dump.lock import StoreLock
from fa_forensics.dump.safe_files import make_staging_dir, move_into_place, refuse_link, remove_tree, unwritable
from fa_forensics.dump.safe_read import StrPath
from fa_forensics.errors import TargetExists, TargetUnwritable

# How long a failed write waits for the store writes still in flight before the staging folder is removed.
SETTLE_SECONDS = 60.0


def occupied(path: Path) -> bool:
    """Whether `path` holds something a new store would replace (a file, or a folder that is not empty)."""
    if not os.path.lexists(path):
        return False
    try:
        return not path.is_dir() or any(path.iterdir())
    except FileNotFoundError:
        return False
    except OSError:
        return True


def check_replaceable(dst: Path, setting: str, overwrite: bool) -> None:
    """TargetExists unless `dst` is free, or `overwrite` and it holds an fa-forensics dump."""
    if not occupied(dst):
        return
    if not overwrite:
        raise TargetExists(dst, setting)
    from fa_forensics.dump.writer import _existing_format

    if not dst.is_dir() or _existing_format(dst) is None:
        raise TargetExists(dst, setting, foreign=True)


def settle_store_writes(timeout: float = SETTLE_SECONDS) -> None:
    """Wait until zarr's I/O loop has no task left in flight (at most `timeout` seconds)."""
    try:
        from zarr.core import sync as zarr_sync
    except ImportError:
        return
    loop = zarr_sync.loop[0]
    if loop is None or not loop.is_running():
        return

    async def drain() -> None:
        me = asyncio.current_task()
        while pending := [t for t in asyncio.all_tasks() if t is not me and not t.done()]:
            await asyncio.wait(pending, timeout=0.05)

    try:
        zarr_sync.sync(drain(), loop=loop, timeout=timeout)
    except Exception:  # a timeout: removal below retries and says what it could not remove
        pass


def discard_staging(tmp: Path) -> bool:
    """Remove a staging folder once no write into it is in flight; whether it is gone."""
    settle_store_writes()
    for _ in range(3):
        remove_tree(tmp)
        lock = tmp.with_name(tmp.name + ".lock")
        if lock.is_file() and not lock.is_symlink():
            remove_tree(lock)
        if not os.path.lexists(tmp):
            return True
        settle_store_writes(5.0)
    return not os.path.lexists(tmp)


@contextmanager
def staged_store(dst: StrPath, setting: str, needed: int | None = None, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a staging folder for a new store at `dst`; see the module docstring."""
    dst = Path(dst)
    refuse_link(dst, setting)
    lock = StoreLock(dst).acquire()
    tmp = None
    try:
        check_replaceable(dst, setting, overwrite)  # under the lock: what another writer made meanwhile counts
        tmp = make_staging_dir(dst, setting)
        yield tmp
        move_into_place(tmp, dst, replace=overwrite)
        tmp = None
    except OSError as exc:
        error = unwritable(exc, dst, setting, needed)
        if tmp is not None:  # first, so that the space it held counts as free in the message
            gone = discard_staging(tmp)
            if not gone:
                error = TargetUnwritable(dst, setting, error.reason.replace(
                    "nothing was left in its place", f"its staging folder {tmp} could not be removed, remove it"))
            tmp = None
        raise error from None
    finally:
        if tmp is not None:
            discard_staging(tmp)
        lock.release()
