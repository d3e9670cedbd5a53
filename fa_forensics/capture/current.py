"""The capture session that SDPA calls and the compiled-graph taps report to (None while capture is off).

One per process: `sdpa.install` sets it, `sdpa.uninstall` clears it. It lives apart from sdpa.py so that
the custom ops of graph_ops.py, which sdpa.py inserts into compiled graphs, read it without importing
sdpa.py.
"""
from __future__ import annotations

from typing import Optional

session: Optional[object] = None  # the active CaptureSession
