"""Run the Triton kernels on the CPU: Triton's interpreter plus this suite's compatibility layer.

TRITON_INTERPRET=1 must be set before triton is first imported (fa_forensics never imports it at
package import time, but transformers does), so tests/conftest.py sets it before any test module
is collected, and this file again for a run of this directory alone. interpreter_compat.install() fixes
the interpreter's bf16/fp8 casts and dots (see its docstring) for the whole session.
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

_TRITON_TOO_EARLY = "triton" in sys.modules


def pytest_itemcollected(item) -> None:
    """Triton's interpreter is slow: every test here is marked slow, left out of the fast loop. Called through
    this directory's hooks only (pytest scopes it by path), so it marks the tests of this folder."""
    item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config, items):
    """Stop the run, saying why, if triton was imported before TRITON_INTERPRET=1 took effect: the kernels
    would then need a GPU, and skipping this directory would hide every kernel test."""
    if not _TRITON_TOO_EARLY:
        return
    import triton

    if triton.knobs.runtime.interpret:
        return
    here = os.path.dirname(__file__)
    if any(str(item.fspath).startswith(here) for item in items):
        raise pytest.UsageError("triton was imported before tests/triton/conftest.py set TRITON_INTERPRET=1; "
                                "set TRITON_INTERPRET=1 in the environment or run tests/triton in its own pytest "
                                "process")


@pytest.fixture(scope="session", autouse=True)
def _interpreter_compat():
    import interpreter_compat  # this directory is on sys.path (pytest rootdir-relative import)

    interpreter_compat.install()
    yield
    interpreter_compat.uninstall()


@pytest.fixture
def aligned(monkeypatch):
    """The emulator's exp as the kernels' exp2(fp32(x·log2 e)) for one test: both sides then round 2ˣ once alike."""
    import interpreter_compat

    with interpreter_compat.align_emulator_exp(monkeypatch):
        yield
