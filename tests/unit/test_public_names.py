"""Every documented name imports and means the same thing whatever was imported before it: the names of
docs/api.md (`::: dotted.name`) and of `fa_forensics.__all__`, each run in a fresh interpreter in several
orders; `fa_forensics.replay` and `fa_forensics.capture` stay callable as their functions (a package and
a function of the same name would otherwise swap at the first import of the package)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fa_forensics

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: import the names in the given order, then call replay and capture the documented way.
PROBE = r'''
import importlib, json, sys
names = json.loads(sys.argv[1])
seen = {}
for name in names:
    if name.startswith("fa_forensics.") and name.count(".") >= 1:
        module, _, attr = name.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):  # a module itself (fa_forensics.errors)
            obj = importlib.import_module(name)
    else:
        obj = getattr(importlib.import_module("fa_forensics"), name)
    seen[name] = type(obj).__name__
import torch
from fa_forensics import replay, ReplayConfig
q = torch.linspace(-1, 1, 32).view(1, 1, 4, 8)
out = replay(q, q, q, ReplayConfig.preset("fp32"))
assert out.o.shape == (1, 1, 4, 8), out.o.shape
assert replay.ReplayConfig is ReplayConfig  # the same object is also the package
import fa_forensics
assert callable(fa_forensics.capture) and callable(fa_forensics.replay)
assert fa_forensics.replay is replay
print(json.dumps(seen))
'''


def documented_names() -> list[str]:
    api = (ROOT / "docs" / "api.md").read_text()
    return re.findall(r"^::: (\S+)", api, flags=re.M) + [n for n in fa_forensics.__all__ if n != "__version__"]


def _probe(names: list[str]) -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE, json.dumps(names)], capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def documented_order() -> tuple[list[str], dict]:
    """The documented names and the kind of each, imported in the documented order in a fresh interpreter."""
    names = documented_names()
    return names, _probe(names)


def test_every_documented_name_imports_and_replay_stays_callable(documented_order):
    names, kinds = documented_order
    assert "fa_forensics.replay.replay" in names and "replay" in names and "capture" in names
    # the functions documented as functions; the package-level names are the callable packages
    assert kinds["fa_forensics.replay.replay"] == "function" and kinds["replay"] == "CallableModule"
    assert kinds["capture"] == "CallableModule"


@pytest.mark.slow  # three more fresh interpreters, each importing torch and every documented module
def test_every_documented_name_means_the_same_in_any_order(documented_order):
    names, first = documented_order
    subpackages_first = ["fa_forensics.replay.ReplayConfig", "fa_forensics.capture.CaptureSession", *names]
    orders = [list(reversed(names)), subpackages_first, ["replay", "capture"]]
    kinds = [first, *(_probe(order) for order in orders)]
    for name in names:  # the same kind of object, whichever order
        assert len({k[name] for k in kinds if name in k}) == 1, name
