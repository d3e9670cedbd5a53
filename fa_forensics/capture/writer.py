"""The background writer: copies leave the device asynchronously; one thread does the disk I/O, paced.

Training threads call `offload(tensor)` (a non-blocking copy into pinned host memory on CUDA, a
plain copy on the CPU) and `put_array` / `put_complete` / `put_held_step`. A single daemon thread
takes items from one FIFO and writes them through `DumpWriter`. Because the FIFO keeps order, a
step's `complete` flag is written after every array queued before it.

What waits is bounded two ways:
- arrays of selected steps (`put_array`): at most `max_queue` wait; past that training waits for the
  writer (nothing of a step the user asked for is dropped) and a warning says the disk cannot keep up;
- held steps (`put_held_step`: the ring's steps and those recorded after an alarm, whole in host
  memory already): admitted whole while the bytes held for them stay within `held_bytes`, else dropped
  whole and the caller says which step was dropped. An alarm never makes training wait for the disk.

Pacing: the writer's work (zarr's Python code, compression) competes with training for the CPU and
the GIL; writing at full speed right after a recorded step made the following steps of a small CPU
run about 2x slower. The thread writes one item (an array, or a slice of a large one: `DumpWriter`
writes an array in one call, so an item is the unit) and then rests `spent · (1 − duty) / duty`, so it
is busy at most a `duty` share of the time (default 0.1) while what waits is below half of its bounds;
past that, on `drain()` and on `close()`, it writes at full speed.

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

import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from fa_forensics.capture.events import CaptureWarning
from fa_forensics.capture.selection import CaptureError

if TYPE_CHECKING:
    from fa_forensics.capture.ring import RingArray
    from fa_forensics.dump import DumpWriter


@dataclass
class _Array:
    step: int
    layer: int
    name: str
    tensor: torch.Tensor  # on the CPU (pinned when it came from CUDA)
    layer_attrs: Optional[dict]
    ready: Any = None  # a torch.cuda.Event to wait on before reading `tensor`, or None
    held: int = 0  # bytes, for an array of a held step (0: an array of a selected step)


@dataclass
class _Register:
    step: int  # a held step: put in the store as incomplete before its arrays


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


class _Stop:
    """The writer thread ends."""


_STOP = _Stop()
_Item = Union[_Array, _Register, _Complete, _TimelineRows, _RunAttrs]


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

    def __init__(self, dump_writer: DumpWriter, max_queue: int = 64, timeline_rows: int = 16,
                 timeline_seconds: float = 30.0, held_bytes: int = 256 << 20, duty: float = 0.1) -> None:
        if int(timeline_rows) < 1:
            raise CaptureError(f"timeline_rows must be >= 1 (rows appended at a time), got {timeline_rows}")
        if not 0 < float(duty) <= 1:
            raise CaptureError(f"the writer's duty must be in (0, 1] (the share of time it may write), got {duty}")
        self._dump = dump_writer
        self.max_queue = int(max_queue)
        self.held_bytes = int(held_bytes)
        self.duty = float(duty)
        self.timeline_rows = int(timeline_rows)
        self.timeline_seconds = float(timeline_seconds)
        self._rows: list = []  # timeline rows not yet queued: [(step, series)]
        self._rows_since = 0.0  # time.monotonic() of the oldest buffered row
        self._items: deque[_Item | _Stop] = deque()
        self._cond = threading.Condition()
        self._waiting = 0  # arrays of selected steps queued, not yet written
        self._holding = 0  # bytes of held steps queued, not yet written
        self._unfinished = 0  # items queued, not yet written
        self._hurry = False  # drain() / close(): write at full speed
        self._error: Optional[BaseException] = None
        self._warned_slow = False
        self._closed = False
        self.seconds_writing = 0.0  # wall time the thread spent writing (benchmarks read it)
        self._first_item: Optional[float] = None  # time.perf_counter() when the first item was queued
        self._thread = threading.Thread(target=self._run, name="fa-forensics-capture-writer", daemon=True)
        self._thread.start()

    # -- training side -------------------------------------------------------------------
    def put_array(self, step: int, layer: int, name: str, tensor: torch.Tensor, ready: Any = None,
                  layer_attrs: Optional[dict] = None) -> None:
        """Queue one array of a selected step (waits while `max_queue` arrays wait: never dropped)."""
        self._check_open()
        with self._cond:
            if self._waiting >= self.max_queue:
                if not self._warned_slow:
                    self._warned_slow = True
                    warnings.warn(CaptureWarning(
                        f"fa-forensics capture: the disk cannot keep up ({self.max_queue} arrays waiting); training "
                        "waits for the writer. Capture fewer steps, layers or heads, or a smaller batch slice."),
                        stacklevel=2)
                while self._waiting >= self.max_queue and self._error is None:
                    self._cond.wait()
            self._enqueue(_Array(step, layer, name, tensor, layer_attrs, ready), waiting=1)
        self._raise_if_failed()

    def put_held_step(self, step: int, arrays: Sequence[RingArray], **complete_attrs: Any) -> bool:
        """Queue a whole step held in host memory (arrays: objects with layer, name, tensor, ready, layer_attrs)
        and its completion; False, queuing nothing, when its bytes do not fit in what `held_bytes` leaves."""
        self._check_open()
        nbytes = sum(a.tensor.numel() * a.tensor.element_size() for a in arrays)
        with self._cond:
            if self._holding + nbytes > self.held_bytes:
                return False
            self._enqueue(_Register(step))
            for a in arrays:
                self._enqueue(_Array(step, a.layer, a.name, a.tensor, a.layer_attrs, a.ready,
                                     held=a.tensor.numel() * a.tensor.element_size()))
            self._enqueue(_Complete(step, complete_attrs.pop("loss", None), complete_attrs))
        return True

    @property
    def held_waiting_bytes(self) -> int:
        """Bytes of held steps waiting to be written."""
        return self._holding

    def put_complete(self, step: int, loss: Optional[float] = None, **attrs: Any) -> None:
        self._put(_Complete(step, loss, attrs))

    def put_run_attrs(self, attrs: dict) -> None:
        """Merge attrs into the store's run description (see DumpWriter.update_run_attrs)."""
        self._put(_RunAttrs(dict(attrs)))

    def put_timeline(self, step: int, **series: Any) -> None:
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
            self._put(_TimelineRows(rows))  # never dropped
        self._closed = True
        if self._thread.is_alive():
            with self._cond:
                self._hurry = True
                self._enqueue(_STOP)
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
        with self._cond:
            self._hurry = True
            self._cond.notify_all()
            while self._unfinished:
                self._cond.wait()
            self._hurry = False
        self._raise_if_failed()

    # -- internals -----------------------------------------------------------------------
    def _check_open(self) -> None:
        self._raise_if_failed()
        if self._closed:
            raise CaptureError("capture session is closed; record inside the `with fa_forensics.capture(...)` block")

    def _put(self, item: _Item) -> None:
        self._check_open()
        with self._cond:
            self._enqueue(item)

    def seconds_open(self) -> float:
        """Seconds since the first item was queued (the time the writer had for its work)."""
        return 0.0 if self._first_item is None else time.perf_counter() - self._first_item

    def _enqueue(self, item: _Item | _Stop, waiting: int = 0) -> None:
        """Append under the lock."""
        if self._first_item is None:
            self._first_item = time.perf_counter()
        self._items.append(item)
        self._unfinished += 1
        self._waiting += waiting
        self._holding += getattr(item, "held", 0)
        self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CaptureError) or type(error).__name__ == "DumpError":
                raise error
            raise CaptureError(f"capture writer failed: {type(error).__name__}: {error}; the steps completed before it "
                               "are intact") from error

    def _pressed(self) -> bool:
        """Write at full speed: asked to, or what waits passed half of a bound."""
        return (self._hurry or self._waiting * 2 >= self.max_queue or self._holding * 2 >= self.held_bytes)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
            if isinstance(item, _Stop):
                with self._cond:
                    self._unfinished -= 1
                    self._cond.notify_all()
                return
            started = time.perf_counter()
            try:
                self._write(item)
            finally:
                spent = time.perf_counter() - started
                self.seconds_writing += spent
                with self._cond:
                    self._unfinished -= 1
                    if isinstance(item, _Array):
                        self._waiting -= 0 if item.held else 1
                        self._holding -= item.held
                    self._cond.notify_all()
            self._rest(spent)

    def _rest(self, spent: float) -> None:
        """Rest after writing, so that writing takes at most a `duty` share of the time (unless pressed)."""
        if self.duty >= 1:
            return
        deadline = time.perf_counter() + spent * (1 - self.duty) / self.duty
        with self._cond:
            while not self._pressed():
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _write(self, item: _Item) -> None:
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
                elif isinstance(item, _Register):
                    self._dump.register_step(item.step)
                else:
                    self._dump.complete_step(item.step, loss=item.loss, **item.attrs)
            except BaseException as exc:  # reported to the training thread at its next call
                self._error = exc
                with self._cond:
                    self._cond.notify_all()
