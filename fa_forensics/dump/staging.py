"""Build a store beside its destination and move it into place only when it is complete.

`staged_store(dst, setting, needed)` holds `dst`'s lock (so no capture writes it meanwhile, and the
staging stores of writers killed earlier are removed), yields a fresh hidden staging folder beside `dst`,
and, when the block ends without an error, renames the staging folder to `dst` (an existing dump there,
already checked replaceable, is moved aside and deleted once the new one is in place). A block that fails
leaves `dst` as it was and no staging folder; a full disk is worded as DiskFull naming `needed` bytes.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

from fa_forensics.dump.lock import StoreLock
from fa_forensics.dump.safe_files import make_staging_dir, move_into_place, refuse_link, remove_tree, unwritable
from fa_forensics.dump.safe_read import StrPath


@contextmanager
def staged_store(dst: StrPath, setting: str, needed: int | None = None) -> Iterator[Path]:
    """Yield a staging folder for a new store at `dst`; see the module docstring."""
    dst = Path(dst)
    refuse_link(dst, setting)
    lock = StoreLock(dst).acquire()
    tmp = None
    try:
        tmp = make_staging_dir(dst, setting)
        yield tmp
        move_into_place(tmp, dst)
        tmp = None
    except OSError as exc:
        if tmp is not None:  # first, so that the space it held counts as free in the message
            remove_tree(tmp)
            tmp = None
        raise unwritable(exc, dst, setting, needed) from None
    finally:
        if tmp is not None:
            remove_tree(tmp)
        lock.release()
