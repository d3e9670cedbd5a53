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


def test_a_fifo_a_device_or_a_socket_is_never_replaced(tmp_path):
    import re
    import socket
    import stat

    from fa_forensics.errors import SpecialFileRefused
    from tests.helpers.hostile import char_device

    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    targets = {"fifo": "a FIFO (named pipe)", "sock": "a socket"}
    if char_device(tmp_path / "null"):  # a copy of /dev/null (1, 3): never the real one
        targets["null"] = "a character device"
    try:
        for name, kind in targets.items():
            before = os.lstat(tmp_path / name)
            with pytest.raises(SpecialFileRefused, match=f"it is {re.escape(kind)}, not a file"):
                atomic_write(tmp_path / name, "{}", "json")
            after = os.lstat(tmp_path / name)
            assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    finally:
        sock.close()
    assert sorted(os.listdir(tmp_path)) == sorted(targets)  # no temporary file left


def test_another_users_file_is_never_replaced_and_a_users_own_keeps_its_mode(tmp_path):
    from fa_forensics.errors import ForeignOwnerRefused
    from tests.helpers.hostile import OTHER_UID

    theirs = tmp_path / "theirs.json"
    theirs.write_text("their results")
    theirs.chmod(0o600)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(ForeignOwnerRefused, match=f"belongs to another user \\(uid {OTHER_UID}\\)"):
        atomic_write(theirs, "{}", "json")
    st = theirs.stat()
    assert theirs.read_text() == "their results" and (st.st_uid, st.st_mode & 0o777) == (OTHER_UID, 0o600)

    mine = tmp_path / "mine.json"
    mine.write_text("old")
    mine.chmod(0o600)
    atomic_write(mine, "new", "json")
    assert mine.read_text() == "new" and mine.stat().st_mode & 0o777 == 0o600


def _shared(tmp_path):
    """A sticky world-writable folder (as /tmp) holding `results`, a link to `target`."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    target = tmp_path / "target"
    target.mkdir()
    (shared / "results").symlink_to(target)
    return shared, target


@pytest.mark.parametrize("owner, refused", [("other", True), ("self", False), ("root-owned folder", False)])
def test_a_link_on_the_way_is_followed_only_under_the_protected_symlinks_rule(tmp_path, owner, refused):
    from fa_forensics.dump.safe_files import check_parent_links
    from fa_forensics.errors import ParentLinkRefused
    from tests.helpers.hostile import OTHER_UID

    shared, target = _shared(tmp_path)
    link = shared / "results"
    if owner == "other":
        os.lchown(link, OTHER_UID, OTHER_UID)
    elif owner == "root-owned folder":  # the link's owner owns the folder: the kernel follows it
        os.lchown(link, OTHER_UID, OTHER_UID)
        os.chown(shared, OTHER_UID, OTHER_UID)
    out = shared / "results" / "sub" / "out.json"
    if refused:
        with pytest.raises(ParentLinkRefused, match=f"planted by another user \\(uid {OTHER_UID}\\)"):
            atomic_write(out, "{}", "json")
        with pytest.raises(ParentLinkRefused):
            check_parent_links(shared / "results", "match_cache", include_last=True)
        assert os.listdir(target) == []
    else:
        atomic_write(out, "{}", "json")
        assert (target / "sub" / "out.json").read_text() == "{}"


def test_a_link_in_a_folder_that_is_not_sticky_and_world_writable_is_followed(tmp_path):
    from tests.helpers.hostile import OTHER_UID

    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "results").symlink_to(target)
    os.lchown(tmp_path / "results", OTHER_UID, OTHER_UID)
    atomic_write(tmp_path / "results" / "out.json", "{}", "json")
    assert (target / "out.json").read_text() == "{}"
