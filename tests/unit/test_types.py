"""The type check: mypy over the packages pyproject.toml's [tool.mypy] lists finds no error."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # mypy reads torch's and zarr's types: about 11 s of CPU without its cache (.mypy_cache), 0.3 s with
def test_mypy_finds_no_error_in_the_checked_packages() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "mypy"],
                         cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found" in run.stdout
