"""What runs in each process the capture launcher trains in: its session, the model binder, its report.

`build_session` makes the session of the settings in FA_FORENSICS_CAPTURE (capture/launch.py lists
them); `auto_binder` binds the model at its first forward; `write_report` leaves the process's report
(rank_<r>.json) for the command. `run_spawned_rank` runs a rank the training script spawned
(capture/spawned.py) under a session of its own: this module is importable by name in the spawned
process, which the launcher (run as __main__) is not.
"""
from __future__ import annotations

import json
import os
import sys

ENV_VAR = "FA_FORENSICS_CAPTURE"


def settings_from_env() -> dict:
    from fa_forensics.capture.selection import CaptureError

    text = os.environ.get(ENV_VAR)
    if not text:
        raise CaptureError(f"{ENV_VAR} is not set; start training through `fa-forensics capture --out ... --steps ... "
                           "-- python train.py`")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CaptureError(f"{ENV_VAR} is not valid JSON ({exc}); "
                           "start training through `fa-forensics capture`") from None


def auto_binder(session):
    """Bind the first module containing attention modules: a global forward pre-hook that binds it at its
    first forward and then removes itself, and a wrapper of torch.compile that binds a compiled module at
    once (the global hook is removed before torch.compile(module) runs: a global hook alive there would
    fire twice per call, and torch warns about it). `.remove()` undoes both."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    from fa_forensics.capture.modules import find_attention_modules

    seen: set[int] = set()
    state = {"handle": None}
    original_compile = torch.compile

    def hook(module, args):
        if session._root is not None or id(module) in seen:
            return None
        seen.add(id(module))
        if find_attention_modules(module, session.pattern):
            session.bind(module)
            state["handle"].remove()
            session._on_root_forward(module, args)  # the root's own hook was added during this very call
        return None

    def compile_and_bind(model=None, *args, **kwargs):
        if not isinstance(model, torch.nn.Module) or session._root is not None:
            return original_compile(model, *args, **kwargs)
        state["handle"].remove()
        compiled = original_compile(model, *args, **kwargs)
        if find_attention_modules(compiled, session.pattern):
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


def build_session(cfg: dict, command: list[str], process_rank=None):
    """The capture session the settings `cfg` describe (its store not yet opened)."""
    from fa_forensics.capture.modules import DEFAULT_ATTENTION_PATTERN
    from fa_forensics.capture.session import CaptureSession
    from fa_forensics.monitor.alarm import rule_from_settings

    return CaptureSession(
        None, cfg["out"], cfg["steps"], cfg.get("layers"), cfg.get("heads"), cfg.get("batch"),
        int(cfg.get("micro_batch", 0)),
        cfg.get("attention_modules") or DEFAULT_ATTENTION_PATTERN,
        overwrite=bool(cfg.get("overwrite", False)), allow_other_model=bool(cfg.get("allow_other_model", False)),
        keep_sdpa_patch=True,
        monitor_every=cfg.get("monitor_every"), alarm=rule_from_settings(cfg.get("alarm")) or False,
        alarm_steps=int(cfg.get("alarm_steps", 3)), ring=int(cfg.get("ring", 0)),
        monitor_tensorboard=cfg.get("monitor_tensorboard"),
        run_attrs={"capture": {"command": cfg.get("command") or command}},
        attention=cfg.get("attention") or (), softmax=cfg.get("softmax"),
        process_rank=process_rank, run_id=cfg.get("run_id"),
    )


def rank_prefix(session) -> str:
    """"rank R: " in front of the lines of a multi-rank run, "" for one process."""
    return f"rank {session.rank}: " if session.world_size > 1 else ""


def write_report(folder, session, said: list[str]) -> None:
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


def run_spawned_rank(fn, index: int, nprocs: int, args: tuple):
    """`fn(index, *args)` in a process the script spawned, under a capture session of its own (rank = index)."""
    from fa_forensics.capture import sdpa
    from fa_forensics.capture.events import show_capture_warnings_as_lines
    from fa_forensics.capture.spawned import point_bindings_at
    from fa_forensics.errors import UserError

    cfg = settings_from_env()
    session = build_session(cfg, list(sys.argv), process_rank=(int(index), int(nprocs)))
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
        write_report(cfg.get("report"), session, said)
        if failed and sys.exc_info()[0] is None:
            raise SystemExit(2)


