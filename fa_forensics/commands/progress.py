"""Progress for a log: what a long command is doing, as plain lines on stderr when stderr is not a terminal.

A terminal gets rich's live bar (commands/common.py). A log file or a pipe cannot redraw a bar, and a
silent log cannot tell a slow run from a hung one: `ProgressLines` prints one line every `interval`
seconds while a phase runs ("isolate: 12/48 (25%), step 297 layer 1, 35 s"), from a background thread,
so a phase whose single work item takes minutes still shows it is alive. A phase that ends within one
interval prints nothing, so quick commands (and an error found early) keep their output to what they
say. The interval is $FA_FORENSICS_PROGRESS_SECONDS (default 5; 0 turns the lines off).
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Optional, TextIO

from fa_forensics.errors import UserError

INTERVAL_ENV = "FA_FORENSICS_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 5.0


def progress_interval() -> float:
    """Seconds between two progress lines ($FA_FORENSICS_PROGRESS_SECONDS, default 5; 0: none)."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise UserError(f"${INTERVAL_ENV}={raw!r} is not a number of seconds; give e.g. 5, or 0 for no progress "
                        "lines, or unset it")
    return value


class ProgressLines:
    """A phase's progress as a plain line on `stream` every `interval` seconds while it runs (a context manager).

    `total`: the work items (None for a phase that is not counted); `advance(msg)` marks one done and names it.
    """

    def __init__(self, description: str, total: Optional[int] = None, *, interval: float = DEFAULT_INTERVAL,
                 stream: Optional[TextIO] = None):
        self.description = description
        self.total = total
        self.interval = interval
        self.stream = stream
        self.done = 0
        self.last = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = 0.0

    def advance(self, msg: str = "") -> None:
        with self._lock:
            self.done += 1
            self.last = msg

    def now(self, msg: str) -> None:
        """Name the item now running (not yet done)."""
        with self._lock:
            self.last = f"running {msg}"

    def line(self) -> str:
        """The current state in words."""
        with self._lock:
            done, last = self.done, self.last
        parts = [self.description]
        if self.total:
            parts.append(f"{done}/{self.total} ({100 * done // self.total}%)")
        if last:
            parts.append(last)
        parts.append(f"{time.monotonic() - self._start:.0f} s")
        return f"{parts[0]}: {', '.join(parts[1:])}"

    def _tick(self, stream: TextIO) -> None:
        while not self._stop.wait(self.interval):
            stream.write(self.line() + "\n")
            stream.flush()

    def __enter__(self) -> ProgressLines:
        self._start = time.monotonic()
        if self.interval > 0:
            stream = self.stream if self.stream is not None else sys.stderr  # the stream of the moment (tests swap it)
            self._thread = threading.Thread(target=self._tick, args=(stream,), name="progress-lines", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()  # no line after the phase: an error the phase raised is the last thing said
        if self._thread is not None:
            self._thread.join()
