"""debris.py: a dead writer's staging stores are removed, a live writer's and another host's are kept,
and a moved-aside dump is listed but never deleted."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from fa_forensics.dump.debris import clean_staging, holder_dead, leftovers
from fa_forensics.dump.lock import StoreLock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _holder(pid: int, host: str | None = None) -> str:
    return f"pid {pid} on {host or socket.gethostname()}, since 2026-01-01 00:00:00, command: fa-forensics import\n"


def _staging(tmp_path, tag: str, holder: str | None):
    folder = tmp_path / f".d.zarr.{tag}.tmp"
    folder.mkdir()
    (folder / "zarr.json").write_text("{}")
    if holder is not None:
        (tmp_path / f".d.zarr.{tag}.tmp.lock").write_text(holder)
    return folder


def test_holder_dead_only_for_a_pid_gone_on_this_host():
    dead = _dead_pid()
    assert holder_dead(_holder(dead))
    assert not holder_dead(_holder(os.getppid()))  # alive
    assert not holder_dead(_holder(dead, host="another-host"))  # cannot tell: treated as alive
    assert not holder_dead("written by hand")


def test_taking_a_stale_lock_removes_only_dead_writers_staging_stores(tmp_path):
    dead = _dead_pid()
    gone = _staging(tmp_path, "aaaa1111", _holder(dead))
    live = _staging(tmp_path, "bbbb2222", _holder(os.getppid()))
    remote = _staging(tmp_path, "cccc3333", _holder(dead, host="another-host"))
    old = tmp_path / ".d.zarr.dddd4444.old"
    old.mkdir()
    (tmp_path / "d.zarr.lock").write_text(_holder(dead))

    listed = {os.path.basename(x.path) for x in leftovers(tmp_path / "d.zarr")}
    assert listed == {"d.zarr.lock", gone.name, gone.name + ".lock", old.name}

    lock = StoreLock(tmp_path / "d.zarr").acquire()
    try:
        assert lock.stale_holder.startswith(f"pid {dead} ")
        assert lock.cleaned == [gone]
    finally:
        lock.release()
    assert not gone.exists() and not (tmp_path / (gone.name + ".lock")).exists()
    assert live.exists() and remote.exists() and old.exists()  # a moved-aside dump may be the only copy
    assert clean_staging(tmp_path / "d.zarr") == []  # called only under the lock; nothing more is dead
