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
  its path (zarr reads it on each worker), so the store must be on storage every worker sees
  (a shared file system or an object-store URL that zarr opens).

Every work item is computed on one torch thread, in a worker process and in-process alike, so
its numbers do not depend on where it ran (N worker processes share N cores).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, TypeVar

from fa_forensics.dump import open_dump
from fa_forensics.errors import ClusterUnreachable, InvalidSetting
from fa_forensics.layers.selection import load
from fa_forensics.optional import require

Item = TypeVar("Item")
Result = TypeVar("Result")

HEADS_PER_ITEM = 4  # heads per work item: the unit of fan-out and of an analysis' peak memory


@dataclass(frozen=True)
class Workers:
    """Where work items run: n local processes (1 = in-process) or an existing cluster's address."""

    n: int = 1
    scheduler: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidSetting("workers", f"{self.n!r} must be a positive integer (1 = no extra processes)")
        if self.scheduler is not None and not str(self.scheduler).strip():
            raise InvalidSetting("scheduler", "needs the address of a running Dask scheduler, e.g. tcp://10.0.0.5:8786")

    @property
    def in_process(self) -> bool:
        return self.n == 1 and self.scheduler is None


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


def _single_threaded() -> None:
    """Run torch and numba on one thread in this (worker) process."""
    import torch

    torch.set_num_threads(1)


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
    is raised here (the first one to finish), with its own type.
    """
    items = list(items)
    if workers.in_process:
        out = []
        for item in items:
            out.append(fn(item))
            if progress:
                progress(label(item))
        return out
    as_completed = require("dask.distributed", "--workers N and --scheduler").as_completed

    with connected(workers) as client:
        futures = [client.submit(fn, item, pure=False) for item in items]
        position = {f.key: i for i, f in enumerate(futures)}
        results: list = [None] * len(items)
        for future in as_completed(futures):
            i = position[future.key]
            results[i] = future.result()
            if progress:
                progress(label(items[i]))
        return results


_SHARED: dict = {}  # Workers -> the client of an open `connected` block


@contextlib.contextmanager
def connected(workers: Workers):
    """A dask client for `workers` (its workers on one torch thread), closed with its cluster at the end.
    Nested blocks and the `map_in_order` calls inside one share the outer client: a report starts
    one cluster for all its analyses."""
    if workers in _SHARED:
        yield _SHARED[workers]
        return
    distributed = require("dask.distributed", "--workers N and --scheduler")
    Client, LocalCluster = distributed.Client, distributed.LocalCluster

    cluster = None
    try:
        if workers.scheduler is not None:
            client = Client(workers.scheduler, timeout="5s")
        else:
            cluster = LocalCluster(n_workers=workers.n, threads_per_worker=1, processes=True, dashboard_address=None,
                                   silence_logs=logging.ERROR)
            client = Client(cluster)
    except (OSError, TimeoutError, ValueError) as exc:  # ValueError: an address dask cannot parse
        where = workers.scheduler or f"a local cluster of {workers.n} workers"
        raise ClusterUnreachable(where, str(exc)) from None
    _SHARED[workers] = client
    try:
        client.run(_single_threaded)
        yield client
    finally:
        del _SHARED[workers]
        client.close()
        if cluster is not None:
            cluster.close()


@dataclass(frozen=True)
class LayerTask:
    """`fn(load(dump, item), *args)` for one work item, on one torch thread. Picklable: in a worker
    it opens the dump by its path (`dump` is given only in-process)."""

    fn: Callable
    args: tuple = ()
    dump: object = None
    dump_path: Optional[str] = None
    rank: Optional[int] = None

    def __call__(self, sel):
        dump = self.dump if self.dump is not None else open_dump(self.dump_path, rank=self.rank)
        with one_torch_thread():
            return self.fn(load(dump, sel), *self.args)


def map_layers(fn: Callable, dump, selections: Sequence, workers: Workers = Workers(), progress=None, *,
               args: tuple = (), heads_per_item: Optional[int] = None, whole_layers: bool = False) -> list:
    """[fn(layer tensors of item, *args) for item in work_items(selections)], where `workers` says, in
    item order. `whole_layers`: one item per layer-step (for analyses that pool across heads)."""
    if whole_layers:
        items = list(selections)
    else:
        items = work_items(selections, heads_per_item)
    if workers.in_process:
        task = LayerTask(fn, tuple(args), dump=dump)
    else:
        task = LayerTask(fn, tuple(args), dump_path=str(dump.path), rank=getattr(dump, "rank", None))
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
