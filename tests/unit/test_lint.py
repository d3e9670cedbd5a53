"""ruff, configured in pyproject.toml ([tool.ruff]), finds nothing in the package, the tests and the benchmarks."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "fa_forensics", "tests", "benchmarks",
                        "cli.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr
