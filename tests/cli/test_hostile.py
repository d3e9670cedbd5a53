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

LAYER = Path("step_000000000") / "layer_000"
REPO = Path(__file__).resolve().parents[2]


def _cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
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
    if where == "out":
        out.symlink_to(tmp_path)
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
