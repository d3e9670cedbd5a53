"""mkdocs hook: the architecture page's layer table, generated from the package's imports at build time.

A page that holds the marker `<!-- import-layers -->` gets, in its place, the rooms of `fa_forensics` (its
subpackages and top-level modules) in import order: each room's layer (0 imports no other room; a room's layer is
one more than the highest layer it imports), the rooms it imports at module level, and those it imports only
inside functions (lazily). Rooms that import each other at module level share a layer and are named as a cycle.
The table is read from the source with `ast`, so it follows the code as rooms move.
"""
from __future__ import annotations

import ast
from pathlib import Path

MARKER = "<!-- import-layers -->"
PACKAGE = "fa_forensics"


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool):
    """(imported module, at module level?) for every import in the tree, relative ones resolved."""
    def walk(node, top):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, top
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")
                    base = base[: len(base) - child.level + (1 if is_package else 0)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                yield target, top
                for alias in child.names:
                    yield f"{target}.{alias.name}", top
            yield from walk(child, inner)
    yield from walk(tree, True)


def room_graph(root: Path):
    """{room: (rooms imported at module level, rooms imported only lazily)}, type-checking imports left out."""
    package_dir = root / PACKAGE
    eager: dict[str, set[str]] = {}
    lazy: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        module = _module_name(path, root)
        room = _room(module)
        if room is None:
            continue
        eager.setdefault(room, set())
        lazy.setdefault(room, set())
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # imports under `if TYPE_CHECKING:` do not run
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        for target, top in _imports(tree, module, path.name == "__init__.py"):
            other = _room(target)
            if other is None or other == room or not (package_dir / other).exists() and \
                    not (package_dir / f"{other}.py").exists():
                continue
            (eager if top else lazy)[room].add(other)
    return {room: (eager[room], lazy[room] - eager[room]) for room in eager}


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), each sorted (tests/unit/test_import_graph.py uses it too)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layers(root: Path):
    """[(layer, rooms of one component, module-level imports, lazy-only imports)] in import order."""
    graph = room_graph(root)
    eager = {room: deps for room, (deps, _) in graph.items()}
    comps = strongly_connected_components(eager)
    comp_of = {room: i for i, comp in enumerate(comps) for room in comp}
    level: dict[int, int] = {}
    for i, comp in enumerate(comps):  # Tarjan emits a component after everything it imports
        deps = {comp_of[d] for room in comp for d in eager[room]} - {i}
        level[i] = 1 + max((level[d] for d in deps), default=-1)
    rows = []
    for i, comp in enumerate(comps):
        deps = sorted({d for room in comp for d in eager[room]} - set(comp))
        lazy = sorted({d for room in comp for d in graph[room][1]} - set(comp) - set(deps))
        rows.append((level[i], comp, deps, lazy))
    return sorted(rows, key=lambda row: (row[0], row[1]))


def module_cycles(root: Path) -> list[list[str]]:
    """Groups of modules that import each other, counting imports inside functions too (type-checking ones aside).

    A module importing a package it lives in is left out: that package's `__init__` has already run.
    """
    package_dir = root / PACKAGE
    modules = {_module_name(path, root): path for path in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        deps = set()
        for target, _ in _imports(tree, module, path.name == "__init__.py"):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):  # a module's own packages run
                deps.add(target)                                                        # before it: not a cycle
        graph[module] = deps
    return [comp for comp in strongly_connected_components(graph) if len(comp) > 1]


def _room_label(room: str, root: Path) -> str:
    return f"`{room}/`" if (root / PACKAGE / room).is_dir() else f"`{room}.py`"


def layers_markdown(root: Path) -> str:
    lines = ["| layer | room | imports (module level) | imports only inside functions |", "|---|---|---|---|"]
    for level, comp, deps, lazy in layers(root):
        room = ", ".join(_room_label(r, root) for r in comp) + (" (an import cycle)" if len(comp) > 1 else "")
        lines.append(f"| {level} | {room} | {', '.join(deps) or '—'} | {', '.join(lazy) or '—'} |")
    cycles = module_cycles(root)
    lines += ["", "Import cycles between modules, counting the imports made inside functions: "
              + (f"{len(cycles)}." if cycles else "none.")]
    lines += [f"- {' ↔ '.join(f'`{m}`' for m in comp)}" for comp in cycles]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    root = Path(config["config_file_path"]).resolve().parent
    return markdown.replace(MARKER, layers_markdown(root))
