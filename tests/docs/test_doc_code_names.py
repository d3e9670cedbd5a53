"""Every module, file and function of the package that a documentation page names exists in the code.

Read with ast, never imported: `fa_forensics.x.y` and `fa_forensics/x/y.py` anywhere in docs/*.md; inside code spans
and code blocks also short paths (`layers/selection.py`), and on the pages about the code short dotted names
(`fidelity.auto.resolve`; elsewhere `capture.steps` is a key of the dump's attributes, not code)."""
import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fa_forensics"
DOCS = ROOT / "docs"
PAGES_ABOUT_THE_CODE = ("architecture.md", "import-layers.md", "analysis-registry.md", "developing.md")

_MODULES = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
ROOMS = sorted(_MODULES | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}, key=len, reverse=True)
_ROOM = "|".join(ROOMS)
FILE_EXTENSIONS = ("md", "py", "zarr", "json", "html", "png", "txt", "csv", "toml", "yml", "log", "pt")
DOTTED_FULL = re.compile(r"(?<![\w./-])fa_forensics((?:\.\w+)+)")
PATH_FULL = re.compile(r"(?<![\w./-])fa_forensics/([\w/]+\.py)")
DOTTED_SHORT = re.compile(rf"(?<![\w./-])((?:{_ROOM})(?:\.\w+)+)(?![\w/(-])")
PATH_SHORT = re.compile(rf"(?<![\w./-])((?:{_ROOM})/[\w/]+\.py)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _defines(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The statement of `body` that binds `name` at that level (def, class, assignment, import), or None."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return node
        if isinstance(node, (ast.If, ast.Try)):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *[s for h in getattr(node, "handlers", []) for s in h.body]]
            found = _defines(inner, name)
            if found is not None:
                return found
    return None


def _lazy_export(module: Path, name: str) -> bool:
    """A package that exports names through a module-level `__getattr__` names them as strings in its source."""
    return _defines(_tree(module).body, "__getattr__") is not None and f'"{name}"' in module.read_text()


def missing_dotted(parts: list[str]) -> str | None:
    """Why `fa_forensics.<parts>` names nothing in the code, or None when it does."""
    where = PACKAGE
    module: Path | None = PACKAGE / "__init__.py"
    for i, part in enumerate(parts):
        if where is not None and (where / part / "__init__.py").is_file():
            where, module = where / part, where / part / "__init__.py"
            continue
        if where is not None and (where / f"{part}.py").is_file():
            where, module = None, where / f"{part}.py"
            continue
        node = _defines(_tree(module).body, part)
        if node is None:
            if _lazy_export(module, part):
                return None
            return f"{module.relative_to(ROOT)} defines no {part}"
        if isinstance(node, ast.ClassDef) and i + 1 < len(parts):
            member = parts[i + 1]
            if _defines(node.body, member) is None:
                return f"{module.relative_to(ROOT)}: class {part} defines no {member}"
        return None
    return None


def _names_in(text: str, short_dotted: bool = True):
    for m in DOTTED_FULL.finditer(text):
        yield "fa_forensics" + m.group(1), m.group(1).strip(".").split(".")
    for m in PATH_FULL.finditer(text):
        yield "fa_forensics/" + m.group(1), m.group(1)
    for code in CODE.finditer(text):
        span = DOTTED_FULL.sub(" ", PATH_FULL.sub(" ", code.group(0)))
        for m in DOTTED_SHORT.finditer(span) if short_dotted else ():
            parts = m.group(1).split(".")
            if parts[-1] not in FILE_EXTENSIONS:
                yield m.group(1), parts
        for m in PATH_SHORT.finditer(span):
            yield m.group(1), m.group(1)


def test_every_package_name_in_the_docs_exists():
    missing = []
    for page in sorted(DOCS.glob("*.md")):
        for shown, name in _names_in(page.read_text(), page.name in PAGES_ABOUT_THE_CODE):
            if isinstance(name, str):
                why = None if (PACKAGE / name).is_file() else "no such file"
            else:
                why = missing_dotted(name)
            if why:
                missing.append(f"docs/{page.name}: {shown} ({why})")
    assert not missing, "\n".join(sorted(set(missing)))


def test_the_check_finds_a_name_that_does_not_exist():
    assert missing_dotted(["fidelity", "auto", "resolve"]) is None
    assert missing_dotted(["analyses", "match", "fidelity"]) is not None
    assert missing_dotted(["layers", "selection", "no_such_function"]) is not None
    names = dict(_names_in("`layers/no_such.py` and fa_forensics.replay.replay, see replay.md"))
    assert set(names) == {"layers/no_such.py", "fa_forensics.replay.replay"}
