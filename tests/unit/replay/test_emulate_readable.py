"""The emulator is the readable specification: no function in replay/emulate runs over 50 lines, so forward and
backward stay a short loop over one function per step of the algorithm (read with ast, no import)."""
from __future__ import annotations

import ast
from pathlib import Path

EMULATE = Path(__file__).resolve().parents[3] / "fa_forensics" / "replay" / "emulate"
MAX_LINES = 50


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in source longer than limit lines (decorators excluded)."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_the_length_check_finds_a_long_function_and_passes_a_short_one():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def long():\n{body}\n") == [("long", MAX_LINES + 1)]
    short = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES - 1))
    assert long_functions(f"class C:\n    def short(self):\n{short}\n") == []


def test_no_function_of_the_emulator_runs_over_50_lines():
    files = sorted(EMULATE.glob("*.py"))
    assert {"forward.py", "backward.py", "fused.py"} <= {f.name for f in files}
    too_long = {f"{f.name}:{name}": n for f in files for name, n in long_functions(f.read_text())}
    assert not too_long, f"split these into one function per step (at most {MAX_LINES} lines): {too_long}"
