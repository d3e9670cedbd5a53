"""What runs in each process the capture launcher trains in: its session, the model binder, its report.

`build_session` makes the session of the `LaunchOrder` in FA_FORENSICS_CAPTURE (the capture's settings,
the training command, the report folder); `auto_binder` binds the model at its first forward;
`write_report` leaves the process's report (rank_<r>.json) for the command. `run_spawned_rank` runs a
rank the training script spawned (capture/spawned.py) under a session of its own: this module is importable
by name in the spawned process, which the launcher (run as __main__) is not.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

from fa_forensics.capture.settings import CaptureSettings

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from fa_forensics.capture.session import CaptureSession

ENV_VAR = "FA_FORENSICS_CAPTURE"


class Removable(Protocol):
    """What `auto_binder` returns: `remove()` undoes what it installed."""

    def remove(self) -> None: ...


@dataclass(frozen=True)
class LaunchOrder:
    """What `fa-forensics capture` hands each capturing process through ENV_VAR: the capture's settings, the
    training command (recorded in the store) and the folder each process writes its report into."""

    settings: CaptureSettings
    command: tuple[str, ...] = ()
    report: Optional[str] = None

    def to_json(self) -> str:
        return json.dumps({"settings": self.settings.to_dict(), "command": list(self.command), "report": self.report})

    @classmethod
    def from_json(cls, text: str) -> LaunchOrder:
        """The order in `text`; CaptureError (one line) for text that is not one."""
        from fa_forensics.capture.selection import CaptureError

        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CaptureError(f"{ENV_VAR} is not valid JSON ({exc}); "
                               "start training through `fa-forensics capture`") from None
        if not isinstance(values, dict) or set(values) - {"settings", "command", "report"}:
            raise CaptureError(f"{ENV_VAR} is not a capture order ({{\"settings\", \"command\", \"report\"}}); "
                               "start training through `fa-forensics capture`")
        return cls(CaptureSettings.from_dict(values.get("settings") or {}), tuple(values.get("command") or ()),
                   values.get("report"))


def order_from_env() -> LaunchOrder:
    from fa_forensics.capture.selection import CaptureError

    text = os.environ.get(ENV_VAR)
    if not text:
        raise CaptureError(f"{ENV_VAR} is not set; start training through `fa-forensics capture --out ... --steps ... "
                           "-- python train.py`")
    return LaunchOrder.from_json(text)


def auto_binder(session: CaptureSession) -> Removable:
    """Bind the first module containing attention modules: a global forward pre-hook that binds it at its
    first forward and then removes itself, and a wrapper of torch.compile that binds a compiled module at
    once (the global hook is removed before torch.compile(module) runs: a global hook alive there would
    fire twice per call, and torch warns about it). `.remove()` undoes both."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    from fa_forensics.capture.modules import find_attention_modules

    seen: set[int] = set()
    state: dict[str, RemovableHandle] = {}  # "handle": the global hook, registered below
    original_compile = torch.compile

    def hook(module: torch.nn.Module, args: tuple) -> None:
        if session._root is not None or id(module) in seen:
            return None
        seen.add(id(module))
        if find_attention_modules(module, session.pattern):
            session.bind(module)
            state["handle"].remove()
            session._on_root_forward(module, args)  # the root's own hook was added during this very call
        return None

    def compile_and_bind(model: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(model, torch.nn.Module) or session._root is not None:
            return original_compile(model, *args, **kwargs)
        state["handle"].remove()
        compiled = original_compile(model, *args, **kwargs)
        if isinstance(compiled, torch.nn.Module) and find_attention_modules(compiled, session.pattern):
            session.bind(compiled)
        else:
            state["handle"] = register_module_forward_pre_hook(hook)
        return compiled

    class Binder:
        @staticmethod
        def remove() -> None:
            state["handle"].remove()
            if torch.compile is compile_and_bind:
                torch.compile = original_compile

    state["handle"] = register_module_forward_pre_hook(hook)
    torch.compile = compile_and_bind
    return Binder()


def build_session(order: LaunchOrder, command: list[str],
                  process_rank: Optional[tuple[int, int]] = None) -> CaptureSession:
    """The capture session the order describes (its store not yet opened); `command` is recorded when the order
    names none."""
    from fa_forensics.capture.session import CaptureSession

    return CaptureSession(None, order.settings.replace(keep_sdpa_patch=True),
                          run_attrs={"capture": {"command": list(order.command) or command}},
                          process_rank=process_rank)


def rank_prefix(session: CaptureSession) -> str:
    """"rank R: " in front of the lines of a multi-rank run, "" for one process."""
    return f"rank {session.rank}: " if session.world_size > 1 else ""


def write_report(folder: Optional[str], session: CaptureSession, said: list[str]) -> None:
    """What the command cannot read from the store: how far this rank's run got and what was said."""
    if not folder:
        return
    report = {"rank": int(session.rank), "world_size": int(session.world_size),
              "steps_run": int(session.current_step), "steps_without_attention": list(session.steps_without_attention),
              "attention_calls_seen": int(session.attention_calls_seen), "warnings": said}
    try:
        with open(os.path.join(folder, f"rank_{int(session.rank)}.json"), "w") as fh:
            json.dump(report, fh)
    except OSError:
        pass


def run_spawned_rank(fn: Callable[..., Any], index: int, nprocs: int, args: tuple) -> Any:
    """`fn(index, *args)` in a process the script spawned, under a capture session of its own (rank = index)."""
    from fa_forensics.capture import sdpa
    from fa_forensics.capture.events import show_capture_warnings_as_lines
    from fa_forensics.capture.spawned import point_bindings_at
    from fa_forensics.errors import UserError

    order = order_from_env()
    session = build_session(order, list(sys.argv), process_rank=(int(index), int(nprocs)))
    try:
        session.start()
    except UserError as exc:
        print(f"error: rank {index}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    point_bindings_at(sdpa.original_sdpa(), sdpa.patched_sdpa)  # the script was imported before the patch
    said: list[str] = []
    show_capture_warnings_as_lines(said, prefix=rank_prefix(session))
    binder = auto_binder(session)
    failed = True
    try:
        result = fn(index, *args)
        failed = False
        return result
    finally:
        binder.remove()
        try:
            session.stop(failed=failed)
        except UserError as exc:
            print(f"error: rank {index}: {exc}", file=sys.stderr)
            failed = True
        write_report(order.report, session, said)
        if failed and sys.exc_info()[0] is None:
            raise SystemExit(2)


