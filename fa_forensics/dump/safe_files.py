"""Writing files without trusting the directory they go into.

Dumps and outputs often live in shared places (a scratch folder, a colleague's run) and the tool may run
as root, so every write goes through these primitives:

- `refuse_link(path, setting)`: a path whose final component is a symbolic link (or a file with several
  hard links) is refused: writing there would change a file the user did not name.
- `open_new(path)`: create a file exclusively, never following a link (O_CREAT | O_EXCL | O_NOFOLLOW).
- `atomic_write(path, data)`: write to a private temporary file in the target's folder (mkstemp), fsync it
  and rename it over the target: a reader sees the old file or the new one, never a half-written one, and
  a link planted at the target is replaced, never written through.
- `make_staging_dir(target)`: a fresh hidden folder beside `target` (`.NAME.<random>.tmp`, made by mkdir,
  which never follows a link) where an output is built before it is moved into place.
- `disk_full(exc, path, needed)`: an ENOSPC / EDQUOT OSError worded as a `DiskFull` error naming the
  path, the space needed and the space free.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

from fa_forensics.errors import DiskFull, LinkRefused, TargetUnwritable

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc` is the file system saying it is full (ENOSPC) or the user's quota is spent (EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def free_bytes(path) -> int | None:
    """Bytes free to this user on the file system holding `path` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def disk_full(exc: OSError, path, setting: str, needed: int | None = None) -> DiskFull:
    """The typed error for an ENOSPC / EDQUOT that happened while writing `path`."""
    quota = exc.errno == errno.EDQUOT
    return DiskFull(path, setting, needed, free_bytes(path), quota=quota)


def unwritable(exc: OSError, path, setting: str, needed: int | None = None):
    """A worded error for an OSError met while writing `path`: DiskFull when it is about space."""
    if is_no_space(exc):
        return disk_full(exc, path, setting, needed)
    return TargetUnwritable(path, setting, str(exc.strerror or exc))


def refuse_link(path, setting: str) -> None:
    """Refuse to write at `path` when its final component is a symbolic link, or a file with other hard links."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TargetUnwritable(p, setting, str(exc.strerror or exc)) from None
    if stat.S_ISLNK(st.st_mode):
        raise LinkRefused(p, setting, os.readlink(p))
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        raise LinkRefused(p, setting, None)


def open_new(path, mode: int = 0o644) -> int:
    """A file descriptor of a file created here and now (O_EXCL: never an existing file, never through a link)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)


def open_nofollow(path, flags: int, mode: int = 0o644) -> int:
    """os.open with O_NOFOLLOW: a symbolic link at `path` fails with ELOOP instead of being followed."""
    return os.open(path, flags | _NOFOLLOW, mode)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, data: bytes | str, setting: str, *, mode: int | None = None) -> None:
    """Write `data` to `path` via a temporary file in the same folder, fsync, then rename over `path`.

    A link at `path` is refused (LinkRefused); a full disk raises DiskFull naming the bytes needed.
    The file gets mode 0666 & ~umask unless `mode` is given. Parent folders are created.
    """
    p = Path(path)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    refuse_link(p, setting)
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, (0o666 & ~_umask()) if mode is None else mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
        tmp = None
    except OSError as exc:
        _discard(tmp)  # first, so that the space it held counts as free in the message
        tmp = None
        raise unwritable(exc, p, setting, len(payload)) from None
    finally:
        _discard(tmp)


def _discard(tmp) -> None:
    if tmp is not None:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def make_staging_dir(target, setting: str) -> Path:
    """A new empty hidden folder beside `target` (`.NAME.<random>.tmp`) to build an output in. It gets the mode
    a plain mkdir would (0777 & ~umask), not mkdtemp's 0700, since it becomes the output others read."""
    t = Path(target)
    try:
        t.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{t.name}.", suffix=".tmp", dir=t.parent))
        os.chmod(staged, 0o777 & ~_umask())
        return staged
    except OSError as exc:
        raise unwritable(exc, t, setting) from None


def move_into_place(staged, target) -> None:
    """Rename a complete staged folder to `target`. An existing `target` (already checked replaceable) is first
    renamed aside (`.NAME.<random>.old`) and deleted only once the new one is in place. OSError propagates."""
    staged, target = Path(staged), Path(target)
    if target.is_symlink():
        raise LinkRefused(target, "out", os.readlink(target))
    aside = None
    if target.exists() and (target.is_file() or any(target.iterdir())):
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, aside)  # a directory replaces the empty one mkdtemp made
    os.replace(staged, target)
    if aside is not None:
        remove_tree(aside)


def remove_tree(path) -> None:
    """Delete a folder the tool made (links inside are removed, never followed); a missing one is fine."""
    p = Path(path)
    try:
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.exists():
            shutil.rmtree(p, ignore_errors=True)
    except OSError:
        pass

