"""How often one analysis command's flow enters the fidelity modules and reads a layer-step's facts.

Runs a CLI command in this process under `sys.setprofile` and counts, for each module of `fa_forensics.fidelity`
(and `analyses.contract`), the calls that enter it from another module, plus the calls of the functions that read
a layer-step's recorded facts (`run_facts.read_facts`, `run_facts.facts_at`) or resolve a recipe
(`auto.resolve`, `auto.choose`). Use: python benchmarks/plan_trace.py bitdiff sample_dumps/demo.zarr [options]
(the match cache is warmed by one untraced run first, so matching does not count).
"""
from __future__ import annotations

import collections
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

import fa_forensics

ROOT = str(Path(fa_forensics.__file__).parent) + "/"
WATCHED = ("fidelity/", "analyses/contract.py")
COUNTED = {("run_facts.py", "read_facts"), ("run_facts.py", "facts_at"), ("auto.py", "resolve"),
           ("auto.py", "choose"), ("planner.py", "plan_for")}


def _module(filename: str) -> str | None:
    return filename[len(ROOT):] if filename.startswith(ROOT) else None


def trace(argv: list[str]) -> tuple[collections.Counter, collections.Counter]:
    """(entries per watched module from another module, calls of the counted functions) over one CLI run."""
    from fa_forensics.cli import main

    entries: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _module(frame.f_code.co_filename)
        if callee is None:
            return
        caller = _module(frame.f_back.f_code.co_filename) if frame.f_back else None
        name = frame.f_code.co_name
        if (callee.rsplit("/", 1)[-1], name) in COUNTED:
            calls[f"{callee}:{name}"] += 1
        if callee.startswith(WATCHED) and caller != callee and not name.startswith("<"):
            entries[callee] += 1

    sys.setprofile(profile)
    try:
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            main_argv(main, argv)
    finally:
        sys.setprofile(None)
    return entries, calls


def main_argv(main, argv: list[str]) -> None:
    saved = sys.argv
    sys.argv = ["fa-forensics", *argv]
    try:
        main()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    argv = sys.argv[1:]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["FA_FORENSICS_CACHE_DIR"] = cache
        from fa_forensics.cli import main

        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            main_argv(main, argv)  # warm the match cache
        entries, calls = trace(argv)
    print(f"fa-forensics {' '.join(sys.argv[1:])}")
    for module, n in sorted(entries.items()):
        print(f"  enters {module:40s} {n}")
    for name, n in sorted(calls.items()):
        print(f"  calls  {name:40s} {n}")
