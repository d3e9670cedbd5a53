"""Hostile dumps and shared directories: planted links, absurd metadata, a full disk, a killed writer.

Every place the tool writes gets a planted symbolic link to a victim file: the victim must keep its content
and mode, and the command must refuse in one line with exit code 2. A full disk is simulated (ENOSPC from
the write call), so the tests run everywhere without mounting a file system.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.commands.progress import INTERVAL_ENV

pytestmark = pytest.mark.slow  # starts and kills writer processes

LAYER = Path("step_000000000") / "layer_000"
REPO = Path(__file__).resolve().parents[2]


def _cli(*args):
    """The command's result and its stderr lines, with progress lines off (they come every few seconds on a busy
    machine, and these tests read the error line)."""
    result = CliRunner().invoke(app, [str(a) for a in args], env={INTERVAL_ENV: "0"})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return result, lines


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("a file the user owns\n")
    victim.chmod(0o640)
    return victim


def _unchanged(victim: Path) -> None:
    assert victim.read_text() == "a file the user owns\n"
    assert victim.stat().st_mode & 0o777 == 0o640


def _refused(result, lines, what: str = "link") -> None:
    assert result.exit_code == 2, result.stdout + result.stderr
    assert len(lines) == 1 and what in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def _tensors_file(path: Path, steps: int = 1) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {f"step{s}.layer0.{n}": torch.randn(1, 2, 16, 8, generator=g).bfloat16()
               for s in range(steps) for n in ("q", "k", "v", "o", "do")}
    save_file(tensors, str(path))
    return path


# -- planted links ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["lock", "store"])
def test_import_never_writes_through_a_planted_link(tmp_path, where):
    victim = _victim(tmp_path)
    src = _tensors_file(tmp_path / "in.safetensors")
    dst = tmp_path / "d.zarr"
    (tmp_path / ("d.zarr.lock" if where == "lock" else "d.zarr")).symlink_to(victim)
    _refused(*_cli("import", src, "--to", dst))
    _unchanged(victim)


def test_synth_never_writes_through_a_planted_lock_or_output(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "s.zarr.lock").symlink_to(victim)
    _refused(*_cli("synth", "--out", tmp_path / "s.zarr", "--seq", 64, "--heads", 2, "--head-dim", 16, "--steps", 1))
    (tmp_path / "s.zarr.lock").unlink()
    (tmp_path / "s.zarr").symlink_to(victim)
    _refused(*_cli("synth", "--out", tmp_path / "s.zarr", "--seq", 64, "--heads", 2, "--head-dim", 16, "--steps", 1))
    _unchanged(victim)


@pytest.mark.parametrize("overwrite", [False, True])
def test_export_never_writes_through_a_planted_link(tmp_path, make_dump, overwrite):
    victim = _victim(tmp_path)
    dump = make_dump(steps=(0,))
    (tmp_path / "out.safetensors").symlink_to(victim)
    _refused(*_cli("export", dump, "--to", tmp_path / "out.safetensors", *(["--overwrite"] if overwrite else [])))
    _unchanged(victim)
    assert (tmp_path / "out.safetensors").is_symlink()


def test_json_output_never_writes_through_a_planted_link(tmp_path, make_dump):
    victim = _victim(tmp_path)
    dump = make_dump(steps=(0,))
    (tmp_path / "info.json").symlink_to(victim)
    _refused(*_cli("info", dump, "--json", tmp_path / "info.json"))
    _unchanged(victim)


@pytest.mark.parametrize("where", ["out", "index.html", "isolate"])
def test_report_never_writes_through_a_planted_link(tmp_path, make_dump, where):
    victim = _victim(tmp_path)
    dump = make_dump(steps=(0,))
    out = tmp_path / "report"
    if where == "out":  # a link to a folder of the user's (not the one holding the dump: that is refused as well)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        out.symlink_to(elsewhere)
    else:
        out.mkdir()
        (out / where).symlink_to(victim if where == "index.html" else tmp_path)
    before = sorted(os.listdir(tmp_path))
    _refused(*_cli("report", dump, "--out", out))
    _unchanged(victim)
    assert sorted(os.listdir(tmp_path)) == before  # no staging folder, nothing written anywhere


def test_figures_are_never_written_through_a_planted_link(tmp_path, make_dump):
    dump = make_dump(steps=(0,))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "figs").symlink_to(elsewhere)
    _refused(*_cli("isolate", dump, "--out", tmp_path / "figs"))
    assert os.listdir(elsewhere) == []

    from fa_forensics.errors import LinkRefused
    from fa_forensics.analyses.style import new_figure, save_figure

    victim = _victim(tmp_path)
    (tmp_path / "f.png").symlink_to(victim)
    fig, _ = new_figure()
    with pytest.raises(LinkRefused):
        save_figure(fig, tmp_path / "f.png")
    _unchanged(victim)


def test_the_writer_never_writes_a_store_through_a_link(tmp_path):
    """capture writes through DumpWriter: a link at the store path, or at its lock, is refused."""
    from fa_forensics.dump import DumpWriter
    from fa_forensics.errors import DumpError

    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run.zarr").symlink_to(outside)
    with pytest.raises(DumpError, match="symbolic link"):
        DumpWriter(tmp_path / "run.zarr", {})
    assert os.listdir(outside) == []

    victim = _victim(tmp_path)
    (tmp_path / "run2.zarr.lock").symlink_to(victim)
    with pytest.raises(DumpError, match="lock file .* is a symbolic link"):
        DumpWriter(tmp_path / "run2.zarr", {})
    _unchanged(victim)


def test_the_writer_refuses_a_store_with_a_folder_linked_outside(tmp_path, make_dump):
    from fa_forensics.dump import DumpWriter
    from fa_forensics.errors import DumpError

    dump = make_dump(steps=(0,))
    outside = tmp_path / "outside"
    outside.mkdir()
    (dump / "step_000000001").symlink_to(outside)
    with pytest.raises(DumpError, match="symbolic link inside the store"):
        DumpWriter(dump, {"model": {"name": "test"}})
    assert os.listdir(outside) == []


def test_a_lock_file_with_other_hard_links_is_refused(tmp_path):
    from fa_forensics.dump.lock import StoreLock
    from fa_forensics.errors import DumpError

    victim = _victim(tmp_path)
    os.link(victim, tmp_path / "d.zarr.lock")
    with pytest.raises(DumpError, match="other hard links"):
        StoreLock(tmp_path / "d.zarr").acquire()
    _unchanged(victim)


def test_verify_names_a_chunk_link_that_leaves_the_store(tmp_path, make_dump):
    dump = make_dump(steps=(0,))
    other = make_dump(steps=(0,), seed=1)
    chunk = dump / LAYER / "q" / "c.0.1.0.0"
    chunk.unlink()
    chunk.symlink_to(other / LAYER / "q" / "c.0.1.0.0")  # a valid chunk, outside the store
    result, lines = _cli("verify", dump, "--json", tmp_path / "v.json")
    assert result.exit_code == 1
    report = json.loads((tmp_path / "v.json").read_text())
    assert any("link leaving the store" in p["what"] and "c.0.1.0.0" in p["what"] for p in report["problems"]), report


# -- hostile metadata, under a memory cap -------------------------------------------------------------------------


_CAPPED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
from typer.testing import CliRunner
from fa_forensics.cli import app
runs = {{}}
for command in ("verify", "info"):
    r = CliRunner().invoke(app, [command, sys.argv[1]])
    runs[command] = {{"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "error": repr(r.exception)}}
print(json.dumps(runs))
"""


def _capped(dump: Path, cap_gb: float = 6.0, timeout: float = 120) -> dict:
    """verify and info on `dump` in a process whose address space is capped at `cap_gb` GiB."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = _CAPPED.format(cap=int(cap_gb * 2**30))
    run = subprocess.run([sys.executable, "-c", script, str(dump)], capture_output=True, text=True, timeout=timeout,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("tokens", [2 * 10**9, 10**12])
def test_a_shape_claiming_billions_of_tokens_is_refused_within_a_memory_cap(make_dump, tokens):
    """T = 2e9 with the chunks unchanged is 2.5e8 chunk keys (about 20 GB as a list): counted, never listed.
    T = 1e12 is absurd: refused from the shape alone."""
    dump = make_dump(steps=(0,))
    meta_path = dump / LAYER / "q" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][2] = tokens  # chunks (1, 1, 16, 8) unchanged
    meta_path.write_text(json.dumps(meta))
    missing = 2 * tokens // 16 - 2  # 2 heads; the two chunks that exist
    runs = _capped(dump)
    for command, code in (("verify", 1), ("info", 2)):
        run = runs[command]
        lines = [line for line in run["stderr"].splitlines() if line.strip()]
        assert run["code"] == code, run
        assert "MemoryError" not in json.dumps(run) and "Traceback" not in run["stderr"]
        assert len(lines) == 1, run["stderr"]
        want = "absurd" if tokens > 2**31 else f"{missing} chunks missing"
        assert want in (lines[0] if command == "info" else run["stdout"].replace("\n", " ")), run


# -- a full disk (simulated: ENOSPC from the write call) ------------------------------------------------------


def _no_space(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_import_on_a_full_disk_is_worded_and_leaves_nothing(tmp_path, monkeypatch):
    from fa_forensics.dump.writer import DumpWriter

    src = _tensors_file(tmp_path / "in.safetensors")
    monkeypatch.setattr(DumpWriter, "write_array", _no_space)
    result, lines = _cli("import", src, "--to", tmp_path / "d.zarr")
    _refused(result, lines, "no space left on the device")
    assert "it needs about" in lines[0] and "free" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_synth_on_a_full_disk_keeps_the_old_dump(tmp_path, monkeypatch):
    from fa_forensics.dump.writer import DumpWriter

    args = ["synth", "--seq", 64, "--heads", 2, "--head-dim", 16, "--steps", 1, "--batch", 1]
    assert _cli(*args, "--out", tmp_path / "s.zarr")[0].exit_code == 0
    before = (tmp_path / "s.zarr" / "zarr.json").read_text()
    monkeypatch.setattr(DumpWriter, "write_array", _no_space)
    _refused(*_cli(*args, "--seed", 3, "--overwrite", "--out", tmp_path / "s.zarr"), "no space left")
    assert (tmp_path / "s.zarr" / "zarr.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_export_on_a_full_disk_is_worded_and_leaves_nothing(tmp_path, make_dump, monkeypatch):
    import fa_forensics.dump.safe_files as safe_files

    dump = make_dump(steps=(0,))
    real_write = os.write

    def write(fd, data):
        if os.fstat(fd).st_size > 100:  # the file system fills up after the first hundred bytes
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data)[:64])

    monkeypatch.setattr(safe_files.os, "write", write)
    result, lines = _cli("export", dump, "--to", tmp_path / "out" / "e.safetensors")
    monkeypatch.setattr(safe_files.os, "write", real_write)
    _refused(result, lines, "no space left on the device")
    assert os.listdir(tmp_path / "out") == []


def test_report_on_a_full_disk_is_worded_and_leaves_no_empty_folders(tmp_path, make_dump, monkeypatch):
    import fa_forensics.analyses.isolate.figure as figures

    dump = make_dump(steps=(0,))
    monkeypatch.setattr(figures, "draw", _no_space)
    before = sorted(os.listdir(tmp_path))
    _refused(*_cli("report", dump, "--out", tmp_path / "report", "--step", 0), "no space left")
    assert sorted(os.listdir(tmp_path)) == before


# -- a killed writer -----------------------------------------------------------------------------------------


def test_a_killed_import_leaves_debris_that_verify_lists_and_the_next_import_removes(tmp_path):
    small = _tensors_file(tmp_path / "small.safetensors")
    big = _tensors_file(tmp_path / "big.safetensors", steps=400)
    dst = tmp_path / "d.zarr"
    assert _cli("import", small, "--to", dst)[0].exit_code == 0

    # The import stops itself once step 10 of its staging store is complete (SIGSTOP), so the kill lands while
    # it writes, whatever the machine's speed; then it is killed as a user's kill -9 would.
    stop_at_step_10 = (
        "import os, signal, runpy, sys\n"
        "from fa_forensics.dump.writer import DumpWriter\n"
        "done = DumpWriter.complete_step\n"
        "def complete_step(self, step, *a, **k):\n"
        "    done(self, step, *a, **k)\n"
        "    if step == 10:\n"
        "        os.kill(os.getpid(), signal.SIGSTOP)\n"
        "DumpWriter.complete_step = complete_step\n"
        "sys.argv = ['fa-forensics'] + sys.argv[1:]\n"
        "runpy.run_module('fa_forensics', run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", stop_at_step_10, "import", str(big), "--to", str(dst),
                             "--overwrite"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), "the import ended before step 10"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    keep = ("small.safetensors", "big.safetensors", "d.zarr")
    debris = sorted(p.name for p in tmp_path.iterdir() if p.name not in keep)
    assert "d.zarr.lock" in debris
    assert any(n.endswith(".tmp") for n in debris) and any(n.endswith(".tmp.lock") for n in debris)

    result, _ = _cli("verify", dst, "--json", tmp_path / "v.json")
    assert result.exit_code == 0, result.stdout  # the old dump is whole
    listed = json.loads((tmp_path / "v.json").read_text())["leftovers"]
    (tmp_path / "v.json").unlink()
    assert sorted(Path(x["path"]).name for x in listed) == debris, listed

    assert _cli("import", small, "--to", dst, "--overwrite")[0].exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors", "d.zarr", "small.safetensors"]


# -- what the machine refuses: worded, never "unexpected <Type>" --------------------------------------------------


@pytest.mark.parametrize("exc, words", [
    (MemoryError(), "out of memory"),
    (OSError(errno.ENOSPC, "No space left on device", "/scratch/x"), "no space left on the device at /scratch/x"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota is exhausted"),
    (OSError(errno.EACCES, "Permission denied", "/root/x"), "the file system refused at /root/x: Permission denied"),
])
def test_what_the_machine_refuses_is_worded_in_one_line(make_dump, monkeypatch, exc, words):
    from fa_forensics.dump.reader import Dump

    dump = make_dump(steps=(0,))

    def refuse(*_a, **_k):
        raise exc

    monkeypatch.setattr(Dump, "summary", refuse)
    result, lines = _cli("info", dump)
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert words in lines[0] and "unexpected" not in lines[0], lines[0]


def test_a_safetensors_write_error_is_worded():
    from safetensors import SafetensorError

    from fa_forensics.commands.errors import environment_line

    full = SafetensorError("Error while serializing: IoError(Os { code: 28, ... (os error 28)")
    assert "no space left" in environment_line(full)
    assert environment_line(ValueError("a bug")) is None


@pytest.mark.parametrize("where", ["run.zarr.lock", "run.zarr"])
def test_capture_never_writes_through_a_planted_link(tmp_path, where):
    """`fa-forensics capture` on a real training script: its store goes through the dump writer and its lock."""
    from tests.cli.test_capture_cli import SCRIPT

    victim = _victim(tmp_path)
    victim_dir = tmp_path / "someone-elses-folder"
    victim_dir.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / where).symlink_to(victim if where.endswith(".lock") else victim_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = ["capture", "--out", tmp_path / "run.zarr", "--steps", "1", "--", sys.executable, script, "2",
            tmp_path / "seen.pt"]
    run = subprocess.run([sys.executable, "-m", "fa_forensics", *map(str, args)], capture_output=True, text=True,
                         timeout=240,
                         env=env, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "symbolic link" in run.stderr and "Traceback" not in run.stderr, run.stderr
    _unchanged(victim)
    assert os.listdir(victim_dir) == []


def test_a_hostile_lock_line_and_timeline_shape_stay_one_line(tmp_path, make_dump):
    """A lock held by a live process whose file holds markup and newlines, and a timeline array claiming
    10^12 rows: each refusal is one clean line."""
    import fcntl

    from fa_forensics.dump import DumpWriter

    dump = make_dump(steps=(0,))
    with DumpWriter(dump, {"model": {"name": "test"}}) as writer:
        writer.append_timeline(0, loss=1.0)
    meta_path = dump / "timeline" / "loss" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][0] = 10**12
    meta_path.write_text(json.dumps(meta))
    result, lines = _cli("timeline", dump)
    assert result.exit_code == 2 and len(lines) == 1 and "absurd" in lines[0], result.stderr

    lock = tmp_path / "x.zarr.lock"
    lock.write_text("pid 1 [/] on [bold]host\nsecond line\x07\n")  # rich markup that would not parse
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        result, lines = _cli("import", _tensors_file(tmp_path / "in.safetensors"), "--to", tmp_path / "x.zarr")
    finally:
        os.close(fd)
    assert result.exit_code == 2 and len(lines) == 1 and "second line" not in result.stderr, result.stderr


def test_a_path_with_markup_in_its_name_is_printed_as_text(tmp_path):
    folder = tmp_path / "a[/]b"  # the folder "]b" inside the folder "a["
    folder.mkdir(parents=True)
    result, lines = _cli("info", folder / "x.zarr")
    assert result.exit_code == 2 and len(lines) == 1 and "a[/]b" in lines[0], result.stderr


def test_markup_in_a_dumps_metadata_is_shown_as_text(make_dump):
    dump = make_dump(steps=(0,))
    meta_path = dump / LAYER / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["module"] = "evil[/]module"
    meta_path.write_text(json.dumps(meta))
    result, lines = _cli("info", dump)
    assert result.exit_code == 0 and lines == [], result.stderr
    assert "evil[/]module" in result.stdout


def test_json_to_the_standard_output_still_works(make_dump):
    """/dev/stdout is a link the system made: --json /dev/stdout writes the stream, not a file through it."""
    result, lines = _cli("info", make_dump(steps=(0,)), "--json", "/dev/stdout")
    assert result.exit_code == 0 and lines == [], result.stderr
    assert '"warnings": []' in result.stdout


def test_synth_and_report_outputs_get_the_mode_a_plain_mkdir_gives(tmp_path):
    """Outputs built aside and moved into place are readable by others as any folder the user makes (not 0700)."""
    from typer.testing import CliRunner

    from fa_forensics.cli import app

    old = os.umask(0o022)
    try:
        res = CliRunner().invoke(app, ["synth", "--out", str(tmp_path / "s.zarr"), "--seq", "64", "--heads", "2",
                                       "--head-dim", "16", "--batch", "1", "--steps", "1"])
        assert res.exit_code == 0, res.output
        assert (tmp_path / "s.zarr").stat().st_mode & 0o777 == 0o755
        res = CliRunner().invoke(app, ["report", str(tmp_path / "s.zarr"), "--out", str(tmp_path / "rep")])
        assert res.exit_code == 0, res.output
        assert (tmp_path / "rep").stat().st_mode & 0o777 == 0o755
    finally:
        os.umask(old)


# -- outputs: regular files or new names ------------------------------------------------------------------------


def test_json_never_replaces_a_fifo_a_device_or_a_socket(tmp_path, make_dump):
    """A root `info --json /dev/null` replaced the device with a JSON file: every special file is refused (a copy
    of /dev/null stands in for the real one)."""
    import socket
    import stat as stat_

    from tests.helpers.hostile import char_device

    dump = make_dump(steps=(0,))
    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    names = ["fifo", "sock"] + (["null"] if char_device(tmp_path / "null") else [])
    try:
        for name in names:
            before = os.lstat(tmp_path / name)
            result, lines = _cli("info", dump, "--json", tmp_path / name)
            _refused(result, lines, "not a file; fa-forensics writes only regular files")
            assert "- writes to the standard output" in lines[0]
            after = os.lstat(tmp_path / name)
            assert (after.st_ino, stat_.S_IFMT(after.st_mode)) == (before.st_ino, stat_.S_IFMT(before.st_mode))
    finally:
        sock.close()
    result, lines = _cli("info", dump, "--json", "-")
    assert result.exit_code == 0 and lines == [] and json.loads(result.stdout[result.stdout.index("{\n"):])["steps"]


def test_json_never_replaces_another_users_file(tmp_path, make_dump):
    """`--json` over another user's 0600 file left a root-owned 0644 file in its place."""
    from tests.helpers.hostile import OTHER_UID

    theirs = tmp_path / "theirs.json"
    theirs.write_text("their results\n")
    theirs.chmod(0o600)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    _refused(*_cli("info", make_dump(steps=(0,)), "--json", theirs), "belongs to another user (uid 12345)")
    st = theirs.stat()
    assert theirs.read_text() == "their results\n" and (st.st_uid, st.st_mode & 0o777) == (OTHER_UID, 0o600)


def test_report_out_refuses_a_folder_holding_what_no_report_wrote(tmp_path, make_dump):
    """A folder with the user's notes, or the user's file inside a folder named after an analysis: refused
    before any work, every file kept."""
    dump = make_dump(steps=(0,))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = sorted(os.listdir(tmp_path))
    _refused(*_cli("report", dump, "--out", out), "holds files no fa-forensics report wrote (notes.txt)")
    assert (out / "notes.txt").read_text() == "mine" and sorted(os.listdir(tmp_path)) == before

    (out / "notes.txt").unlink()
    (out / "isolate").mkdir()
    (out / "isolate" / "my-analysis.py").write_text("mine")
    _refused(*_cli("report", dump, "--out", out), "holds files no fa-forensics report wrote (isolate)")
    assert (out / "isolate" / "my-analysis.py").read_text() == "mine"


def test_a_report_replaces_an_earlier_report_and_nothing_else(tmp_path):
    """Publishing over an earlier report (its list of files in MARKER) replaces it whole; a file the user added
    inside one of its folders makes the folder foreign."""
    from fa_forensics.errors import NotReportFolder
    from fa_forensics.report.output import MARKER, staged_report

    out = tmp_path / "rep"
    for version in ("one", "two"):
        with staged_report(out, ["isolate"]) as staged:
            (staged / "index.html").write_text(version)
            (staged / "isolate").mkdir()
            (staged / "isolate" / f"{version}.png").write_text(version)
        assert sorted(os.listdir(out)) == sorted([MARKER, "index.html", "isolate"])
        assert os.listdir(out / "isolate") == [f"{version}.png"] and (out / "index.html").read_text() == version
    assert json.loads((out / MARKER).read_text())["files"] == ["index.html", "isolate", "isolate/two.png"]
    (out / "isolate" / "mine.txt").write_text("mine")
    with pytest.raises(NotReportFolder, match=r"isolate/mine\.txt"):
        with staged_report(out, ["isolate"]):
            pass
    assert (out / "isolate" / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]  # no staging or moved-aside folder left


# -- reads bounded by what is on disk -----------------------------------------------------------------------------


def test_decompression_bombs_cost_the_chunks_bytes(make_dump):
    """A 326-byte chunk of RLE blocks inflating to 10 MiB where the chunk holds 256 bytes, and a frame header
    claiming 10^12 bytes: verify names both chunks, delta-bias and match refuse in one line, memory stays at its
    baseline. A 64 KiB bomb inflating to 2 GiB is longer than any encoding of 256 bytes: named before it is read."""
    from tests.helpers.hostile import claiming_frame, lines_of, rle_bomb, run_capped

    dump = make_dump(steps=(0,))
    (dump / LAYER / "q" / "c.0.1.0.0").write_bytes(rle_bomb(80 * 2**17))
    (dump / LAYER / "k" / "c.0.0.0.0").write_bytes(claiming_frame(10**12))
    long = make_dump(steps=(0,))
    (long / LAYER / "q" / "c.0.1.0.0").write_bytes(rle_bomb(2**31))
    runs = run_capped([["verify", dump], ["delta-bias", dump], ["match", dump]], cap_gb=6)
    assert runs["max_rss_mb"] < 1500, runs["max_rss_mb"]  # inflated, one chunk would be 2048 MB
    verify_out = runs["verify"]["stdout"].replace("\n", " ")
    assert runs["verify"]["code"] == 1
    assert "inflates past the chunk's 256 bytes" in verify_out and "claims 1000000000000 bytes" in verify_out
    result, _ = _cli("verify", long, "--json", long.parent / "long.json")
    problems = [p["what"] for p in json.loads((long.parent / "long.json").read_text())["problems"]]
    assert result.exit_code == 1 and any("longer than any encoding of the chunk's 256 bytes" in p for p in problems)
    for command in ("delta-bias", "match"):
        run = runs[command]
        assert run["code"] == 2 and len(lines_of(run["stderr"])) == 1, run
        assert "decompression bomb, or damage" in run["stderr"] and "Traceback" not in run["stderr"]


def test_metadata_claiming_what_the_files_do_not_hold_is_refused_before_allocation(make_dump):
    """A timeline claiming 3·10^8 rows with no chunks, a heads list of 200,000 heads (2 stored), a layer
    zarr.json of 5,000,000 heads (40 MB): damage, named in one line; the healthy step is analysed."""
    from fa_forensics.dump import DumpWriter
    from tests.helpers.hostile import lines_of, run_capped

    dump = make_dump(steps=(0, 1, 2))
    with DumpWriter(dump, {"model": {"name": "test"}}) as writer:
        for step in range(3):
            writer.append_timeline(step, loss=1.0 + step)
    for series in ("step", "loss"):
        meta_path = dump / "timeline" / series / "zarr.json"
        meta = json.loads(meta_path.read_text())
        meta["shape"][0] = 300_000_000
        meta_path.write_text(json.dumps(meta))
    for step, heads in ((1, 200_000), (2, 5_000_000)):
        meta_path = dump / f"step_00000000{step}" / "layer_000" / "zarr.json"
        meta = json.loads(meta_path.read_text())
        meta["attributes"]["heads"] = list(range(heads))
        meta_path.write_text(json.dumps(meta))
    runs = run_capped([["info", dump], ["verify", dump], ["timeline", dump], ["delta-bias", dump]], cap_gb=6)
    assert runs["max_rss_mb"] < 1500, runs["max_rss_mb"]
    assert runs["info"]["code"] == 0 and "1171874 chunks missing" in runs["info"]["stderr"]
    problems = runs["verify"]["stdout"].replace("\n", " ")
    assert runs["verify"]["code"] == 1 and "heads lists 200000 heads but the arrays hold 2" in problems
    assert "more than the 16777216 a dump's metadata may hold" in problems and "1171874 chunks missing" in problems
    assert runs["timeline"]["code"] == 2 and len(lines_of(runs["timeline"]["stderr"])) == 1
    delta = runs["delta-bias"]
    assert delta["code"] in (0, 1), delta  # step 0 is analysed
    warning = lines_of(delta["stderr"])
    assert len(warning) == 1 and warning[0].startswith("warning: damaged: ") and "step(s) 1, 2 are damaged" in \
        warning[0], delta["stderr"]


def test_capture_steps_keeps_a_huge_range_lazy(tmp_path):
    """`capture --steps 0:10**18` built the set (5.1 GB) and blamed the dump: now the two steps the script runs
    are recorded and the rest is one warning line giving the range."""
    from tests.cli.test_capture_cli import SCRIPT
    from tests.helpers.hostile import lines_of

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    capped = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30)); "
              "sys.argv = ['fa-forensics'] + sys.argv[1:]; runpy.run_module('fa_forensics', run_name='__main__')")
    args = ["capture", "--out", tmp_path / "run.zarr", "--steps", "0:1000000000000000000", "--json",
            tmp_path / "c.json", "--", sys.executable, script, "2", tmp_path / "seen.pt"]
    run = subprocess.run([sys.executable, "-c", capped, *map(str, args)], capture_output=True, text=True, timeout=240,
                         env=env, cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr  # selected steps never reached
    summary = json.loads((tmp_path / "c.json").read_text())
    assert summary["steps"] == [0, 1] and summary["never_reached"][:2] == [2, 3] and len(summary["never_reached"]) \
        == 1000
    assert lines_of(run.stderr) == [line for line in lines_of(run.stderr) if "2:1000000000000000000" in line]
    assert "out of memory" not in run.stderr


# -- special files inside a dump, and in the cache ------------------------------------------------------------------


def _cli_in_subprocess(*args, timeout: float = 120):
    """The CLI in its own process, so that a read that blocks fails the test instead of hanging it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fa_forensics", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_special_files_inside_a_dump_are_refused_without_blocking(make_dump):
    """A layer zarr.json that is a FIFO hung verify; one that is a character device (/dev/zero) was read until
    memory ran out; a FIFO chunk was '1 chunk missing ()'."""
    from tests.helpers.hostile import char_device, lines_of

    dump = make_dump(steps=(0, 1, 2))
    (dump / "step_000000001" / "layer_000" / "zarr.json").unlink()
    os.mkfifo(dump / "step_000000001" / "layer_000" / "zarr.json")
    (dump / "step_000000002" / "layer_000" / "q" / "c.0.1.0.0").unlink()
    os.mkfifo(dump / "step_000000002" / "layer_000" / "q" / "c.0.1.0.0")
    zero = char_device(dump / "step_000000000" / "layer_000" / "v" / "zero", 1, 5)
    if zero:
        (dump / "step_000000000" / "layer_000" / "v" / "c.0.0.0.0").unlink()
        os.rename(dump / "step_000000000" / "layer_000" / "v" / "zero",
                  dump / "step_000000000" / "layer_000" / "v" / "c.0.0.0.0")
    run = _cli_in_subprocess("verify", dump, "--json", dump.parent / "v.json")
    assert run.returncode == 1 and len(lines_of(run.stderr)) == 1, run.stderr
    problems = {p["file"]: p["what"] for p in json.loads((dump.parent / "v.json").read_text())["problems"]}
    assert problems["step_000000001/layer_000/zarr.json"] == "zarr.json is a FIFO (named pipe), not a file"
    assert problems["step_000000002/layer_000/q/c.0.1.0.0"] == \
        "1 chunk not a regular file (c.0.1.0.0: a FIFO (named pipe))"
    if zero:
        assert problems["step_000000000/layer_000/v/c.0.0.0.0"] == \
            "1 chunk not a regular file (c.0.0.0.0: a character device)"
    root_fifo = make_dump(steps=(0,))
    (root_fifo / "zarr.json").unlink()
    os.mkfifo(root_fifo / "zarr.json")
    run = _cli_in_subprocess("info", root_fifo)
    assert run.returncode == 2 and lines_of(run.stderr) == [
        f"error: damaged: {root_fifo}/zarr.json: zarr.json is a FIFO (named pipe), not a file; give the path of a "
        ".zarr dump made by `fa-forensics capture`, `synth` or `import`"], run.stderr


def test_a_fifo_in_the_match_cache_is_never_waited_on(tmp_path, make_dump):
    dump = make_dump(steps=(0,))
    cache = tmp_path / "cache"
    assert _cli_in_subprocess("match", dump, "--match-cache", cache).returncode == 0
    entries = sorted((cache / "match").iterdir())
    assert entries
    for entry in entries:
        entry.unlink()
        os.mkfifo(entry)
    run = _cli_in_subprocess("match", dump, "--match-cache", cache)
    assert run.returncode == 0 and "a FIFO (named pipe), not a regular file; not read" in run.stderr, run.stderr


# -- links in the folders on the way --------------------------------------------------------------------------------


def test_a_link_planted_in_a_shared_folder_is_never_followed(tmp_path, make_dump):
    """`results` planted by another user in a sticky world-writable folder: --json, report --out, the match cache
    and capture --out through it are refused in one line, its target untouched."""
    from tests.cli.test_capture_cli import SCRIPT
    from tests.helpers.hostile import OTHER_UID

    dump = make_dump(steps=(0,))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    target = tmp_path / "someone-elses-folder"
    target.mkdir()
    (shared / "results").symlink_to(target)
    os.lchown(shared / "results", OTHER_UID, OTHER_UID)
    via = shared / "results"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for args in (["info", dump, "--json", via / "out.json"], ["report", dump, "--out", via / "rep"],
                 ["isolate", dump, "--match-cache", via / "cache"],
                 ["capture", "--out", via / "run.zarr", "--steps", "1", "--", sys.executable, script, "2",
                  tmp_path / "seen.pt"]):
        _refused(*_cli(*args), "planted by another user (uid 12345) in a sticky world-writable folder")
    assert os.listdir(target) == []
    os.lchown(shared / "results", 0, 0)  # the same link made by the user (root here): followed
    result, _ = _cli("info", dump, "--json", via / "out.json")
    assert result.exit_code == 0 and json.loads((target / "out.json").read_text())["steps"] == [0]


# -- text from a dump on the terminal ---------------------------------------------------------------------------------


HOSTILE = "x\x1b]0;pwned\x07\x1b[2J\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\\n[bold]fake row[/bold]\u202e"


def test_text_from_a_dump_reaches_the_terminal_escaped(tmp_path, make_dump):
    """Model name, capture source, module names and a leftover folder name with title-setting, screen-clearing
    and hyperlink escapes, a newline and markup: every line of info, verify, match, an analysis and its warnings
    holds no control character, and the text shows escaped."""
    dump = make_dump(steps=(0, 1), run_attrs={"model": {"name": HOSTILE}, "capture": {"source": HOSTILE}})
    meta_path = dump / LAYER / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["module"] = HOSTILE
    meta_path.write_text(json.dumps(meta))
    (dump / "step_000000001" / "layer_000" / "q" / "c.0.1.0.0").unlink()  # a damaged step: a warning line
    (tmp_path / f".{dump.name}.{HOSTILE[:12]}.old").mkdir()  # a leftover verify lists by its name
    outputs = []
    for args in (["info", dump], ["verify", dump], ["match", dump], ["pv-trace", dump]):
        result, lines = _cli(*args)
        assert result.exit_code in (0, 1), (args, result.stdout + result.stderr)
        outputs.append(result.stdout + result.stderr)
    text = "".join(outputs)
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in text
    assert "\\x1b]0;pwned\\x07" in outputs[0] and "[bold]fake row[/bold]" in outputs[0]  # shown, escaped
    assert "fake row" not in "".join(line for line in outputs[0].splitlines() if line.lstrip("│ ").startswith("["))
    assert "\\x1b]0;pwned" in outputs[1]  # the leftover's name


# -- malformed metadata: damaged, worded, and the healthy steps still run -----------------------------------------


def test_info_says_damaged_steps_are_damaged_not_cut_off(make_dump):
    dump = make_dump(steps=(0, 1), incomplete=(2,))
    (dump / "step_000000001" / "layer_000" / "k" / "c.0.0.0.0").unlink()
    result, _ = _cli("info", dump)
    assert result.exit_code == 0
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") >= 3}
    assert "2 (cut off while writing; skipped)" in rows["incomplete steps"]
    assert "1 (skipped; `fa-forensics verify` lists the problems)" in rows["damaged steps"]


# -- Ctrl-C at any moment ---------------------------------------------------------------------------------------------


_INTERRUPT_AT_IMPORT = """
import importlib.abc, os, signal, sys
TARGET = sys.argv[1]
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == TARGET:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the module starts to import
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["fa-forensics"] + sys.argv[2:]
from fa_forensics.cli import main
main()
"""


@pytest.mark.parametrize("module, command", [
    ("typer", "verify"), ("zarr", "verify"), ("fa_forensics.dump.verify", "verify"),
    ("torch", "delta-bias"), ("scipy", "delta-bias"),  # verify starts without them: an analysis imports both
])
def test_ctrl_c_while_the_cli_starts_is_one_line_and_exit_130(make_dump, module, command):
    dump = make_dump(steps=(0,))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [command, str(dump), *(["--preset", "bf16"] if command == "delta-bias" else [])]
    run = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_IMPORT, module, *args],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 130, run.stderr
    assert [line for line in run.stderr.splitlines() if line.strip()] == ["interrupted"], run.stderr


_INTERRUPT_IN_REPORT = """
import os, signal, sys
import fa_forensics.report.run as run
section = run.run_section
def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the report is written in its staging folder
    return section(*args, **kwargs)
run.run_section = interrupted
sys.argv = ["fa-forensics"] + sys.argv[1:]
from fa_forensics.cli import main
main()
"""


def test_ctrl_c_during_a_report_leaves_no_debris(tmp_path, make_dump):
    dump = make_dump(steps=(0,))
    out = tmp_path / "out"
    out.mkdir()
    before = sorted(os.listdir(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERRUPT_IN_REPORT, "report", str(dump), "--out", str(out)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 130 and [line for line in run.stderr.splitlines() if line.strip()] == ["interrupted"], \
        run.stderr
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(out) == []


def test_ctrl_c_during_a_capture_leaves_the_store_whole_and_unlocked(tmp_path):
    """Ctrl-C reaches the whole process group: the training script's capture ends as a failed run (its completed
    steps kept, its lock released) and the command says "interrupted" once, exit 130, no traceback."""
    import signal
    import time

    from tests.cli.test_capture_cli import SCRIPT

    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fa_forensics", "capture", "--out", "run.zarr", "--steps", "1,3",
                             "--", sys.executable, "train.py", "100000", "seen.pt"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while not (tmp_path / "run.zarr" / "step_000000003" / "zarr.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # step 3 is being completed or done; the run goes on (100000 steps)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and [line for line in err.splitlines() if line.strip()] == ["interrupted"], err
    assert sorted(os.listdir(tmp_path)) == ["run.zarr", "train.py"]  # no lock, no staging folder
    result, _ = _cli("verify", tmp_path / "run.zarr", "--json", tmp_path / "v.json")
    assert result.exit_code == 0 and json.loads((tmp_path / "v.json").read_text())["steps"] == [1, 3]


# -- outputs never go into an input ----------------------------------------------------------------------------

_OVERLAP = "an output never goes into an input"
# What a command line needs besides the option under test ({free}: a folder outside every input).
_REQUIRED = {"report": ["--out", "{free}/r"], "export": ["--to", "{free}/e.safetensors"],
             "import": ["--to", "{free}/i.zarr"], "synth": ["--out", "{free}/s.zarr"],
             "capture": ["--out", "{free}/c.zarr"]}


def _targets_inside(dump: Path, tmp_path: Path) -> dict[str, Path]:
    """Names of the dump's own files and folders, reached every way a path can reach them."""
    alias = tmp_path / "alias"
    alias.symlink_to(dump, target_is_directory=True)
    (tmp_path / "sub").mkdir()
    hard = tmp_path / "hard.json"
    os.link(dump / "zarr.json", hard)
    return {
        "the dump itself": dump,
        "its root zarr.json": dump / "zarr.json",
        "a chunk": dump / LAYER / "o" / "c.0.0.0.0",
        "a layer's metadata": dump / LAYER / "zarr.json",
        "a new name inside": dump / LAYER / "new" / "out.json",
        "a link to the dump, then a name": alias / "x.json",
        "a path through ..": tmp_path / "sub" / ".." / dump.name / "step_000000000" / "y.json",
        "a hard link of its zarr.json": hard,
    }


def _argv(command: str, option: str, target: Path, inputs: list[tuple[str, str]], dump: Path, tensors: Path,
          free: Path) -> list:
    args: list = [command]
    for name, _kind in inputs:
        args.append(dump if name == "dump" else tensors)
    args += [option, target]
    required = _REQUIRED.get(command, [])
    if required and required[0] != option:
        args += [required[0], required[1].format(free=free)]
    if command in ("export", "import", "synth", "capture"):
        args.append("--overwrite")
    if command == "capture":
        args += ["--", sys.executable, "-c", "pass"]
    return args


def test_every_command_refuses_every_output_inside_the_dump_it_reads(tmp_path, make_dump):
    """Every registered command with an output option (--json, --out, --to, --tensorboard, --match-cache, ...),
    aimed at the dump it reads, at one of its files, at a new name inside it, through a link, through `..` or at a
    hard link of one of its files: one line, exit 2, and the dump's bytes and modes unchanged."""
    from tests.helpers.hostile import output_commands, snapshot

    dump = make_dump("in.zarr", steps=(0,))
    tensors = _tensors_file(tmp_path / "t.safetensors")
    free = tmp_path / "free"
    free.mkdir()
    targets = _targets_inside(dump, tmp_path)
    before = snapshot(dump)
    commands = output_commands()
    checked = 0
    for command, params in commands.items():
        inputs = [p for p in params if p[1] == "argument"]
        if not any(name == "dump" for name, _ in inputs):
            continue
        for option, _kind in (p for p in params if p[1] == "option"):
            for label, target in targets.items():
                result, lines = _cli(*_argv(command, option, target, inputs, dump, tensors, free))
                assert result.exit_code == 2 and len(lines) == 1 and _OVERLAP in lines[0], \
                    (command, option, label, result.stdout + result.stderr)
                checked += 1
    assert snapshot(dump) == before
    assert {"info", "verify", "export", "match", "report", "timeline", "delta-bias"} <= set(commands)
    assert checked >= 13 * 2 * len(targets)


def test_import_never_writes_over_the_file_it_reads(tmp_path):
    """`import FILE --to FILE --overwrite`, `--json FILE` and `--json` at a hard link of FILE: refused, FILE kept."""
    from tests.helpers.hostile import snapshot

    src = _tensors_file(tmp_path / "in.safetensors")
    hard = tmp_path / "also.safetensors"
    os.link(src, hard)
    before = snapshot(tmp_path)
    for args in (["--to", src, "--overwrite"], ["--to", tmp_path / "d.zarr", "--json", src],
                 ["--to", tmp_path / "d.zarr", "--json", hard], ["--to", tmp_path, "--overwrite"]):
        result, lines = _cli("import", src, *args)
        assert result.exit_code == 2 and len(lines) == 1 and _OVERLAP in lines[0], (args, result.stderr)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", [
    ["synth", "--out", "{o}", "--json", "{o}/zarr.json"],
    ["capture", "--out", "{o}", "--json", "{o}/run.json", "--", sys.executable, "-c", "pass"],
    ["capture", "--out", "{o}", "--monitor-tensorboard", "{o}/tb", "--", sys.executable, "-c", "pass"],
    ["demo-train", "--capture", "{o}", "--json", "{o}/step_000000000/x.json"],
])
def test_no_output_lands_inside_a_store_the_command_replaces(tmp_path, command):
    out = tmp_path / "o.zarr"
    result, lines = _cli(*[a.format(o=out) if isinstance(a, str) else a for a in command])
    assert result.exit_code == 2 and len(lines) == 1 and "replaces whole" in lines[0], result.stderr
    assert not out.exists()


def test_a_match_cache_inside_the_dump_is_refused_from_the_environment_too(tmp_path, make_dump):
    from tests.helpers.hostile import snapshot

    dump = make_dump(steps=(0,))
    before = snapshot(dump)
    result = CliRunner().invoke(app, ["match", str(dump)], env={"FA_FORENSICS_CACHE_DIR": str(dump / "cache"),
                                                                  INTERVAL_ENV: "0"})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and _OVERLAP in lines[0], result.stderr
    assert snapshot(dump) == before


def test_outputs_beside_the_dump_are_still_written(tmp_path, make_dump):
    """The check refuses only what overlaps: --json and --out beside the dump, and --out holding the dump's folder
    for figures (not replaced whole), are written."""
    dump = make_dump("d.zarr", steps=(0,))
    result, _ = _cli("info", dump, "--json", tmp_path / "info.json")
    assert result.exit_code == 0 and json.loads((tmp_path / "info.json").read_text())["steps"] == [0]
    result, _ = _cli("verify", dump, "--json", tmp_path / "d.zarr.json")
    assert result.exit_code == 0


# -- two writers of one path -----------------------------------------------------------------------------------

def test_a_store_that_appears_before_the_rename_is_never_replaced(tmp_path):
    """The existence of a new store is decided under its lock and again by the rename: a store another writer put
    at the path after the caller looked is kept, and the late writer is refused with nothing left behind."""
    from fa_forensics.dump.staging import staged_store
    from fa_forensics.errors import TargetExists
    from tests.helpers.hostile import snapshot

    dst = tmp_path / "s.zarr"
    with pytest.raises(TargetExists):
        with staged_store(dst, "out") as tmp:
            (tmp / "zarr.json").write_text("{}")
            dst.mkdir()
            (dst / "zarr.json").write_text('{"theirs": 1}')  # the other writer, between our check and our rename
    assert (dst / "zarr.json").read_text() == '{"theirs": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    before = snapshot(tmp_path)
    with pytest.raises(TargetExists):
        with staged_store(dst, "out"):  # already there when the lock is taken
            pass
    assert snapshot(tmp_path) == before


def test_two_synths_of_one_path_never_both_succeed(tmp_path):
    """Two `synth --out X` started together: one writes X, the other is refused in one line (it exists, or it is
    being written); X is one whole dump."""
    out = tmp_path / "s.zarr"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", INTERVAL_ENV: "0"}
    argv = [sys.executable, "-m", "fa_forensics", "synth", "--seq", "64", "--heads", "2", "--head-dim", "16",
            "--steps", "2", "--batch", "1", "--out", str(out)]
    runs = [subprocess.Popen([*argv, "--seed", str(seed)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for seed in (1, 2)]
    done = [(r.wait(timeout=600), r.stderr.read()) for r in runs]
    codes = sorted(code for code, _ in done)
    assert codes == [0, 2], done
    refused = next(err for code, err in done if code == 2)
    assert "already exists" in refused or "being written by another process" in refused, refused
    assert _cli("verify", out)[0].exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_export_without_overwrite_never_replaces_a_file_that_appeared(tmp_path):
    from fa_forensics.dump.safe_files import atomic_write
    from fa_forensics.errors import TargetExists

    target = tmp_path / "e.safetensors"
    target.write_text("theirs")
    with pytest.raises(TargetExists):
        atomic_write(target, b"ours", "to", exclusive=True)
    assert target.read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["e.safetensors"]
    atomic_write(tmp_path / "new.safetensors", b"ours", "to", exclusive=True)
    assert (tmp_path / "new.safetensors").read_bytes() == b"ours"


# -- a full disk while zarr writes chunks in parallel ------------------------------------------------------------

def _enospc_on_a_chunk_while_others_are_in_flight(monkeypatch):
    """zarr writes a chunk's folder and file in worker threads: the third chunk write fails with ENOSPC while the
    writes after it are still running (and would create their folders again after a cleanup)."""
    import threading
    import time

    import zarr.storage._local as local

    real, lock, count = local._put, threading.Lock(), [0]

    def put(path, value, exclusive=False):
        if path.name.startswith("c.") or "/c/" in str(path):
            with lock:
                count[0] += 1
                n = count[0]
            if n == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            if n > 3:
                time.sleep(0.3)
        return real(path, value, exclusive=exclusive)

    monkeypatch.setattr(local, "_put", put)


@pytest.mark.parametrize("command", ["synth", "import"])
def test_a_full_disk_mid_write_leaves_nothing_behind(tmp_path, monkeypatch, command):
    src = _tensors_file(tmp_path / "in.safetensors", steps=2)
    _enospc_on_a_chunk_while_others_are_in_flight(monkeypatch)
    if command == "synth":
        args = ["synth", "--seq", 64, "--heads", 4, "--head-dim", 16, "--steps", 1, "--batch", 2,
                "--out", tmp_path / "d.zarr"]
    else:
        args = ["import", src, "--to", tmp_path / "d.zarr"]
    result, lines = _cli(*args)
    _refused(result, lines, "no space left on the device")
    assert "nothing was left in its place" in lines[0]
    import time

    time.sleep(1.0)  # any write still in flight would have recreated its folder by now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


# -- files judged by what they hold -------------------------------------------------------------------------------

def test_sparse_chunks_cost_what_the_disk_holds(make_dump):
    """A 1 GiB sparse chunk holding 952 kB (in q, and in a timeline series): verify names both before any read,
    match and delta-bias refuse in one line, the timeline command names its file; the peak stays at its baseline
    (reading the chunk took 2.1 GB)."""
    from fa_forensics.dump import DumpWriter
    from tests.helpers.hostile import lines_of, run_capped, sparse_file

    dump = make_dump(steps=(0,))
    with DumpWriter(dump, {"model": {"name": "test"}}) as writer:
        writer.append_timeline(0, loss=1.0)
    sparse_file(dump / LAYER / "q" / "c.0.1.0.0", os.urandom(975_000), 2**30)
    loss_chunk = next(p for p in (dump / "timeline" / "loss").rglob("*") if p.is_file() and p.name != "zarr.json")
    sparse_file(loss_chunk, os.urandom(975_000), 2**30 + 4096)
    report = dump.parent / "verify.json"
    runs = run_capped([["verify", dump, "--json", report], ["match", dump], ["delta-bias", dump],
                       ["timeline", dump]], cap_gb=6)
    assert runs["max_rss_mb"] < 1500, runs["max_rss_mb"]
    problems = json.loads(report.read_text())["problems"]
    assert runs["verify"]["code"] == 1
    assert {p["file"] for p in problems if "sparse" in p["what"]} == {
        f"{LAYER.as_posix()}/q/c.0.1.0.0", f"timeline/{loss_chunk.relative_to(dump / 'timeline').as_posix()}"}, problems
    assert not any("cannot be decoded" in p["what"] for p in problems)  # judged before any read, never decoded
    for command in ("match", "delta-bias", "timeline"):
        run = runs[command]
        assert run["code"] == 2 and len(lines_of(run["stderr"])) == 1 and "sparse" in run["stderr"], (command, run)


def test_chunk_files_longer_than_their_chunk_and_sparse_metadata_are_damage(make_dump):
    """A dense 8 MiB chunk file for a chunk of 256 bytes, a layer zarr.json of 15 MiB that is a hole, a root
    zarr.json that is one: each named as damage of its file before it is read."""
    from tests.helpers.hostile import lines_of, run_capped, sparse_file

    dump = make_dump(steps=(0, 1, 2))
    (dump / "step_000000000" / "layer_000" / "k" / "c.0.0.0.0").write_bytes(os.urandom(8 * 2**20))
    meta = dump / "step_000000001" / "layer_000" / "zarr.json"
    sparse_file(meta, meta.read_bytes(), 15 * 2**20)
    report = dump.parent / "verify.json"
    runs = run_capped([["verify", dump, "--json", report], ["delta-bias", dump]], cap_gb=6)
    problems = {p["file"]: p["what"] for p in json.loads(report.read_text())["problems"]}
    assert runs["verify"]["code"] == 1
    assert "longer than any encoding of the chunk's 256 bytes" in problems[
        "step_000000000/layer_000/k/c.0.0.0.0"], problems
    assert "zarr.json is a sparse file" in problems["step_000000001/layer_000/zarr.json"], problems
    delta = runs["delta-bias"]
    assert delta["code"] in (0, 1), delta  # step 2 is analysed
    warning = lines_of(delta["stderr"])
    assert len(warning) == 1 and "step(s) 0, 1 are damaged" in warning[0], delta["stderr"]
    root = dump / "zarr.json"
    sparse_file(root, root.read_bytes(), 15 * 2**20)
    result, lines = _cli("info", dump)
    _refused(result, lines, "zarr.json is a sparse file")


@pytest.mark.parametrize("where", ["capture.heads", "model.name", "ground_truth", "other"])
def test_metadata_of_millions_of_values_is_refused_in_bounded_time(make_dump, where):
    """A root zarr.json under the size cap holding a list of 2·10^6 zeros (rendering it took minutes): one line,
    refused before it is parsed."""
    from tests.helpers.hostile import run_capped

    dump = make_dump(steps=(0,))
    meta = json.loads((dump / "zarr.json").read_text())
    attrs = meta["attributes"]["fa_forensics"]
    zeros = [0] * 2_000_000
    if where == "other":
        meta["attributes"]["x"] = zeros
    else:
        outer, _, inner = where.partition(".")
        if inner:
            attrs.setdefault(outer, {})[inner] = zeros
        else:
            attrs[outer] = zeros
    (dump / "zarr.json").write_text(json.dumps(meta))
    assert (dump / "zarr.json").stat().st_size < 16 * 2**20
    runs = run_capped([["info", dump]], cap_gb=6, timeout=120)
    assert runs["info"]["code"] == 2 and "values, more than the 1048576" in runs["info"]["stderr"], runs["info"]


def test_a_long_attribute_under_the_cap_is_shown_shortened(make_dump):
    dump = make_dump(steps=(0,))
    meta = json.loads((dump / "zarr.json").read_text())
    meta["attributes"]["fa_forensics"].setdefault("capture", {})["heads"] = [0] * 300_000
    meta["attributes"]["fa_forensics"]["model"]["name"] = "m" * 100_000
    (dump / "zarr.json").write_text(json.dumps(meta))
    result, _ = _cli("info", dump)
    assert result.exit_code == 0 and len(result.stdout) < 20_000
    assert "..." in result.stdout


# -- links out of the store ----------------------------------------------------------------------------------

def test_a_root_zarr_json_linking_out_of_the_store_is_damage(tmp_path, make_dump):
    other = make_dump("other.zarr", steps=(0,))
    dump = make_dump("d.zarr", steps=(0,))
    (dump / "zarr.json").unlink()
    (dump / "zarr.json").symlink_to(other / "zarr.json")
    for command in ("verify", "info", "match"):
        result, lines = _cli(command, dump)
        _refused(result, lines, "link leaving the store")
        assert "zarr.json" in lines[0]


@pytest.mark.parametrize("how", ["folder", "zarr.json"])
def test_a_rank_linked_to_another_dump_is_never_a_rank(tmp_path, make_dump, how):
    """rank_1 (a folder linked to another dump, or a real folder whose zarr.json links to another dump's): never
    read as rank 1 of a 2-rank run; verify names it, info warns, --rank 1 is refused in one line."""
    other = make_dump("other.zarr", steps=(0,))
    dump = make_dump("d.zarr", steps=(0,))
    rank = dump / "rank_1"
    if how == "folder":
        rank.symlink_to(other, target_is_directory=True)
    else:
        rank.mkdir()
        (rank / "zarr.json").symlink_to(other / "zarr.json")
    result, _ = _cli("verify", dump, "--json", tmp_path / "v.json")
    report = json.loads((tmp_path / "v.json").read_text())
    assert result.exit_code == 1 and any("rank 1's tree is a link leaving the store" in p["what"]
                                         for p in report["problems"]), report
    result, _ = _cli("info", dump, "--json", tmp_path / "i.json")
    info = json.loads((tmp_path / "i.json").read_text())
    assert result.exit_code == 0 and info["ranks"] == [0]
    assert any("link leaving the store" in w for w in info["warnings"]), info["warnings"]
    assert "2-rank" not in result.stderr
    result, lines = _cli("info", dump, "--rank", 1)
    _refused(result, lines, "link leaving the store")


# -- wording: every damage line names its file, step and what is wrong ---------------------------------------

def test_damage_is_worded_with_its_file_and_no_empty_lists(tmp_path, make_dump):
    """A chunk that is a link to nothing is named as such (never "1 chunk missing ()"); verify's summary counts in
    words ("1 problem in step 0", never "problem(s) in step(s) []"); an analysis of a dump whose one step is damaged
    names the damaged file (never "incomplete, cut off")."""
    dump = make_dump(steps=(0,))
    chunk = dump / LAYER / "v" / "c.0.1.0.0"
    chunk.unlink()
    chunk.symlink_to(dump / LAYER / "v" / "gone")
    result, _ = _cli("verify", dump, "--json", tmp_path / "v.json")
    problems = [p["what"] for p in json.loads((tmp_path / "v.json").read_text())["problems"]]
    assert any("link to nothing (c.0.1.0.0 -> " in p for p in problems), problems
    assert not any("()" in p for p in problems), problems
    assert "1 problem in step 0" in result.stderr and "(s)" not in result.stderr.split("damaged:")[-1], result.stderr
    result, lines = _cli("delta-bias", dump)
    _refused(result, lines, "no complete step")
    assert "step 0 damaged" in lines[0] and "v/c.0.1.0.0" in lines[0] and "cut off" not in lines[0], lines


def test_an_output_into_the_store_of_a_rank_folder_read_is_refused(tmp_path, make_dump):
    """`info run.zarr/rank_1 --json run.zarr/zarr.json`: a rank folder opens its store: the store is the input."""
    from tests.helpers.hostile import snapshot

    dump = make_dump("d.zarr", steps=(0,))
    make_dump("r1.zarr", steps=(0,)).rename(dump / "rank_1")
    before = snapshot(dump)
    for output in (dump / "zarr.json", dump / "step_000000000" / "out.json"):
        result, lines = _cli("info", dump / "rank_1", "--json", output)
        assert result.exit_code == 2 and len(lines) == 1 and _OVERLAP in lines[0], result.stderr
    assert snapshot(dump) == before


def test_a_sparse_safetensors_file_is_refused_before_it_is_read(tmp_path):
    from tests.helpers.hostile import sparse_file

    src = _tensors_file(tmp_path / "in.safetensors")
    sparse_file(src, src.read_bytes(), 2**30)
    result, lines = _cli("import", src, "--to", tmp_path / "d.zarr")
    _refused(result, lines, "sparse file")
    assert not (tmp_path / "d.zarr").exists()
