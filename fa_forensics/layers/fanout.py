"""Fan-out of an analysis over work items on dask.distributed, results back in a fixed order.

A work item is a (step, layer, head-group) of the dump (`work_items`); the partition into items
depends only on the selection and the head-group size, never on the number of workers, and
`map_in_order` returns the results in item order whatever order they finish in. An analysis that
reduces them in that order (and whose per-item numbers are exact per head, as replays are) gives
the same output for any number of workers.

- `Workers(n=1)`: in-process, one item after the other (no dask import, no extra processes);
- `Workers(n=N)`: a `dask.distributed.LocalCluster` of N single-threaded worker processes,
  started for the call and closed after it;
- `Workers(scheduler="tcp://host:8786")`: an existing Dask cluster. Its workers open the dump by
  its absolute path (zarr reads it on each worker), so the store must be on storage every worker
  sees (a shared file system), at the same path.

A cluster fails out loud: with no worker (none at the start, or all lost during the run) the call
ends after `Workers.wait` seconds with `NoWorkers`; a worker whose Python environment cannot import
fa-forensics (or has another version) is named in a `WorkerEnvironment` error before any work is
sent; a scheduler that stops answering is `ClusterUnreachable`. The local cluster binds no
dashboard (its scheduler's HTTP endpoint takes a free port on 127.0.0.1), and neither Dask's
warnings nor its log lines reach the command's output, so `--workers N` prints and writes what an
in-process run does.

Every work item is computed on one torch thread, in a worker process and in-process alike, so
its numbers do not depend on where it ran (N worker processes share N cores).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TypeVar

from fa_forensics.dump import open_dump
from fa_forensics.errors import ClusterUnreachable, DumpError, InvalidSetting, NoWorkers, WorkerEnvironment
from fa_forensics.layers.cluster_wait import WORKER_WAIT_SECONDS
from fa_forensics.layers.selection import load
from fa_forensics.optional import require

Item = TypeVar("Item")
Result = TypeVar("Result")

HEADS_PER_ITEM = 4  # heads per work item: the unit of fan-out and of an analysis' peak memory
POLL_SECONDS = 1.0  # how often a running fan-out with nothing finishing looks at the cluster's workers
WAKE_SECONDS = 0.02  # how often it looks for finished items
DASK_LOGGERS = ("distributed", "tornado", "bokeh")
DASK_MODULES = ("distributed", "dask", "tornado", "bokeh")


@dataclass(frozen=True)
class Workers:
    """Where work items run: n local processes (1 = in-process) or an existing cluster's address; `wait`: the seconds
    the cluster may have no worker before the run fails."""

    n: int = 1
    scheduler: Optional[str] = None
    wait: float = WORKER_WAIT_SECONDS

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidSetting("workers", f"{self.n!r} must be a positive integer (1 = no extra processes)")
        if self.scheduler is not None and not str(self.scheduler).strip():
            raise InvalidSetting("scheduler", "needs the address of a running Dask scheduler, e.g. tcp://10.0.0.5:8786")
        if self.scheduler is not None and self.n != 1:
            raise InvalidSetting("workers", f"{self.n} starts a local cluster of {self.n} processes and --scheduler "
                                            f"{self.scheduler} runs on an existing one; give one of the two")
        if isinstance(self.wait, bool) or not isinstance(self.wait, (int, float)) or not (
                math.isfinite(self.wait) and self.wait > 0):
            raise InvalidSetting("worker_wait", f"{self.wait!r} must be a positive number of seconds")
        if not self.in_process:  # said before any work, not after the replay that precedes the fan-out
            require("dask.distributed", "--workers N and --scheduler")

    @property
    def in_process(self) -> bool:
        return self.n == 1 and self.scheduler is None

    @property
    def where(self) -> str:
        """The cluster, for messages: its scheduler's address, or the local cluster."""
        if self.scheduler is not None:
            return f"the Dask scheduler {self.scheduler}"
        return f"a local cluster of {self.n} workers"


def work_items(selections: Sequence, heads_per_item: Optional[int] = None) -> list:
    """Each selection (step, layer, heads) cut into head groups of `heads_per_item` (default
    HEADS_PER_ITEM), in order."""
    from dataclasses import replace

    heads_per_item = heads_per_item or HEADS_PER_ITEM
    items = []
    for sel in selections:
        heads = list(sel.heads)
        for i in range(0, len(heads), heads_per_item):
            items.append(replace(sel, heads=heads[i:i + heads_per_item]))
    return items


MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's own dynamic maximum (64-bit)
TRIM_THRESHOLD_BYTES = 64 * 2**20


def _prepare_worker() -> None:
    """Run torch and numba on one thread in this (worker) process, and let glibc keep the freed memory of large
    temporaries: Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536, which turns off glibc's dynamic
    thresholds, so every temporary above 128 KiB is mapped and unmapped again (a work item of the emulator ran
    2.5x slower so). Thresholds of 32 MiB (mmap) and 64 MiB (trim) give back glibc's usual speed."""
    import ctypes
    import ctypes.util

    import torch

    torch.set_num_threads(1)
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, TRIM_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD
    except OSError:  # not glibc: nothing to set
        pass


@contextlib.contextmanager
def one_torch_thread():
    """Compute on one torch (and so numba) thread, then restore: torch splits some reductions over
    its threads, so a work item's numbers are the same in a worker and in-process only if both run
    it on one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def map_in_order(fn: Callable[[Item], Result], items: Sequence[Item], workers: Workers = Workers(),
                 progress: Optional[Callable[[str], None]] = None, label: Callable[[Item], str] = str) -> list[Result]:
    """[fn(item) for item in items], run where `workers` says; results in item order.

    `progress(label(item))` is called as each item finishes. An exception raised by fn on a worker
    is raised here (the first one to finish), with its own type; one that says the worker cannot
    import what fn needs is a `WorkerEnvironment` error. A cluster without workers for `workers.wait`
    seconds ends the call (`NoWorkers`).
    """
    items = list(items)
    if workers.in_process:
        out = []
        for item in items:
            out.append(fn(item))
            if progress:
                progress(label(item))
        return out
    distributed = require("dask.distributed", "--workers N and --scheduler")

    with connected(workers) as client, quiet_dask():
        futures = [client.submit(fn, item, pure=False) for item in items]
        position = {f.key: i for i, f in enumerate(futures)}
        results: list = [None] * len(items)
        finished = distributed.as_completed(futures)
        watch = WorkerWatch(client, workers)
        left, idle_since = len(futures), time.monotonic()
        try:
            while left:
                batch = finished.next_batch(block=False)
                if not batch:
                    time.sleep(WAKE_SECONDS)
                    if time.monotonic() - idle_since >= POLL_SECONDS:
                        watch.check()
                        idle_since = time.monotonic()
                    continue
                for future in sorted(batch, key=lambda f: position[f.key]):
                    i = position[future.key]
                    results[i] = _result(future, workers)
                    left -= 1
                    if progress:
                        progress(label(items[i]))
                watch.since, idle_since = None, time.monotonic()  # an item finished: the cluster has a worker
        finally:
            for future in futures:
                if not future.done():
                    future.cancel()
        return results


def _result(future, workers: Workers):
    """The result of a finished future; the errors the cluster caused worded as such."""
    from concurrent.futures import CancelledError

    try:
        return future.result()
    except ImportError as exc:  # the task could not be unpickled: a worker that joined without fa-forensics
        raise WorkerEnvironment(workers.where, "a worker", f"{type(exc).__name__}: {exc}") from None
    except CancelledError:
        raise ClusterUnreachable(workers.where, "it cancelled the work (the scheduler was lost or restarted); run "
                                                "again once it is back") from None


class WorkerWatch:
    """Ends a fan-out whose cluster has had no worker for `workers.wait` seconds, or whose scheduler stopped
    answering for as long."""

    def __init__(self, client, workers: Workers):
        self.client, self.workers = client, workers
        self.since: Optional[float] = None  # since when the cluster has had no worker (or not answered)

    def check(self) -> None:
        try:
            n = len(self.client.nthreads())
            answered = True
        except Exception:  # the scheduler does not answer: lost, or restarting
            n, answered = 0, False
        if n:
            self.since = None
            return
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since < self.workers.wait:
            return
        if not answered:
            raise ClusterUnreachable(self.workers.where, f"it stopped answering during the run and did not answer "
                                                         f"for {self.workers.wait:g} s")
        raise NoWorkers(self.workers.where, self.workers.wait, lost=True, scheduler=self.workers.scheduler)


_SHARED: dict = {}  # Workers -> the client of an open `connected` block


@contextlib.contextmanager
def quiet_dask():
    """Dask's log lines and Python warnings (dashboard ports, versions, reconnects) kept out of the command's output
    while a cluster is used: every line a command prints is one it also writes in its JSON."""
    loggers = [logging.getLogger(name) for name in DASK_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            for module in DASK_MODULES:
                warnings.filterwarnings("ignore", module=module + r"(\.|$)")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def connected(workers: Workers):
    """A dask client for `workers` (its workers checked and prepared: `_prepare_worker`), closed with its cluster at the
    end.
    Nested blocks and the `map_in_order` calls inside one share the outer client: a report starts
    one cluster for all its analyses."""
    if workers in _SHARED:
        yield _SHARED[workers]
        return
    distributed = require("dask.distributed", "--workers N and --scheduler")
    Client, LocalCluster = distributed.Client, distributed.LocalCluster

    cluster = None
    with quiet_dask():
        try:
            if workers.scheduler is not None:
                client = Client(workers.scheduler, timeout="5s")
            else:  # no dashboard: the scheduler's HTTP endpoint on a free local port, never 8787
                cluster = LocalCluster(n_workers=workers.n, threads_per_worker=1, processes=True,
                                       dashboard_address=None, silence_logs=logging.CRITICAL,
                                       scheduler_kwargs={"dashboard": False, "dashboard_address": "127.0.0.1:0"})
                client = Client(cluster)
        except (OSError, TimeoutError, ValueError) as exc:  # ValueError: an address dask cannot parse
            where = workers.scheduler or f"a local cluster of {workers.n} workers"
            raise ClusterUnreachable(where, str(exc)) from None
        try:
            _check_workers(client, workers)
            client.run(_prepare_worker)
        except BaseException:
            _close(client, cluster)
            raise
    _SHARED[workers] = client
    try:
        yield client
    finally:
        del _SHARED[workers]
        with quiet_dask():
            _close(client, cluster)


def _close(client, cluster) -> None:
    client.close()
    if cluster is not None:
        cluster.close()


def _check_workers(client, workers: Workers) -> None:
    """Wait (up to `workers.wait` s) for a worker; then every worker must import this version of fa-forensics."""
    distributed = require("dask.distributed", "--workers N and --scheduler")
    try:
        client.wait_for_workers(1, timeout=workers.wait)
    except (TimeoutError, distributed.TimeoutError):
        raise NoWorkers(workers.where, workers.wait, lost=False, scheduler=workers.scheduler) from None
    from fa_forensics import __version__

    for address, found in sorted(client.run(_environment_probe()).items()):
        if "error" in found:
            raise WorkerEnvironment(workers.where, f"worker {address}", found["error"], found.get("python"))
        if found["version"] != __version__:
            raise WorkerEnvironment(workers.where, f"worker {address}",
                                    f"its fa-forensics is {found['version']}, this one is {__version__}",
                                    found.get("python"))


def _environment_probe() -> Callable[[], dict]:
    """A function sent to the workers by value (a nested function: it needs no fa-forensics there) that imports what
    a work item needs: {"version", "python"}, or {"error", "python"} where that fails."""
    def probe() -> dict:
        import importlib
        import sys

        try:
            importlib.import_module("fa_forensics.layers.fanout")
            version = importlib.import_module("fa_forensics").__version__
        except ImportError as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "python": sys.executable}
        return {"version": version, "python": sys.executable}

    return probe


@dataclass(frozen=True)
class LayerTask:
    """`fn(load(dump, item), *args)` for one work item, on one torch thread. Picklable: in a worker
    it opens the dump by its absolute path (`dump` is given only in-process)."""

    fn: Callable
    args: tuple = ()
    dump: object = None
    dump_path: Optional[str] = None
    rank: Optional[int] = None

    def __call__(self, sel):
        dump = self.dump if self.dump is not None else self._open_on_worker()
        with one_torch_thread():
            return self.fn(load(dump, sel), *self.args)

    def _open_on_worker(self):
        if not Path(self.dump_path).exists():
            from distributed import get_worker

            raise DumpError(f"worker {get_worker().address} sees no dump at {self.dump_path}: the store must be on "
                            "storage every worker of the cluster sees (a shared file system), at the same path")
        return open_dump(self.dump_path, rank=self.rank)


def map_layers(fn: Callable, dump, selections: Sequence, workers: Workers = Workers(), progress=None, *,
               args: tuple = (), heads_per_item: Optional[int] = None, whole_layers: bool = False) -> list:
    """[fn(layer tensors of item, *args) for item in work_items(selections)], where `workers` says, in
    item order. `whole_layers`: one item per layer-step (for analyses that pool across heads). A worker
    opens the dump by its absolute path, resolved here: workers run in folders of their own."""
    if whole_layers:
        items = list(selections)
    else:
        items = work_items(selections, heads_per_item)
    if workers.in_process:
        task = LayerTask(fn, tuple(args), dump=dump)
    else:
        task = LayerTask(fn, tuple(args), dump_path=str(Path(dump.path).resolve()), rank=getattr(dump, "rank", None))
    return map_in_order(task, items, workers, progress, label=lambda sel: f"step {sel.step} layer {sel.layer}")


def layer_parts(fn: Callable, layers, args: tuple = (), progress=None) -> list:
    """[fn(t, *args) for t in layers] for layer-steps already loaded (or built in memory), in-process."""
    parts = []
    for t in layers:
        parts.append(fn(t, *args))
        if progress:
            progress(f"step {t.step} layer {t.layer}")
    return parts


def n_items(selections: Sequence, *, whole_layers: bool = False) -> int:
    """How many work items `map_layers` makes of `selections` (a progress bar's total)."""
    return len(selections) if whole_layers else len(work_items(selections))
