"""Reading files without trusting them: regular files only, never blocking, never past their size.

A dump (or a cache folder) may hold a FIFO, a socket or a device where a file belongs (`tar x` as root
recreates them): opening a FIFO blocks until a writer comes, reading /dev/zero never ends. Every file
fa-forensics reads from a dump or a cache goes through `read_regular`: the path is stat'ed first (a special
file is refused without being opened), then opened non-blocking, checked again on the open descriptor
(it may have been swapped in between) and read up to the size fstat gave, never more.

A file is judged by what it holds, not by the size it claims: a sparse file (`truncate -s 1G`) has an apparent
size far above the blocks allocated to it, and reading it would fill memory with zeros the disk never held. A file
whose apparent size exceeds its allocated bytes by more than SPARSE_SLACK and more than SPARSE_RATIO-fold is
refused (SparseFile) before it is read. No writer of a dump or a cache makes one.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TypeAlias

from fa_forensics.errors import DumpError

# A path as callers give it: a str or any os.PathLike (pathlib.Path).
StrPath: TypeAlias = "str | os.PathLike[str]"

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def special_kind(mode: int) -> str | None:
    """'a FIFO (named pipe)', 'a character device', ... for a file mode that is not a regular file; None for one."""
    if stat.S_ISREG(mode):
        return None
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "a special file"


class NotRegularFile(DumpError):
    """A path that should be a regular file is a FIFO, a device, a socket or a folder: `.path`, `.kind`."""

    def __init__(self, path: StrPath, kind: str) -> None:
        self.path, self.kind = path, kind
        super().__init__(f"{path} is {kind}, not a regular file")


class FileTooLarge(DumpError):
    """A file larger than what may be read from it: `.path`, `.size`, `.limit` (bytes)."""

    def __init__(self, path: StrPath, size: int, limit: int) -> None:
        self.path, self.size, self.limit = path, size, limit
        super().__init__(f"{path} holds {size} bytes, more than the {limit} bytes such a file may hold")


# A file may claim this many bytes more than its blocks hold (file systems round, and a tail may be unallocated)...
SPARSE_SLACK = 1 << 20
# ... and must hold at least this fraction of what it claims (a file system that compresses still allocates more).
SPARSE_RATIO = 8


class SparseFile(FileTooLarge):
    """A file whose apparent size is far above what its blocks hold: `.path`, `.size`, `.allocated` (bytes). A kind
    of FileTooLarge: more is claimed than may be read from it (`.limit` is what it holds)."""

    def __init__(self, path: StrPath, size: int, allocated: int) -> None:
        DumpError.__init__(self, f"{path} is a sparse file: it claims {size} bytes but holds {allocated} on disk")
        self.path, self.size, self.allocated, self.limit = path, size, allocated, allocated


def allocated_bytes(st: os.stat_result) -> int | None:
    """The bytes the blocks of a file hold (None where the platform does not say)."""
    blocks = getattr(st, "st_blocks", None)
    return None if blocks is None else int(blocks) * 512


def is_sparse(st: os.stat_result) -> bool:
    """Whether a regular file claims far more bytes than its blocks hold (see the module docstring)."""
    held = allocated_bytes(st)
    if held is None or not stat.S_ISREG(st.st_mode):
        return False
    return st.st_size - held > SPARSE_SLACK and held * SPARSE_RATIO < st.st_size


def read_regular(path: StrPath, limit: int | None = None, *, follow: bool = True) -> bytes:
    """The bytes of the regular file at `path` (at most `limit`: FileTooLarge beyond it).

    A FIFO, device, socket or folder raises NotRegularFile without blocking, a sparse file SparseFile without being
    read; a missing file raises
    FileNotFoundError; `follow=False` refuses a symbolic link (OSError ELOOP) instead of following it.
    """
    p = Path(path)
    st = os.stat(p) if follow else os.lstat(p)
    if stat.S_ISLNK(st.st_mode):  # only with follow=False: what O_NOFOLLOW says of a link
        raise OSError(errno.ELOOP, "Too many levels of symbolic links", str(p))
    _check(p, st, limit)
    fd = os.open(p, os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW))
    try:
        st = os.fstat(fd)  # the file opened may not be the one stat'ed
        _check(p, st, limit)
        return read_fd(fd, st.st_size)
    finally:
        os.close(fd)


def read_fd(fd: int, size: int) -> bytes:
    """At most `size` bytes of an open file, read in pieces of up to 16 MiB (fewer where it ends sooner)."""
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _check(path: Path, st: os.stat_result, limit: int | None) -> None:
    kind = special_kind(st.st_mode)
    if kind is not None:
        raise NotRegularFile(path, kind)
    if limit is not None and st.st_size > limit:
        raise FileTooLarge(path, st.st_size, limit)
    if is_sparse(st):
        raise SparseFile(path, st.st_size, allocated_bytes(st) or 0)
