"""Capture in the ranks a training script starts itself with torch.multiprocessing (`mp.spawn`).

Under `fa-forensics capture -- python train.py`, a script that calls `mp.spawn(fn, nprocs=N)` trains in
N child processes, which the hooks of the launcher's own process do not reach. While the script runs,
the launcher wraps torch.multiprocessing's `start_processes` (what `spawn` calls): at the call the
launcher process hands capture over (`hand_over()`: its session stops, a store it created and did not
write is removed again), and each child runs `fn` through `SpawnedRank`, under a session of its own
whose rank is its process index and whose world size is nprocs (the launcher's `run_spawned_rank`).
A child imports the script before its session starts, so names the script bound to SDPA on import
(`from torch.nn.functional import scaled_dot_product_attention`) are pointed at the patched function
(`point_bindings_at`). When `hand_over()` declines (the launcher process trained already), the
children run unwrapped.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpawnedRank:
    """`fn(index, *args)` in a spawned child, run by `runner(fn, index, nprocs, args)`. Picklable when fn is (as
    multiprocessing needs it): both are pickled by reference."""

    fn: Callable
    nprocs: int
    runner: Callable

    def __call__(self, index: int, *args: Any) -> Any:
        return self.runner(self.fn, index, self.nprocs, args)


def _patched_module(name: str) -> Any:
    """The module `name`, imported if need be, as a namespace whose `start_processes` is replaced (typed loosely:
    torch.multiprocessing's stubs do not export it)."""
    return importlib.import_module(name)


class SpawnPatch:
    """Wraps torch.multiprocessing's start_processes (and so spawn) while installed; `remove()` restores it."""

    def __init__(self, hand_over: Callable[[], bool], runner: Callable) -> None:
        self._spawn_module = _patched_module("torch.multiprocessing.spawn")
        self._package = _patched_module("torch.multiprocessing")
        self._original: Callable[..., Any] = self._spawn_module.start_processes
        self._hand_over, self._runner = hand_over, runner

        def start_processes(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
                            start_method: str = "spawn") -> Any:
            if self._hand_over():
                fn = SpawnedRank(fn, int(nprocs), self._runner)
            return self._original(fn, args, nprocs, join, daemon, start_method)

        self._wrapper = start_processes
        self._spawn_module.start_processes = start_processes
        self._package.start_processes = start_processes

    def remove(self) -> None:
        if self._spawn_module.start_processes is self._wrapper:
            self._spawn_module.start_processes = self._original
        if self._package.start_processes is self._wrapper:
            self._package.start_processes = self._original


def point_bindings_at(original: object, replacement: object) -> list[str]:
    """Point every module-level name bound to `original` at `replacement`, in the modules of the program (not
    torch's or fa-forensics' own); returns the names changed ("module.name")."""
    changed = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] in ("torch", "fa_forensics"):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                namespace[name] = replacement
                changed.append(f"{module_name}.{name}")
    return changed
