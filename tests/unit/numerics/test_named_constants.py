"""1/ln 2 = log2 e has one home, numerics/elementary.py's LOG2E: no other module of the package writes it as a
literal (1.4426950408889634, or a shorter spelling) or recomputes it (math.log2(math.e), 1 / math.log(2)).
The Triton kernels read it as a module-level tl.constexpr of LOG2E."""
from __future__ import annotations

import ast
import math
from pathlib import Path

from fa_forensics.numerics.elementary import LOG2E

PACKAGE = Path(__file__).resolve().parents[3] / "fa_forensics"
HOME = PACKAGE / "numerics" / "elementary.py"


def _is_log2e_literal(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, float)
            and abs(node.value - 1 / math.log(2)) < 1e-5)


def _is_log2e_computed(node: ast.AST) -> bool:
    """math.log2(math.e), or 1 / math.log(2) (1.0 / log(2.0))."""
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "log2":
        return len(node.args) == 1 and getattr(node.args[0], "attr", None) == "e"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Call):
        call = node.right
        return (isinstance(node.left, ast.Constant) and node.left.value == 1
                and getattr(call.func, "attr", getattr(call.func, "id", None)) == "log"
                and len(call.args) == 1 and isinstance(call.args[0], ast.Constant) and call.args[0].value == 2)
    return False


def log2e_spellings(source: str) -> list[int]:
    """Line numbers where source writes 1/ln 2 other than by a name."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if _is_log2e_literal(node) or _is_log2e_computed(node)})


def test_the_check_sees_every_spelling_and_not_a_name():
    src = "a = x * 1.4426950408889634\nb = math.log2(math.e)\nc = 1 / math.log(2)\nd = 1.0 / log(2.0)\ne = x * LOG2E\n"
    assert log2e_spellings(src) == [1, 2, 3, 4]
    assert log2e_spellings("f = tl.exp2(s * 1.442695)\n") == [1]


def test_the_home_holds_log2e():
    assert LOG2E == 1 / math.log(2) == math.log2(math.e)
    assert log2e_spellings(HOME.read_text()) != []


def test_no_module_outside_the_home_spells_log2e():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p != HOME]
    assert any(p.name == "kernels.py" for p in files)
    found = {str(p.relative_to(PACKAGE)): lines for p in files if (lines := log2e_spellings(p.read_text()))}
    assert not found, f"import LOG2E from fa_forensics.numerics.elementary instead: {found}"
