"""The CLI starts without its heavy libraries: `--help`, every command's `--help` and the app itself are built
from light modules (typer, the enums, the option table, the registry), and torch, numba, scipy, matplotlib,
dask and triton are imported only by the command bodies that compute with them. Checked on the import list
of `python -X importtime`, in a fresh interpreter for each command line. (`verify` of a dump that keeps a
matched recipe replays a row sample to re-check it: that run computes, and imports what replay needs.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numba", "scipy", "matplotlib", "dask", "distributed", "triton")


def imported(*args: str) -> set[str]:
    """The top-level packages `python -X importtime -m fa_forensics ARGS` imports (its exit code must be 0)."""
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "fa_forensics", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert lines, "no -X importtime lines on stderr"
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines[1:]}


@pytest.mark.parametrize("args", [
    ("--help",),
    ("info", "--help"),
    ("isolate", "--help"),
    ("pcast", "--help"),
    ("report", "--help"),
], ids=" ".join)
def test_help_imports_no_heavy_library(args):
    modules = imported(*args)
    assert "typer" in modules and "fa_forensics" in modules  # the list is the real one
    assert not modules & set(HEAVY), f"{' '.join(args)} imported {sorted(modules & set(HEAVY))}"


@pytest.fixture(scope="module")
def planted_dump(tmp_path_factory) -> Path:
    """A small planted dump: it keeps no `replay_match`, so `verify` has nothing to replay."""
    from fa_forensics.planted import SynthSpec, synth

    path = tmp_path_factory.mktemp("startup") / "planted.zarr"
    synth(path, SynthSpec(seq=64, heads=2, head_dim=16, batch=1, steps=2))
    return path


@pytest.mark.parametrize("command", [("info",), ("info", "--json", "-"), ("verify",)], ids=" ".join)
def test_metadata_commands_import_no_heavy_library(command, planted_dump):
    modules = imported(command[0], str(planted_dump), *command[1:])
    assert "zarr" in modules  # the dump was read
    assert not modules & set(HEAVY), f"{' '.join(command)} imported {sorted(modules & set(HEAVY))}"


def test_info_of_a_sample_dump_imports_no_heavy_library():
    modules = imported("info", str(REPO / "sample_dumps" / "demo.zarr"))
    assert not modules & set(HEAVY), f"info imported {sorted(modules & set(HEAVY))}"
