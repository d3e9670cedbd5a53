"""What some tests need from the machine beyond Python packages."""
from __future__ import annotations

import os
import shutil

import pytest

# torch.compile on the CPU generates C++ and builds it with the system compiler. In CI (CI set) the
# compiler is part of the machine, so a missing one fails these tests instead of skipping them.
NEEDS_CXX = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None and not os.environ.get("CI"),
                               reason="torch.compile on the CPU needs a C++ compiler (g++)")
