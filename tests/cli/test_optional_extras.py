"""An optional part that is not installed: one line naming the extra that installs it, exit code 2.

Each case runs the real CLI (or library call) in a fresh interpreter in which the optional module
cannot be imported (`sys.modules[name] = None` makes every import of it raise ImportError).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts the CLI in subprocesses

REPO = Path(__file__).resolve().parents[2]
PLANTED = REPO / "sample_dumps" / "planted.zarr"


def _run_without(blocked: list[str], code: str) -> subprocess.CompletedProcess:
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def _cli_without(blocked: list[str], *args: str) -> subprocess.CompletedProcess:
    argv = ["fa-forensics", *args]
    return _run_without(blocked, f"sys.argv = {argv!r}\nfrom fa_forensics.cli import main\nmain()\n")


@pytest.mark.parametrize("options", [["--workers", "2"], ["--scheduler", "tcp://127.0.0.1:1"]])
def test_fanout_without_dask_names_the_dask_extra(options):
    r = _cli_without(["dask", "dask.distributed", "distributed"], "delta-bias", str(PLANTED), *options)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "--workers N and --scheduler needs dask.distributed" in lines[0]
    assert lines[0].endswith("install it with: pip install 'fa-forensics[dask]'")


def test_triton_backend_without_triton_names_the_gpu_extra():
    r = _cli_without(["triton"], "delta-bias", str(PLANTED), "--backend", "triton")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "the replay backend triton needs triton" in lines[0]
    assert lines[0].endswith("install it with: pip install 'fa-forensics[gpu]'")


@pytest.mark.parametrize("call", [
    "from fa_forensics.replay.stable import stable_attention\n"
    "stable_attention(q, q, q, backend='triton')\n",
    "from fa_forensics.monitor.stats import head_statistics\n"
    "head_statistics(q, q, causal=True, backend='triton')\n",
])
def test_library_triton_paths_without_triton_raise_missing_extra(call):
    code = ("import torch\nfrom fa_forensics.errors import MissingExtra\nq = torch.randn(1, 1, 16, 16)\n"
            f"try:\n    {call.replace(chr(10), chr(10) + '    ')}\nexcept MissingExtra as exc:\n"
            "    print(exc.extra, exc.module)\n")
    r = _run_without(["triton"], code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["gpu", "triton"]
