"""α and its critical values live in the statistics policy (analyses/significance.py) alone: read with `ast`, no
other module of analyses/ (nor fidelity/, report/) writes the level as a number. Flagged: a critical value of
the normal or t distribution at α (2.576, 2.58, 3.29, ...), a name meaning α (alpha, level, ...) given 0.01 or
0.005, and a p-value compared with 0.01 or 0.005. Plotting transparency (`alpha=0.5`) and effect sizes are not
α and are not flagged."""
from __future__ import annotations

import ast
from pathlib import Path

import fa_forensics

ROOT = Path(fa_forensics.__file__).resolve().parent
HOME = ROOT / "analyses" / "significance.py"
SCANNED = ("analyses", "fidelity", "report")

ALPHA_LEVELS = (0.01, 0.005)  # α and α / 2
CRITICAL = (2.576, 2.5758, 2.58, 2.575829, 3.29, 3.2905)  # |z| at α = 0.01 two-sided, and at 0.001
ALPHA_WORDS = ("alpha", "level", "sig")
P_WORDS = ("p", "p_value", "pvalue", "adjusted_p", "p_adj", "tested_p")


def _number(node: ast.AST) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _number(node.operand)
        return None if inner is None else -inner
    return None


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id.lower()
    if isinstance(node, ast.Attribute):
        return node.attr.lower()
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    return ""


def _means_alpha(name: str) -> bool:
    return any(w in name.split("_") or name.startswith(w) for w in ALPHA_WORDS)


def _is_p_value(name: str) -> bool:
    return name in P_WORDS or name.endswith("_p") or name.endswith("p_value") or name.startswith("p_")


def _is_level(value: float | None) -> bool:
    return value is not None and any(abs(value - a) < 1e-12 for a in ALPHA_LEVELS)


def alpha_literals(source: str, filename: str = "<source>") -> list[str]:
    """'file:line: what' for every α or critical value written as a number in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        value = _number(node)
        if value is not None and any(abs(abs(value) - c) < 5e-4 for c in CRITICAL):
            found.append(f"{where}: critical value {value:g}")
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and _is_level(_number(node.value)) and any(_means_alpha(_name(t))
                                                                                  for t in targets):
                found.append(f"{where}: α assigned as a number")
        elif isinstance(node, ast.keyword) and node.arg and _means_alpha(node.arg.lower()) \
                and _is_level(_number(node.value)):
            found.append(f"{where}: {node.arg}={_number(node.value):g}")
        elif isinstance(node, ast.arguments):
            args = [*node.posonlyargs, *node.args]
            pairs = list(zip(args[len(args) - len(node.defaults):], node.defaults))
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            found += [f"{where}: default {a.arg}={_number(d):g}" for a, d in pairs
                      if _means_alpha(a.arg.lower()) and _is_level(_number(d))]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_level(_number(s)) for s in sides) and any(_is_p_value(_name(s)) for s in sides):
                found.append(f"{where}: p-value compared with a number")
    return found


def test_alpha_has_one_home():
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != HOME:
                found += alpha_literals(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT.parent)))
    assert not found, "α written as a number outside analyses/significance.py (import ALPHA):\n" + "\n".join(found)


def test_the_home_defines_alpha_and_the_scan_sees_every_spelling():
    assert alpha_literals(HOME.read_text(encoding="utf-8"))  # the home itself would be flagged: the scan reads it
    bad = ("ALPHA = 0.01\n"
           "def f(p, alpha: float = 0.01, *, level=0.005):\n"
           "    return p < 0.01 or z > 2.576 or abs(t) >= 2.58 or g(alpha=0.01) or r.adjusted_p <= 0.005\n")
    assert len(alpha_literals(bad)) == 8
    fine = ("ax.bar(x, y, alpha=0.5)\nEFFECT_FLOOR = 0.01\nmargin = 0.01\n"
            "def f(p, alpha=ALPHA):\n    return p < alpha and share > 0.01\n")
    assert alpha_literals(fine) == []
