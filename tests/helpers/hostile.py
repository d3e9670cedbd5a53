"""What the hostile tests plant: zstd bombs, special files, another user's files, commands run under a memory cap."""
from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OTHER_UID = 12345  # a user that is not the one running the tests (they run as root here: os.chown works)

_ZSTD_MAGIC = struct.pack("<I", 0xFD2FB528)
_BLOCK = 128 * 1024  # the largest zstd block


def rle_bomb(n_bytes: int, byte: int = 0x3F) -> bytes:
    """A zstd frame that declares no content size and inflates to `n_bytes` (a multiple of 128 KiB) from
    4 bytes per 128 KiB: RLE blocks, as a streaming compressor of a constant run writes them."""
    assert n_bytes % _BLOCK == 0
    n_blocks = n_bytes // _BLOCK
    out = bytearray(_ZSTD_MAGIC)
    out += bytes([0x00, (17 - 10) << 3])  # no content size, not single-segment; window 128 KiB
    for i in range(n_blocks):
        header = (1 if i == n_blocks - 1 else 0) | (1 << 1) | (_BLOCK << 3)  # last?, RLE, size
        out += struct.pack("<I", header)[:3] + bytes([byte])
    return bytes(out)


def claiming_frame(claimed: int) -> bytes:
    """A zstd frame header that claims `claimed` bytes of content (8-byte size field), then one empty block."""
    header = bytes([(3 << 6) | (1 << 5)]) + struct.pack("<Q", claimed)  # FCS 8 bytes, single segment
    last_raw_empty = struct.pack("<I", 1)[:3]
    return _ZSTD_MAGIC + header + last_raw_empty


def char_device(path: Path, major: int = 1, minor: int = 3) -> bool:
    """A character device node at `path` (1, 3 is /dev/null's; 1, 5 /dev/zero's); False where mknod is not
    allowed (no CAP_MKNOD)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    except PermissionError:
        return False
    return True


_CAPPED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
from typer.testing import CliRunner
from fa_forensics.cli import app
runs = {{}}
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(app, args)
    runs[" ".join(args[:1])] = {{"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr,
                                 "error": repr(r.exception)}}
# this process's own peak (VmHWM; ru_maxrss would carry the peak of the process that forked it)
peak = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
own = int(peak[0].split()[1]) if peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
runs["max_rss_mb"] = own / 1024
print(json.dumps(runs))
"""


def run_capped(commands: list[list[str]], cap_gb: float = 6.0, timeout: float = 240) -> dict:
    """Each command line (CliRunner, in one process whose address space is capped at `cap_gb` GiB); by the first
    word of each command: {code, stdout, stderr, error}, and the process's peak resident memory `max_rss_mb`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = _CAPPED.format(cap=int(cap_gb * 2**30))
    args = json.dumps([[str(a) for a in c] for c in commands])
    run = subprocess.run([sys.executable, "-c", script, args], capture_output=True, text=True, timeout=timeout,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def sparse_file(path: Path, held: bytes, apparent: int) -> Path:
    """`path` holding `held` and then a hole up to `apparent` bytes (what `truncate -s` makes): its blocks hold
    about len(held) bytes whatever it claims."""
    path.unlink(missing_ok=True)
    path.write_bytes(held)
    os.truncate(path, apparent)
    return path


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder` (not following links): its kind, mode, size and content digest, to show that a
    command left a dump exactly as it was."""
    import hashlib

    out = {}
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            p = Path(top) / name
            st = os.lstat(p)
            digest = ""
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            out[str(p.relative_to(folder))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size, digest)
    return out


def output_commands() -> dict[str, list[tuple[str, str]]]:
    """{command: [(option, kind)]} for every registered command with an output option (kind: 'argument' names of
    what it reads are given as ('ARG', name)), read from the app itself so that a new command is covered."""
    import typer

    from fa_forensics.cli import build_app
    from fa_forensics.commands.options import INPUT_ARGUMENTS, OUTPUT_OPTIONS

    group = typer.main.get_command(build_app())
    found = {}
    for name, command in group.commands.items():
        outputs = [(p.opts[0], "option") for p in command.params
                   if p.param_type_name == "option" and p.opts[0] in OUTPUT_OPTIONS]
        inputs = [(p.name, "argument") for p in command.params
                  if p.param_type_name == "argument" and p.name in INPUT_ARGUMENTS]
        if outputs:
            found[name] = inputs + outputs
    return found
