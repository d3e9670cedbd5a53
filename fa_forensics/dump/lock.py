"""One writer per store: an advisory lock file beside the store (`run.zarr.lock`).

The lock is a `flock` on the file, so the kernel releases it when the holder dies, SIGKILL
included: a stale lock file never blocks the next run, and the run that takes it over removes the
staging stores its dead holder left (debris.py). The lock file is opened with O_NOFOLLOW and must be
a regular file with one link: a link planted at its name is refused, never written through. The
file holds a line naming the holder (pid, host, start time, command), which the refusal quotes, and
may hold a second line the holder announces (rank 0's `ready RUN_ID`, dump/ranks.py).
Ranks of a multi-rank run write disjoint subtrees and lock `run.zarr.rank_<r>.lock` each.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import sys
import time
from pathlib import Path
from types import ModuleType

from fa_forensics.dump.debris import clean_staging
from fa_forensics.dump.safe_files import open_nofollow
from fa_forensics.dump.safe_read import StrPath
from fa_forensics.errors import DumpError

fcntl: ModuleType | None
try:
    import fcntl as _fcntl
    fcntl = _fcntl
except ImportError:  # not POSIX: no advisory locks; the store is then unguarded
    fcntl = None


def lock_path(store: Path, rank: int = 0) -> Path:
    store = Path(store)
    suffix = ".lock" if rank == 0 else f".rank_{rank}.lock"
    return store.with_name(store.name + suffix)


class StoreLock:
    """An exclusive, non-blocking lock on a store path; `acquire()` raises DumpError naming the holder."""

    def __init__(self, store: StrPath, rank: int = 0) -> None:
        self.store = Path(store)
        self.path = lock_path(self.store, rank)
        self._fd: int | None = None
        self._holder = ""  # the line naming this holder, written at acquire()
        self.stale_holder = ""  # the holder line of a lock file found left behind by a dead writer
        self.cleaned: list[Path] = []  # its staging stores, removed at acquire()

    def acquire(self) -> StoreLock:
        if fcntl is None or self._fd is not None:
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DumpError(f"cannot create the folder of {self.store}: {exc.strerror or exc}; "
                            "choose a writable path") from None
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_holder(fd)
                os.close(fd)
                raise DumpError(f"{self.store} is being written by another process ({holder}); "
                                f"wait for it to finish or choose another path") from None
            try:  # the previous holder may have removed the file between our open and flock
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.stale_holder = _read_holder(fd, default="")  # a lock file left by a holder that died
        if self.stale_holder:
            self.cleaned = clean_staging(self.store)
        command = " ".join(sys.argv)[:200]
        since = time.strftime('%Y-%m-%d %H:%M:%S')
        line = f"pid {os.getpid()} on {socket.gethostname()}, since {since}, command: {command}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, line.encode(), 0)
        self._fd = fd
        self._holder = line
        return self

    def announce(self, line: str) -> None:
        """Add `line` after the holder line (what the holder tells other processes: dump/ranks.py's ready line)."""
        if self._fd is None:
            return
        text = (self._holder + line.strip() + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text, 0)

    def _open(self) -> int:
        """The lock file, created if missing; a link or a file with other hard links is refused."""
        try:
            fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise DumpError(f"the lock file {self.path} is a symbolic link to {_link_target(self.path)}, which "
                                f"fa-forensics never writes through; remove the link or choose another path") from None
            raise DumpError(f"cannot create the lock file {self.path}: {exc.strerror or exc}; "
                            f"choose a writable path for the store") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            what = "has other hard links" if stat.S_ISREG(st.st_mode) else "is not a regular file"
            raise DumpError(f"the lock file {self.path} {what}, so fa-forensics will not write it; "
                            f"remove it or choose another path")
        return fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still holding it: a waiting opener re-checks the inode
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int, default: str = "holder unknown") -> str:
    """The holder line of an open lock file: its first line, printable characters only (the file is not trusted)."""
    try:
        text = os.pread(fd, 400, 0).decode(errors="replace")
    except OSError:
        text = ""
    line = "".join(c for c in (text.splitlines() or [""])[0] if c.isprintable()).strip()[:200]
    return line or default


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"
