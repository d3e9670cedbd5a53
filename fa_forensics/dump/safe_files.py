"""Writing files without trusting the directory they go into.

Dumps and outputs often live in shared places (a scratch folder, a colleague's run) and the tool may run
as root, so every write goes through these primitives:

- `refuse_link(path, setting)`: a path whose final component is a symbolic link, a file with several hard
  links, a FIFO, a device or a socket is refused: writing there would change something the user did not
  name (as root, `--json /dev/null` would replace the device). So is a path through a folder that is a link
  the kernel's protected_symlinks rule would not follow (`check_parent_links`).
- `refuse_foreign(path, setting)`: a file or folder owned by another user is never replaced.
- `open_new(path)`: create a file exclusively, never following a link (O_CREAT | O_EXCL | O_NOFOLLOW).
- `atomic_write(path, data)`: write to a private temporary file in the target's folder (mkstemp), fsync it
  and rename it over the target: a reader sees the old file or the new one, never a half-written one, and
  a link planted at the target is refused, never written through. A file of the user's it replaces keeps
  its mode.
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

from fa_forensics.dump.safe_read import StrPath, special_kind
from fa_forensics.errors import (
    DiskFull, ForeignOwnerRefused, LinkRefused, ParentLinkRefused, SpecialFileRefused, TargetExists, TargetUnwritable,
)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc` is the file system saying it is full (ENOSPC) or the user's quota is spent (EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def free_bytes(path: StrPath) -> int | None:
    """Bytes free to this user on the file system holding `path` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def disk_full(exc: OSError, path: StrPath, setting: str, needed: int | None = None) -> DiskFull:
    """The typed error for an ENOSPC / EDQUOT that happened while writing `path`."""
    quota = exc.errno == errno.EDQUOT
    return DiskFull(path, setting, needed, free_bytes(path), quota=quota)


def unwritable(exc: OSError, path: StrPath, setting: str, needed: int | None = None) -> DiskFull | TargetUnwritable:
    """A worded error for an OSError met while writing `path`: DiskFull when it is about space."""
    if is_no_space(exc):
        return disk_full(exc, path, setting, needed)
    return TargetUnwritable(path, setting, str(exc.strerror or exc))


def refuse_link(path: StrPath, setting: str) -> None:
    """Refuse to write at `path` when its final component is a symbolic link, a file with other hard links, a FIFO,
    a device or a socket, or when a folder on the way is a link `check_parent_links` would not follow."""
    p = Path(path)
    check_parent_links(p, setting)
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
    kind = special_kind(st.st_mode)
    if kind is not None and not stat.S_ISDIR(st.st_mode):
        raise SpecialFileRefused(p, setting, kind)


def refuse_foreign(path: StrPath, setting: str) -> os.stat_result | None:
    """Refuse to replace `path` when it belongs to another user; its lstat (None when it does not exist)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TargetUnwritable(path, setting, str(exc.strerror or exc)) from None
    if st.st_uid != os.geteuid():
        raise ForeignOwnerRefused(path, setting, st.st_uid)
    return st


_MAX_LINKS = 40  # links followed in one path before the kernel says ELOOP


def check_parent_links(path: StrPath, setting: str, *, include_last: bool = False) -> None:
    """Walk the folders of `path` as the kernel does and refuse (ParentLinkRefused) a symbolic link its
    protected_symlinks rule would not follow: one in a sticky world-writable folder (/tmp, a shared scratch
    space) owned neither by the user, nor by root, nor by that folder's owner. `include_last`: check the last
    component too (a folder the tool writes into). Parts that do not exist yet end the walk."""
    parts = [x for x in str(Path(path).absolute()).split(os.sep) if x not in ("", ".")]
    if not include_last:
        parts = parts[:-1]
    resolved, links = os.sep, 0
    euid = os.geteuid()
    while parts:
        name = parts.pop(0)
        if name == "..":
            resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, name)
        try:
            st = os.lstat(candidate)
        except OSError:
            return  # missing (made by the write) or unreadable (the write says so)
        if not stat.S_ISLNK(st.st_mode):
            resolved = candidate
            continue
        links += 1
        target = os.readlink(candidate)
        if links > _MAX_LINKS:
            raise TargetUnwritable(path, setting, f"its folders hold more than {_MAX_LINKS} symbolic links in a row")
        folder = os.stat(resolved)
        sticky_shared = folder.st_mode & stat.S_ISVTX and folder.st_mode & stat.S_IWOTH
        if sticky_shared and st.st_uid not in (euid, 0, folder.st_uid):
            raise ParentLinkRefused(path, setting, candidate, target, st.st_uid)
        if os.path.isabs(target):
            resolved = os.sep
        parts[:0] = [x for x in target.split(os.sep) if x not in ("", ".")]


def open_new(path: StrPath, mode: int = 0o644) -> int:
    """A file descriptor of a file created here and now (O_EXCL: never an existing file, never through a link)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)


def open_nofollow(path: StrPath, flags: int, mode: int = 0o644) -> int:
    """os.open with O_NOFOLLOW: a symbolic link at `path` fails with ELOOP instead of being followed."""
    return os.open(path, flags | _NOFOLLOW, mode)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: StrPath, data: bytes | str, setting: str, *, mode: int | None = None,
                 exclusive: bool = False) -> None:
    """Write `data` to `path` via a temporary file in the same folder, fsync, then rename over `path`.

    A link, special file or another user's file at `path` is refused (`refuse_link`, `refuse_foreign`); a full
    disk raises DiskFull naming the bytes needed. The file gets `mode`, else the mode of the file it replaces,
    else 0666 & ~umask. Parent folders are created. `exclusive`: `path` must not exist when the file is put in
    place (a hard link made with link(2), which fails on any existing name), so of two writers of one new path only
    one succeeds (TargetExists for the other).
    """
    p = Path(path)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    refuse_link(p, setting)
    replaced = refuse_foreign(p, setting)
    if mode is None:
        mode = stat.S_IMODE(replaced.st_mode) & 0o777 if replaced is not None else 0o666 & ~_umask()
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            try:
                os.link(tmp, p)
            except FileExistsError:
                raise TargetExists(p, setting) from None
        else:
            os.replace(tmp, p)
            tmp = None
    except OSError as exc:
        _discard(tmp)  # first, so that the space it held counts as free in the message
        tmp = None
        raise unwritable(exc, p, setting, len(payload)) from None
    finally:
        _discard(tmp)


def _discard(tmp: str | None) -> None:
    if tmp is not None:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def make_staging_dir(target: StrPath, setting: str) -> Path:
    """A new empty hidden folder beside `target` (`.NAME.<random>.tmp`) to build an output in. It gets the mode
    a plain mkdir would (0777 & ~umask), not mkdtemp's 0700, since it becomes the output others read."""
    t = Path(target)
    check_parent_links(t, setting)
    try:
        t.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{t.name}.", suffix=".tmp", dir=t.parent))
        os.chmod(staged, 0o777 & ~_umask())
        return staged
    except OSError as exc:
        raise unwritable(exc, t, setting) from None


def move_into_place(staged: StrPath, target: StrPath, *, replace: bool = True) -> None:
    """Rename a complete staged folder to `target`. With `replace`, an existing `target` (already checked
    replaceable) is first renamed aside (`.NAME.<random>.old`), put back if the rename fails, and deleted only once
    the new one is in place. Without it the rename itself refuses anything but a missing or empty `target`
    (TargetExists), so no other writer's store is ever replaced. OSError propagates."""
    staged, target = Path(staged), Path(target)
    if target.is_symlink():
        raise LinkRefused(target, "out", os.readlink(target))
    refuse_foreign(target, "out")
    if not replace:
        try:
            os.rename(staged, target)  # fails on a file or a folder that is not empty
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            raise TargetExists(target, "out") from None
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise TargetExists(target, "out") from None
            raise
        return
    aside = None
    if target.exists() and (target.is_file() or any(target.iterdir())):
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, aside)  # a directory replaces the empty one mkdtemp made
    try:
        os.replace(staged, target)
    except OSError:
        if aside is not None:
            os.replace(aside, target)
        raise
    if aside is not None:
        remove_tree(aside)


def remove_tree(path: StrPath) -> None:
    """Delete a folder the tool made (links inside are removed, never followed); a missing one is fine."""
    p = Path(path)
    try:
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.exists():
            shutil.rmtree(p, ignore_errors=True)
    except OSError:
        pass

