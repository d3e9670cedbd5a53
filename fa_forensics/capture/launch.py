"""Run an unmodified training script with capture active: `python -m fa_forensics.capture.launch SCRIPT ARGS...`.

Settings come as JSON in the environment variable FA_FORENSICS_CAPTURE (written by
`fa-forensics capture`): {"settings": CaptureSettings.to_dict() (capture/settings.py), "command", "report"}
(capture/launched.py's LaunchOrder). At exit each capturing process writes
{"rank", "world_size", "steps_run", "steps_without_attention", "attention_calls_seen", "warnings"} as JSON to
`rank_<r>.json` in the folder "report" names (when given), for the command.

Ranks: under a distributed launcher (torchrun, torch.distributed.run / launch) every rank process runs
this launcher (capture/command_line.py puts it there); the rank and world size come from the
launcher's environment (RANK, WORLD_SIZE), "run_id" orders the ranks' opening of the store (rank 0
first, dump/ranks.py), and a `--local-rank=N` that torch.distributed.launch puts before the script
goes back to the script. A script that spawns its ranks (torch.multiprocessing.spawn) hands capture
over to them (capture/spawned.py). Capture warnings of a multi-rank run name their rank.
Before the script runs, the launcher
- patches torch.nn.functional.scaled_dot_product_attention (so `from torch.nn.functional import
  scaled_dot_product_attention` in the script also gets the patched function),
- counts steps through a global optimizer.step() post-hook,
- installs a global module forward pre-hook that binds the first module whose tree contains
  attention modules (by the name pattern) as the model, then removes itself; torch.compile(module)
  binds the compiled module at once instead (no global hook is alive when the script compiles),
- patches the attention entry points it watches (capture/adapters.py, --attention) on import.
Then the script runs as __main__ with its own argv (`--module NAME` runs a module like `python -m`).
"""
from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

from fa_forensics.capture.launched import (
    Removable, auto_binder, build_session, order_from_env, rank_prefix, run_spawned_rank, write_report,
)

if TYPE_CHECKING:
    from fa_forensics.capture.session import CaptureSession

LOCAL_RANK_ARGUMENTS = ("--local-rank=", "--local_rank=")


def script_argv(argv: list[str]) -> list[str]:
    """`argv` with the `--local-rank=N` that torch.distributed.launch (without --use-env) puts in front of the
    launcher's arguments moved behind the script or module: it is the script's argument."""
    given: list[str] = []
    while argv and argv[0].startswith(LOCAL_RANK_ARGUMENTS):
        given, argv = [*given, argv[0]], argv[1:]
    if not given:
        return argv
    at = 2 if argv[:1] in (["--module"], ["-m"]) else 1
    return [*argv[:at], *given, *argv[at:]]


def main(argv: list[str]) -> int:
    from fa_forensics.capture.events import show_capture_warnings_as_lines
    from fa_forensics.errors import UserError

    argv = script_argv(argv)
    if not argv:
        print("usage: python -m fa_forensics.capture.launch SCRIPT [ARGS...] | --module NAME [ARGS...]",
              file=sys.stderr)
        return 2
    module_mode = argv[0] in ("--module", "-m")
    if module_mode and len(argv) < 2:
        print("error: --module needs a module name to run", file=sys.stderr)
        return 2
    target, script_args = (argv[1], argv[2:]) if module_mode else (argv[0], argv[1:])
    if not module_mode and not os.path.isfile(target):
        print(f"error: no training script at {target}; check the path in the training command", file=sys.stderr)
        return 2
    if module_mode:
        import importlib.util

        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            print(f"error: no module named {target!r} to run; check the training command (python -m MODULE)",
                  file=sys.stderr)
            return 2
    session: Optional[CaptureSession] = None
    try:
        order = order_from_env()
        session = build_session(order, [target, *script_args])
        session.start()
    except UserError as exc:
        print(f"error: {rank_prefix(session) if session is not None else ''}{exc}", file=sys.stderr)
        return 2
    said: list[str] = []
    show_capture_warnings_as_lines(said, prefix=rank_prefix(session))
    handed_over: list[bool] = []
    try:
        return _run(session, target, script_args, module_mode, handed_over)
    finally:
        if not handed_over:
            write_report(order.report, session, said)


def _hand_over(session: CaptureSession, binder: Removable, handed_over: list[bool]) -> Callable[[], bool]:
    """The launcher process's part when the script spawns its ranks: stop capturing here (nothing recorded yet),
    so that each spawned rank captures; True when it did."""
    def hand_over() -> bool:
        if handed_over:
            return True
        if session._root is not None or session.recorded_steps or session.monitored_steps:
            import warnings

            from fa_forensics.capture.events import CaptureWarning

            warnings.warn(CaptureWarning("fa-forensics capture: the script trained in its own process before it "
                                         "spawned processes; capture stays in that process, the spawned ones are not "
                                         "recorded"), stacklevel=2)
            return False
        binder.remove()
        session.stop(failed=True)  # a store this process created and did not write is removed again
        handed_over.append(True)
        return True

    return hand_over


def _run(session: CaptureSession, target: str, script_args: list[str], module_mode: bool,
         handed_over: list[bool]) -> int:
    from fa_forensics.capture.spawned import SpawnPatch
    from fa_forensics.errors import UserError

    binder = auto_binder(session)
    spawn_patch = SpawnPatch(_hand_over(session, binder, handed_over), run_spawned_rank)
    code = 0
    sys.argv = [target, *script_args]
    try:
        if module_mode:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except UserError as exc:  # e.g. --heads beyond the model's heads: one line, not a traceback
        spawn_patch.remove()
        if not handed_over:
            binder.remove()
            session.stop(failed=True)
        print(f"error: {rank_prefix(session)}{exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the capture ends as a failed run; `fa-forensics capture` says "interrupted"
        spawn_patch.remove()
        if not handed_over:
            binder.remove()
            session.stop(failed=True)
        return 130
    except BaseException:
        spawn_patch.remove()
        if not handed_over:
            binder.remove()
            session.stop(failed=True)
        raise
    spawn_patch.remove()
    if handed_over:
        return code
    binder.remove()
    try:
        session.stop(failed=code != 0)
    except UserError as exc:
        print(f"error: {rank_prefix(session)}{exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
