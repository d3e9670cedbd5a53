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


def pytest_collection_modifyitems(config, items):
    """Skip this directory (with the reason) if triton was imported before TRITON_INTERPRET=1 took effect."""
    if not _TRITON_TOO_EARLY:
        return
    import triton

    if triton.knobs.runtime.interpret:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason="triton was imported before tests/triton/conftest.py set TRITON_INTERPRET=1; run tests/triton in its own pytest process"))


@pytest.fixture(scope="session", autouse=True)
def _interpreter_compat():
    import interpreter_compat  # this directory is on sys.path (pytest rootdir-relative import)

    interpreter_compat.install()
    yield
    interpreter_compat.uninstall()
