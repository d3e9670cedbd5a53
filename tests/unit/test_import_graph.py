"""The package's import graph, read statically with `ast`: no import cycle between modules, and every import
points down the layer order below (or stays inside its own package).

Every `import` and `from ... import` counts, wherever it stands (module level, inside a function, under
`if TYPE_CHECKING`): a function-level import that closes a circle is still a circle, only hidden until the
function runs. `from package import name` is an edge to the submodule `package.name` when that is a module,
else to the package's `__init__`. Imports by string (`importlib.import_module`) are not edges; the package
root's lazy entry points are the only ones.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import fa_forensics

ROOT = Path(fa_forensics.__file__).resolve().parent

# Bottom to top. A module may import modules of lower tiers and of its own package; a package never imports
# a package of its own tier or of a higher one. `fa_forensics` alone is the package root (`__version__` and
# the lazy entry points).
LAYERS: list[tuple[str, ...]] = [
    ("fa_forensics", "fa_forensics.errors", "fa_forensics.enums"),
    ("fa_forensics.optional",),
    ("fa_forensics.numerics", "fa_forensics.dump"),
    ("fa_forensics.replay",),
    ("fa_forensics.monitor", "fa_forensics.planted"),
    ("fa_forensics.capture", "fa_forensics.layers"),
    ("fa_forensics.fidelity", "fa_forensics.demo"),
    ("fa_forensics.analyses",),
    ("fa_forensics.report",),
    ("fa_forensics.commands",),
    ("fa_forensics.cli",),
    ("fa_forensics.__main__",),
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is named by its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a module of the package."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(_known(a.name, mods) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in mods else _known(source, mods))
    found.discard(None)
    found.discard(name)
    return {m for m in found if m == "fa_forensics" or m.startswith("fa_forensics.")}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of several modules (each sorted): the modules caught in circles. Tarjan's
    algorithm as the docs' layer table computes it (docs/_hooks/import_layers.py, one implementation)."""
    hook_path = ROOT.parent / "docs" / "_hooks" / "import_layers.py"
    spec = importlib.util.spec_from_file_location("import_layers_hook", hook_path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return [comp for comp in hook.strongly_connected_components(graph) if len(comp) > 1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path (first module repeated at the end) per strongly connected component of several modules."""
    return [_closed_path(graph, set(c)) for c in components(graph)]


def _closed_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first inside the component)."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def layer_of(module: str) -> tuple[int, str]:
    """(tier, package) of a module: the longest LAYERS entry it is or lies in."""
    best = None
    for tier, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (tier, name)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS in {Path(__file__).name}"
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b (tier i -> tier j)' for every import that leaves its package and does not point to a lower tier."""
    out = []
    for module, deps in sorted(graph.items()):
        tier, package = layer_of(module)
        for dep in sorted(deps):
            dep_tier, dep_package = layer_of(dep)
            if dep_package != package and dep_tier >= tier:
                out.append(f"{module} -> {dep} (tier {tier} -> tier {dep_tier})")
    return out


ANALYSES = "fa_forensics.analyses"


def analysis_folder(module: str) -> str | None:
    """The analysis folder (a subpackage of `analyses`, e.g. fa_forensics.analyses.isolate) a module lies in, or
    None for the shared modules directly in `analyses` (contract, quantities, primitives, significance, ...)."""
    if not module.startswith(ANALYSES + "."):
        return None
    parts = module.split(".")
    folder = ".".join(parts[:3])
    return folder if (ROOT / "analyses" / parts[2]).is_dir() or module != folder else None


def analysis_cross_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import from one analysis folder into another: an analysis reads only the shared
    modules of `analyses` (and lower layers), so that each can be read, changed and tested alone."""
    out = []
    for module, deps in sorted(graph.items()):
        folder = analysis_folder(module)
        if folder is None:
            continue
        out += [f"{module} -> {dep}" for dep in sorted(deps) if analysis_folder(dep) not in (None, folder)]
    return out


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    found = [f"{' -> '.join(_closed_path(graph, set(c)))} (circle among {', '.join(c)})" for c in components(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_every_import_points_down_the_layer_order():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_analysis_folders_import_only_shared_modules():
    bad = analysis_cross_imports(import_graph())
    assert not bad, ("analysis folders importing another analysis folder (move what they share into a shared module "
                     "of fa_forensics/analyses, e.g. primitives.py):\n" + "\n".join(bad))


def test_an_analysis_importing_another_analysis_is_named():
    """The folder check rests on `analysis_folder`: an import into a sibling folder is named, one into a shared
    module or the folder's own modules is not."""
    graph = {
        "fa_forensics.analyses.isolate.compute": {"fa_forensics.analyses.delta_bias.compute",
                                                  "fa_forensics.analyses.primitives",
                                                  "fa_forensics.analyses.isolate.table"},
        "fa_forensics.analyses.primitives": {"fa_forensics.layers.selection"},
        "fa_forensics.analyses.pv_trace.p_one": {"fa_forensics.analyses.pv_trace"},
    }
    assert analysis_cross_imports(graph) == [
        "fa_forensics.analyses.isolate.compute -> fa_forensics.analyses.delta_bias.compute"]


def test_the_reader_sees_function_level_and_relative_imports(tmp_path):
    """The checks rest on the reader: a circle closed by an import inside a function, through a relative
    import and a package's __init__, is found and named."""
    pkg = tmp_path / "fa_forensics"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from fa_forensics.b import g\n    return g\n")
    (pkg / "b.py").write_text("import os\nfrom fa_forensics import sub\n\ndef g():\n    return os\n")
    graph = import_graph(pkg)
    assert graph["fa_forensics.sub"] == {"fa_forensics.sub.a"}
    assert graph["fa_forensics.sub.a"] == {"fa_forensics.b"}
    assert graph["fa_forensics.b"] == {"fa_forensics.sub"}
    assert cycles(graph) == [["fa_forensics.b", "fa_forensics.sub", "fa_forensics.sub.a", "fa_forensics.b"]]
