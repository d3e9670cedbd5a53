"""The background writer: copies leave the device asynchronously; one thread does the disk I/O.

Training threads call `offload(tensor)` (a non-blocking copy into pinned host memory on CUDA, a
plain copy on the CPU) and `put_array` / `put_complete`. A single daemon thread takes items from a
bounded FIFO queue and writes them through `DumpWriter`. Because the queue is FIFO, a step's
`complete` flag is written after every array queued before it. When the queue is full, training
waits (no data is dropped) and a warning says that the disk cannot keep up.

Timeline rows (the monitor's, one per monitored step) are gathered in memory and appended
`timeline_rows` at a time (default 16). On a small machine, appending one row to zarr costs
about 29 ms of CPU, and appending 16 rows at once about 14 ms, because
`DumpWriter.append_timeline_rows` keeps the arrays open between appends. Buffered rows go to the queue when there are
`timeline_rows` of them, when a row arrives `timeline_seconds` (30) or more after the oldest buffered
one, on `flush_timeline()` (the session calls it when an alarm fires), and on `close()` (normal
exit, and exit by an exception). A process killed without running its exit code (SIGKILL, power
loss) loses the buffered rows: at most `timeline_rows` − 1 rows, and at most about
`timeline_seconds` of them. A store read during the run lags by as many rows.
"""
from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fa_forensics.capture.events import CaptureWarning
from fa_forensics.capture.selection import CaptureError


@dataclass
class _Array:
    step: int
    layer: int
    name: str
    tensor: torch.Tensor  # on the CPU (pinned when it came from CUDA)
    layer_attrs: Optional[dict]
    ready: Any = None  # a torch.cuda.Event to wait on before reading `tensor`, or None


@dataclass
class _Complete:
    step: int
    loss: Optional[float]
    attrs: dict = field(default_factory=dict)


@dataclass
class _TimelineRows:
    rows: list  # [(step, {name: scalar or numpy array (e.g. (L, H))})], oldest first


@dataclass
class _RunAttrs:
    attrs: dict


_STOP = object()


def offload(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Copy `tensor` to host memory without blocking the device; returns (host tensor, ready event or None)."""
    tensor = tensor.detach()
    if tensor.is_cuda:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
    return tensor.clone(memory_format=torch.contiguous_format), None


class BackgroundWriter:
    """Owns a `DumpWriter` and the thread that feeds it."""

    def __init__(self, dump_writer, max_queue: int = 64, timeline_rows: int = 16, timeline_seconds: float = 30.0):
        if int(timeline_rows) < 1:
            raise CaptureError(f"timeline_rows must be >= 1 (rows appended at a time), got {timeline_rows}")
        self._dump = dump_writer
        self.timeline_rows = int(timeline_rows)
        self.timeline_seconds = float(timeline_seconds)
        self._rows: list = []  # timeline rows not yet queued: [(step, series)]
        self._rows_since = 0.0  # time.monotonic() of the oldest buffered row
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._error: Optional[BaseException] = None
        self._warned_slow = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="fa-forensics-capture-writer", daemon=True)
        self._thread.start()

    # -- training side -------------------------------------------------------------------
    def put_array(self, step: int, layer: int, name: str, tensor: torch.Tensor, ready=None,
                  layer_attrs: Optional[dict] = None) -> None:
        self._put(_Array(step, layer, name, tensor, layer_attrs, ready))

    def put_complete(self, step: int, loss: Optional[float] = None, **attrs) -> None:
        self._put(_Complete(step, loss, attrs))

    def put_run_attrs(self, attrs: dict) -> None:
        """Merge attrs into the store's run description (see DumpWriter.update_run_attrs)."""
        self._put(_RunAttrs(dict(attrs)))

    def put_timeline(self, step: int, **series) -> None:
        """Add one monitor row (the step's scalars and (L, H) arrays) to the store's timeline/ (buffered, see above)."""
        now = time.monotonic()
        if not self._rows:
            self._rows_since = now
        self._rows.append((step, series))
        if len(self._rows) >= self.timeline_rows or now - self._rows_since >= self.timeline_seconds:
            self.flush_timeline()

    def flush_timeline(self) -> None:
        """Queue the buffered timeline rows for the writer thread now."""
        rows, self._rows = self._rows, []
        if rows:
            self._put(_TimelineRows(rows))

    def register_step(self, step: int) -> None:
        """Put the step in the store now, as incomplete (a synchronous metadata write, once per
        recorded step): if the process is killed while its arrays still wait in the queue, the
        store lists the step as incomplete instead of losing it silently."""
        self._raise_if_failed()
        try:
            self._dump.register_step(step)
        except OSError as exc:
            raise CaptureError(f"cannot write step {step} into {self._dump.path}: {exc.strerror or exc}; free space or "
                               "capture into a writable store") from None

    def set_model(self, model_attrs: dict) -> None:
        """The model's identity, once known: refused (DumpError) if the store holds another model's steps."""
        self._dump.set_model(model_attrs)

    def close(self, failed: bool = False) -> None:
        """Write everything queued (buffered timeline rows too), stop the thread, close the store; re-raise a writer
        failure.

        failed: the run died; the dump an overwriting capture replaced is kept (see DumpWriter.close)."""
        if self._closed:
            return
        rows, self._rows = self._rows, []
        if rows and self._error is None:
            self._queue.put(_TimelineRows(rows))  # waits for room; never dropped
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        try:
            self._dump.close(failed=failed or self._error is not None)
            replaced = getattr(self._dump, "replaced", None)
            if replaced is not None:
                warnings.warn(CaptureWarning("fa-forensics capture: the run failed; the dump this capture replaced is "
                                             f"kept at {replaced}"), stacklevel=2)
        finally:
            self._raise_if_failed()

    def drain(self) -> None:
        """Wait until every item queued so far is written (buffered timeline rows are not queued yet)."""
        self._queue.join()
        self._raise_if_failed()

    # -- internals -----------------------------------------------------------------------
    def _put(self, item) -> None:
        self._raise_if_failed()
        if self._closed:
            raise CaptureError("capture session is closed; record inside the `with fa_forensics.capture(...)` block")
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            if not self._warned_slow:
                self._warned_slow = True
                message = (
                    f"fa-forensics capture: the disk cannot keep up ({self._queue.maxsize} arrays waiting); "
                    "training waits for the writer. Capture fewer steps, layers or heads, or a smaller batch slice."
                )
                warnings.warn(CaptureWarning(message), stacklevel=3)
            self._queue.put(item)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CaptureError) or type(error).__name__ == "DumpError":
                raise error
            raise CaptureError(f"capture writer failed: {type(error).__name__}: {error}; the steps completed before it "
                               "are intact") from error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._write(item)
            finally:
                self._queue.task_done()

    def _write(self, item) -> None:
        if self._error is None:  # after a failure, drain without writing: a failed store is never half-written further
            try:
                if isinstance(item, _Array):
                    if item.ready is not None:
                        item.ready.synchronize()
                    self._dump.write_array(item.step, item.layer, item.name, item.tensor, layer_attrs=item.layer_attrs)
                elif isinstance(item, _TimelineRows):
                    self._dump.append_timeline_rows(item.rows)
                elif isinstance(item, _RunAttrs):
                    self._dump.update_run_attrs(item.attrs)
                else:
                    self._dump.complete_step(item.step, loss=item.loss, **item.attrs)
            except BaseException as exc:  # reported to the training thread at its next call
                self._error = exc
