"""The training command of `fa-forensics capture`, with the capture launcher put where the training runs.

`rewrite_command(command)` inserts the launcher (`-m fa_forensics.capture.launch`) into
- `python [OPTIONS] SCRIPT ...` and `python -m MODULE ...`: the launcher runs the script or module;
- `SCRIPT.py ...`: run by this interpreter;
- a distributed launcher: `torchrun ...`, `python -m torch.distributed.run ...` or
  `python -m torch.distributed.launch ...`. Its options are read with its own argument parser
  (`torch.distributed.run.get_args_parser`), so the training script is found wherever it stands, and
  the capture launcher goes in front of it: every rank process the launcher starts runs the script
  under capture, the launcher itself records nothing. `--module` runs the capture launcher with the
  module; `--run-path` runs the capture launcher's file; with `--no-python` the command that follows is
  rewritten as a command of its own.
A script that starts its ranks itself (torch.multiprocessing.spawn) is a plain `python SCRIPT` here: the
capture launcher follows the spawn into the ranks (capture/spawned.py).
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NoReturn, Optional

from fa_forensics.errors import UserError

if TYPE_CHECKING:
    import argparse

LAUNCHER = "fa_forensics.capture.launch"
DISTRIBUTED_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


def launcher_file() -> str:
    """The capture launcher's own file (what `--run-path` runs)."""
    from fa_forensics.capture import launch

    return os.path.abspath(launch.__file__)


def rewrite_command(command: list[str], same_python: bool = True) -> list[str]:
    """Insert the capture launcher into a training command line (see the module's docstring).

    same_python: a bare `python` / `python3` becomes the interpreter fa-forensics runs in
    (sys.executable), and a bare `torchrun` that interpreter's `-m torch.distributed.run`, so the
    script sees this fa-forensics and its torch, not whatever a PATH shim (pyenv, conda) resolves to.
    """
    if not command:
        raise UserError("no training command given; put it after --, e.g. fa-forensics capture --out run.zarr --steps "
                        "100 -- python train.py")
    if same_python and command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    if same_python and command[0] == "torchrun":
        return _rewrite_distributed([sys.executable, "-m", "torch.distributed.run"], command[1:], "torchrun",
                                    same_python)
    exe = os.path.basename(command[0])
    if exe == "torchrun":
        return _rewrite_distributed(command[:1], command[1:], "torchrun", same_python)
    if exe.startswith("python"):
        i = 1
        while i < len(command) and command[i].startswith("-") and command[i] != "-m":
            i += 1  # interpreter options such as -u, -O
        if i >= len(command):
            raise UserError(f"no script in {' '.join(command)!r}; give python a script or -m module to run")
        if command[i] == "-m":
            if i + 1 >= len(command):
                raise UserError("python -m needs a module name")
            if command[i + 1] in DISTRIBUTED_LAUNCHERS:
                return _rewrite_distributed(command[:i + 2], command[i + 2:], command[i + 1], same_python)
            return [*command[:i], "-m", LAUNCHER, "--module", *command[i + 1:]]
        return [*command[:i], "-m", LAUNCHER, *command[i:]]
    if command[0].endswith(".py"):
        return [sys.executable, "-m", LAUNCHER, *command]
    raise UserError(f"cannot start {command[0]!r} with capture; the command must be `python SCRIPT ...`, `python -m "
                    "MODULE ...`, `torchrun ... SCRIPT ...`, `python -m torch.distributed.run ... SCRIPT ...` or "
                    "`SCRIPT.py ...`")


def _launcher_arguments(name: str, args: list[str]) -> argparse.Namespace:
    """`args` read by the distributed launcher's own parser; a UserError instead of its usage text and exit."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    if name == "torch.distributed.launch":  # its one option of its own
        parser.add_argument("--use-env", "--use_env", default=False, action="store_true")

    def refuse(message: Optional[str] = "", *_args: object) -> NoReturn:
        message = " ".join(str(message or "it asks for its help").split())
        raise UserError(f"cannot read the {name} command ({message}); check its options and the training script")

    def exit_(status: int = 0, message: Optional[str] = None) -> NoReturn:
        refuse(message)

    # argparse has no hook for its usage errors and exits: this parser's own methods are replaced
    parser.error = refuse  # type: ignore[method-assign]
    parser.exit = exit_  # type: ignore[method-assign]
    return parser.parse_args(args)


def _rewrite_distributed(head: list[str], args: list[str], name: str, same_python: bool) -> list[str]:
    """`head` starts the distributed launcher `name`, `args` are its arguments: the capture launcher goes in front
    of the training script, which every rank process then runs under capture."""
    ns = _launcher_arguments(name, args)
    at = len(args) - len(ns.training_script_args) - 1  # the script's place: everything after it is its own
    if at < 0 or args[at] != ns.training_script:
        raise UserError(f"could not find the training script in the {name} command; put it after the launcher's "
                        "options, e.g. torchrun --nproc_per_node 2 train.py ARGS")
    options, script, rest = args[:at], args[at], args[at + 1:]
    if ns.no_python:
        return [*head, *options, *rewrite_command([script, *rest], same_python)]
    if ns.run_path:
        return [*head, *options, launcher_file(), script, *rest]
    if ns.module:
        return [*head, *options, LAUNCHER, "--module", script, *rest]
    return [*head, *options, "--module", LAUNCHER, script, *rest]


def check_target(argv: list[str]) -> None:
    """The script the capture launcher will run must exist; a module too, when it runs in this interpreter
    (in another one the launcher checks it)."""
    import shutil

    marks = [i for i, token in enumerate(argv[:-1]) if token in (LAUNCHER, launcher_file())]
    if not marks:
        return
    at = marks[0]
    script = argv[at + 1]
    if script != "--module":
        if not os.path.isfile(script):
            raise UserError(f"no training script at {script}; check the path in the training command")
        return
    module = argv[at + 2] if len(argv) > at + 2 else None
    exe = shutil.which(argv[0])
    if module is None or exe is None or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"no module named {module!r} to run; check the training command (python -m MODULE)")
