"""Where a report is written: built in a hidden folder beside --out, moved into place only when complete.

A report that fails (a full disk, Ctrl-C, a bug) leaves --out as it was and no half-written page, never a
folder of empty subfolders. Every report carries a list of what it wrote (`MARKER`, a hidden JSON file in
--out). --out may be a new name, an empty folder, or a folder holding an earlier report and nothing else:
then publishing replaces that earlier report, whose every file the list names. A folder holding anything
a report did not write (the user's notes, a file added to an analysis's folder, a report of a version that
kept no list) is refused before any work, so a report never deletes what it did not write. A symbolic link
at --out or inside it, and a folder on the way that is a link planted in a shared place, are refused too.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fa_forensics.dump.safe_files import (
    disk_full, free_bytes, is_no_space, make_staging_dir, refuse_foreign, refuse_link, remove_tree, unwritable,
)
from fa_forensics.dump.safe_read import read_regular
from fa_forensics.errors import DiskFull, NotReportFolder, TargetUnwritable

SETTING = "out"
MARKER = ".fa-forensics-report.json"  # {"fa_forensics_report": 1, "files": [every path the report wrote]}
_MARKER_VERSION = 1
_MAX_MARKER_BYTES = 16 * 2**20


def check_destination(out: Path, names: list[str]) -> None:
    """Refuse --out when it, or a name inside it the report would replace, is a link (or --out is not a folder),
    or when it holds anything an earlier report did not write."""
    refuse_link(out, SETTING)
    if out.exists() and not out.is_dir():
        raise TargetUnwritable(out, SETTING, "it exists and is not a folder")
    for name in names:
        refuse_link(out / name, SETTING)
    if out.is_dir():
        foreign = not_written_by_a_report(out)
        if foreign:
            raise NotReportFolder(out, SETTING, foreign)


def _walk(folder: Path) -> Iterator[tuple[str, bool]]:
    """(path relative to `folder`, is a folder) of everything under it; links are listed, never followed."""
    stack = [folder]
    while stack:
        current = stack.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                rel = Path(entry.path).relative_to(folder).as_posix()
                is_dir = entry.is_dir(follow_symlinks=False)
                yield rel, is_dir
                if is_dir:
                    stack.append(Path(entry.path))


def written_list(out: Path) -> set[str] | None:
    """The paths the report in `out` says it wrote, or None when `out` holds no list of ours (none, not a regular
    file, another user's, not our JSON)."""
    marker = out / MARKER
    try:
        st = os.lstat(marker)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        data = json.loads(read_regular(marker, _MAX_MARKER_BYTES, follow=False))
    except (OSError, ValueError, RecursionError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("fa_forensics_report") == _MARKER_VERSION \
        else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def not_written_by_a_report(out: Path) -> list[str]:
    """What `out` holds that no report wrote (sorted, at most 10): [] for an empty folder or an earlier report."""
    entries = [(rel, is_dir) for rel, is_dir in _walk(out) if rel != MARKER]
    if not entries:
        return []
    listed = written_list(out)
    if listed is None:
        return sorted(rel for rel, _ in entries if "/" not in rel)[:10]
    return sorted(rel for rel, _ in entries if rel not in listed)[:10]


def _write_marker(staged: Path) -> None:
    files = sorted(rel for rel, _ in _walk(staged))
    text = json.dumps({"fa_forensics_report": _MARKER_VERSION, "files": files}, indent=1) + "\n"
    (staged / MARKER).write_text(text)


def publish(staged: Path, out: Path) -> None:
    """Move the staged report into `out`: a new name is the staged folder renamed; an empty folder or an earlier
    report (checked again here) has its entries replaced, the list of what the report wrote last."""
    _write_marker(staged)
    if not out.exists():
        os.replace(staged, out)
        return
    foreign = not_written_by_a_report(out)
    if foreign:  # something appeared in --out while the report ran
        raise NotReportFolder(out, SETTING, foreign)
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    earlier, placed = [], []
    try:
        for name in sorted(os.listdir(out), key=lambda n: n != MARKER):  # the old list goes first
            refuse_foreign(out / name, SETTING)
            os.replace(out / name, aside / name)
            earlier.append(name)
        for name in sorted(os.listdir(staged), key=lambda n: (n == MARKER, n == "index.html")):
            refuse_link(out / name, SETTING)
            os.replace(staged / name, out / name)
            placed.append(name)
    except BaseException:  # put the earlier report back as it was
        for name in placed:
            remove_tree(out / name)
        for name in earlier:
            os.replace(aside / name, out / name)
        remove_tree(aside)
        raise
    remove_tree(aside)
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
