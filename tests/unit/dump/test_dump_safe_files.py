"""safe_files: the write primitives every writer goes through never follow a link they did not make."""
from __future__ import annotations

import errno
import os

import pytest

from fa_forensics.dump.safe_files import atomic_write, open_new, refuse_link
from fa_forensics.errors import DiskFull, LinkRefused


def test_open_new_never_opens_an_existing_file_or_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (tmp_path / "link").symlink_to(victim)
    for path in (victim, tmp_path / "link"):
        with pytest.raises(FileExistsError):
            open_new(path)
    fd = open_new(tmp_path / "fresh")
    os.close(fd)
    assert victim.read_text() == "mine"


def test_atomic_write_replaces_a_file_and_refuses_a_link(tmp_path):
    target = tmp_path / "sub" / "out.json"
    atomic_write(target, "one", "json")
    atomic_write(target, "two", "json")
    assert target.read_text() == "two" and sorted(os.listdir(target.parent)) == ["out.json"]
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()
    (tmp_path / "link.json").symlink_to(target)
    with pytest.raises(LinkRefused, match="symbolic link to"):
        atomic_write(tmp_path / "link.json", "three", "json")
    os.link(target, tmp_path / "hard.json")
    with pytest.raises(LinkRefused, match="other hard links"):
        refuse_link(tmp_path / "hard.json", "json")
    assert target.read_text() == "two"


def test_atomic_write_on_a_full_disk_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    import fa_forensics.dump.safe_files as safe_files

    target = tmp_path / "out.json"
    target.write_text("old")

    def full(*_a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safe_files.os, "write", full)
    with pytest.raises(DiskFull, match="it needs about 3 bytes") as info:
        atomic_write(target, "new", "json")
    monkeypatch.undo()
    assert info.value.needed == 3 and info.value.free is not None
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
