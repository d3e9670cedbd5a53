"""Where a report is written: built in a hidden folder beside --out, moved into place only when complete.

A report that fails (a full disk, Ctrl-C, a bug) leaves --out as it was and no half-written page, never a
folder of empty subfolders. Publishing replaces, inside --out, only what the report writes (index.html and
one folder per analysis); a symbolic link at --out or at one of those names is refused before any work.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fa_forensics.dump.safe_files import (
    disk_full, free_bytes, is_no_space, make_staging_dir, move_into_place, refuse_link, remove_tree, unwritable,
)
from fa_forensics.errors import DiskFull

SETTING = "out"


def check_destination(out: Path, names: list[str]) -> None:
    """Refuse --out, or a name inside it the report would replace, that is a link (or not a folder)."""
    refuse_link(out, SETTING)
    if out.exists() and not out.is_dir():
        from fa_forensics.errors import TargetUnwritable

        raise TargetUnwritable(out, SETTING, "it exists and is not a folder")
    for name in names:
        refuse_link(out / name, SETTING)


def publish(staged: Path, out: Path) -> None:
    """Move every entry of `staged` into `out` (index.html last), replacing what the report wrote before."""
    if not out.exists():
        os.replace(staged, out)
        return
    entries = sorted(os.listdir(staged), key=lambda n: n == "index.html")
    for name in entries:
        src, dst = staged / name, out / name
        refuse_link(dst, SETTING)
        if dst.is_dir():
            move_into_place(src, dst)
        else:
            os.replace(src, dst)
    remove_tree(staged)


@contextmanager
def staged_report(out, names: list[str]) -> Iterator[Path]:
    """Yield a fresh staging folder for the report; on a clean exit publish it to `out`."""
    out = Path(out)
    check_destination(out, ["index.html", *names])
    staged = make_staging_dir(out, SETTING)
    try:
        yield staged
        publish(staged, out)
    except OSError as exc:
        remove_tree(staged)  # first, so that the space it held counts as free in the message
        raise (disk_full(exc, out, SETTING) if is_no_space(exc) else unwritable(exc, out, SETTING)) from None
    except DiskFull as exc:  # a file of the staged report: name --out, and the space free once it is gone
        remove_tree(staged)
        raise DiskFull(out, SETTING, None, free_bytes(out), exc.quota) from None
    finally:
        remove_tree(staged)
