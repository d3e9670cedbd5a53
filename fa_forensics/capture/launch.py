"""Run an unmodified training script with capture active: `python -m fa_forensics.capture.launch SCRIPT ARGS...`.

Settings come as JSON in the environment variable FA_FORENSICS_CAPTURE (written by
`fa-forensics capture`): {"out", "steps", "layers", "heads", "batch", "micro_batch", "overwrite",
"allow_other_model", "attention_modules", "monitor_every", "alarm", "alarm_steps", "ring", "attention", "softmax",
"report"} in their text forms. At exit the launcher writes {"steps_run", "steps_without_attention",
"attention_calls_seen", "warnings"} as JSON to the file "report" names (when given), for the command.
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

import json
import os
import runpy
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


def _auto_binder(session):
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


def main(argv: list[str]) -> int:
    from fa_forensics.capture.events import show_capture_warnings_as_lines
    from fa_forensics.capture.modules import DEFAULT_ATTENTION_PATTERN
    from fa_forensics.capture.session import CaptureSession
    from fa_forensics.errors import UserError

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
    try:
        from fa_forensics.monitor.alarm import rule_from_settings

        cfg = settings_from_env()
        session = CaptureSession(
            None, cfg["out"], cfg["steps"], cfg.get("layers"), cfg.get("heads"), cfg.get("batch"),
            int(cfg.get("micro_batch", 0)),
            cfg.get("attention_modules") or DEFAULT_ATTENTION_PATTERN,
            overwrite=bool(cfg.get("overwrite", False)), allow_other_model=bool(cfg.get("allow_other_model", False)),
            keep_sdpa_patch=True,
            monitor_every=cfg.get("monitor_every"), alarm=rule_from_settings(cfg.get("alarm")) or False,
            alarm_steps=int(cfg.get("alarm_steps", 3)), ring=int(cfg.get("ring", 0)),
            run_attrs={"capture": {"command": cfg.get("command") or [target, *script_args]}},
            attention=cfg.get("attention") or (), softmax=cfg.get("softmax"),
        )
        session.start()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    said: list[str] = []
    show_capture_warnings_as_lines(said)
    try:
        return _run(session, target, script_args, module_mode)
    finally:
        _write_report(cfg.get("report"), session, said)


def _write_report(path, session, said: list[str]) -> None:
    """What the command cannot read from the store: how far the run got and what was said."""
    if not path:
        return
    report = {"steps_run": int(session.current_step), "steps_without_attention": list(session.steps_without_attention),
              "attention_calls_seen": int(session.attention_calls_seen), "warnings": said}
    try:
        with open(path, "w") as fh:
            json.dump(report, fh)
    except OSError:
        pass


def _run(session, target: str, script_args: list[str], module_mode: bool) -> int:
    from fa_forensics.errors import UserError

    binder = _auto_binder(session)
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
        binder.remove()
        session.stop(failed=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the capture ends as a failed run; `fa-forensics capture` says "interrupted"
        binder.remove()
        session.stop(failed=True)
        return 130
    except BaseException:
        binder.remove()
        session.stop(failed=True)
        raise
    binder.remove()
    try:
        session.stop(failed=code != 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
