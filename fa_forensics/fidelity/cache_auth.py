"""Who wrote a match cache entry: one ownership rule for the cache's files and folders, and an HMAC with a key
only the user can read.

A cache entry decides what `match` shows and what `--preset auto` replays, so an entry is believed only when
this user's fa-forensics wrote it. The key is 32 random bytes in `<cache dir>/KEY_NAME`, created atomically
(O_CREAT | O_EXCL, mode 0600) the first time an entry is written; every entry carries the HMAC-SHA256 of its
canonical JSON under that key (`seal`, `unseal`). Someone who can edit an entry but not read the key cannot
make an entry that passes.

The ownership rule (`folder_refusal`, `file_refusal`, `read_owned`), as ssh's StrictModes: a folder the cache
reads or writes must be owned by the user (or root) and writable by nobody else; a file (an entry, the key)
must be a regular file owned by the user, writable by nobody else, with one name (a second hard link means
someone else's folder holds it too). A symbolic link is judged by its target (the walk in
`dump.safe_files.check_parent_links` refuses links planted by others); a folder is never created inside a
folder of another user.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import stat
import time
from pathlib import Path
from typing import Optional

from fa_forensics.dump.safe_read import read_fd, special_kind

KEY_NAME = "match-cache.key"  # in the cache directory, beside its `match` folder
KEY_BYTES = 32
MAC_FIELD = "hmac"
_KEY_WAIT_S = 1.0  # a key another process is writing this moment is read again for at most this long
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Refused(Exception):
    """A cache file or folder the ownership rule refuses, or a key that cannot be made; the message says why."""


def _writable_by(mode: int) -> Optional[str]:
    if mode & stat.S_IWOTH:
        return "others"
    if mode & stat.S_IWGRP:
        return "its group"
    return None


def folder_refusal(folder: Path) -> Optional[str]:
    """Why `folder` (a link judged by its target) may hold files someone else planted, or None (it is the user's
    alone, or absent)."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{folder} cannot be examined ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid not in (os.getuid(), 0):
        return f"{folder} is owned by another user (uid {st.st_uid})"
    who = _writable_by(st.st_mode)
    if who is not None:
        return f"{folder} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def creation_refusal(folder: Path) -> Optional[str]:
    """Why `folder` (absent) may not be created: the nearest folder above it that exists belongs to another user
    (it is never written into). None when it may."""
    above = folder.absolute().parent
    while True:
        try:
            st = os.stat(above)
            break
        except FileNotFoundError:
            if above.parent == above:
                return None
            above = above.parent
        except OSError as exc:
            return f"{above} cannot be examined ({exc.strerror or exc})"
    if st.st_uid not in (os.getuid(), 0):
        return f"{above} is owned by another user (uid {st.st_uid}), and fa-forensics never creates files in it"
    return None


def file_refusal(path: Path, st: os.stat_result) -> Optional[str]:
    """Why the file `path` (its fstat `st`) is not one the user alone wrote, or None."""
    kind = special_kind(st.st_mode)
    if kind is not None:
        return f"{path} is {kind}, not a regular file"
    if st.st_uid != os.getuid():
        return f"{path} is owned by another user (uid {st.st_uid})"
    who = _writable_by(st.st_mode)
    if who is not None:
        return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_nlink != 1:
        return f"{path} has {st.st_nlink} hard links (another name may be someone else's)"
    return None


def read_owned(path: Path, limit: int, *, private: bool = False) -> Optional[bytes]:
    """The bytes of `path`, a regular file the ownership rule admits (checked on the open descriptor, never
    following a link, never blocking on a FIFO), or None when absent; Refused otherwise. `private`: a secret,
    refused when its group or others may read it too (mode 600 or stricter)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{path} is a symbolic link (not followed)") from None
        raise Refused(f"{path} cannot be read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        why = file_refusal(path, st)
        if why is None and private and st.st_mode & 0o077:
            why = f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}, not 600)"
        if why is not None:
            raise Refused(why)
        if st.st_size > limit:
            raise Refused(f"{path} holds {st.st_size} bytes, more than the {limit} it may")
        return read_fd(fd, st.st_size)
    finally:
        os.close(fd)


def existing_key(cache_dir: Path) -> Optional[bytes]:
    """The user's key in `cache_dir`, or None when there is none; Refused when the file there breaks the ownership
    rule or is not a key."""
    return load_key(cache_dir, create=False)


def user_key(cache_dir: Path) -> bytes:
    """The user's key in `cache_dir`, made there (0600) when absent; Refused as `existing_key`, or when it cannot
    be made."""
    key = load_key(cache_dir, create=True)
    if key is None:  # create=True returns a key or raises
        raise Refused(f"no key could be made in {cache_dir}")
    return key


def load_key(cache_dir: Path, *, create: bool) -> Optional[bytes]:
    """The user's key in `cache_dir` (made there, 0600, when absent and `create`), or None (absent, not made);
    Refused when the file there breaks the ownership rule, is not a key, or cannot be made."""
    path = cache_dir / KEY_NAME
    deadline = time.monotonic() + _KEY_WAIT_S
    while True:
        key = read_owned(path, KEY_BYTES, private=True)
        if key is None:
            if not create:
                return None
            made = _make_key(path)
            if made is not None:
                return made
            continue  # another process made it first: read theirs
        if len(key) == KEY_BYTES:
            return key
        if time.monotonic() > deadline:  # not one being written this moment
            raise Refused(f"{path} holds {len(key)} bytes, not a key of {KEY_BYTES}")
        time.sleep(0.02)


def _make_key(path: Path) -> Optional[bytes]:
    """A new key at `path` (O_EXCL: never over an existing file, never through a link); None when another
    process created the file first."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    except FileExistsError:
        return None
    except OSError as exc:
        raise Refused(f"cannot make the key {path} ({exc.strerror or exc})") from None
    key = os.urandom(KEY_BYTES)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        view = memoryview(key)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise Refused(f"cannot make the key {path} ({exc.strerror or exc})") from None
    os.close(fd)
    return key


def _canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def seal(record: dict, key: bytes) -> dict:
    """`record` with its HMAC-SHA256 under `key` (over its canonical JSON) in MAC_FIELD."""
    body = {k: v for k, v in record.items() if k != MAC_FIELD}
    return {**body, MAC_FIELD: hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()}


def unseal(record: dict, key: bytes) -> bool:
    """True when `record` carries the HMAC `seal` gives it under `key` (a record written by the key's owner,
    unchanged since)."""
    mac = record.get(MAC_FIELD)
    if not isinstance(mac, str):
        return False
    body = {k: v for k, v in record.items() if k != MAC_FIELD}
    try:
        want = hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()
    except (TypeError, ValueError):
        return False
    return hmac.compare_digest(mac, want)
