"""The documentation site builds with --strict, its generated pages follow the code, and no doc it names is missing."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

try:  # recent typer versions carry their own copy of click
    from typer._click import Context
except ImportError:  # older typer runs on click itself
    from click import Context

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hook():
    spec = importlib.util.spec_from_file_location("cli_reference_hook", DOCS / "_hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands():
    from fa_forensics.cli import app

    group = typer.main.get_command(app)
    root = Context(group, info_name="fa-forensics")
    return {name: group.get_command(root, name) for name in group.list_commands(root)}


@pytest.mark.slow  # mkdocs builds the whole site in a subprocess: about 8 s of CPU
def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, "mkdocs build --strict failed (install the docs extra: pip install -e '.[docs]'):\n" \
        + done.stdout[-4000:] + done.stderr[-4000:]
    cli_page = (site / "cli" / "index.html").read_text()
    for name in _commands():
        assert f'id="fa-forensics-{name}"' in cli_page, f"the built CLI reference has no section for {name}"
    api_page = (site / "api" / "index.html").read_text()
    for entry in ("open_dump", "ReplayConfig", "stable_attention", "explain_add"):
        assert entry in api_page, f"the built API page does not document {entry}"


def test_cli_reference_has_every_option_of_every_command():
    sections = dict(_hook().command_sections())
    commands = _commands()
    assert list(sections) == list(commands)
    for name, command in commands.items():
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in param.opts:
                if opt.startswith("-"):
                    assert f"`{opt}" in sections[name] or f", {opt}" in sections[name] or f"/{opt}" in sections[name], \
                        f"{name}: {opt} missing from the generated reference"


def test_json_page_has_a_section_for_every_command_with_json():
    page = (DOCS / "json.md").read_text()
    anchors = set(re.findall(r"\{#([\w-]+)\}", page))
    section_of = {"import": "import-export", "export": "import-export"}
    for name, command in _commands().items():
        if any("--json" in param.opts for param in command.params):
            assert section_of.get(name, name) in anchors, f"docs/json.md has no section for `{name} --json`"


def test_every_doc_named_in_the_project_exists():
    named = {}
    files = [ROOT / "README.md", *DOCS.rglob("*.md")]
    for folder in ("fa_forensics", "tests", "benchmarks"):
        files += (ROOT / folder).rglob("*.py")
    for path in files:
        for doc in re.findall(r"\bdocs/[\w./-]+\.md\b", path.read_text(errors="replace")):
            named.setdefault(doc, path.relative_to(ROOT))
    missing = {doc: str(where) for doc, where in named.items() if not (ROOT / doc).is_file()}
    assert not missing, f"docs named but absent: {missing}"


def test_every_test_file_named_in_the_docs_exists():
    """The pages and the README name test files by path (what checks a claim): each must be where they say."""
    named = set()
    for page in [*DOCS.glob("*.md"), ROOT / "README.md"]:
        named |= {(m, page.name) for m in re.findall(r"tests/[A-Za-z0-9_/.-]+\.(?:py|md)", page.read_text())}
    missing = sorted(f"{path} (named in {page})" for path, page in named if not (ROOT / path).exists())
    assert not missing, f"test files named but absent: {missing}"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"


def test_architecture_layers_name_every_room_in_import_order():
    spec = importlib.util.spec_from_file_location("import_layers_hook", DOCS / "_hooks" / "import_layers.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    package = ROOT / "fa_forensics"
    rooms = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    rows = hook.layers(ROOT)
    assert {room for _, comp, _, _ in rows for room in comp} == rooms
    level = {room: lvl for lvl, comp, _, _ in rows for room in comp}
    for lvl, comp, deps, _ in rows:
        assert all(level[dep] < lvl for dep in deps), f"{comp} imports a room of its own or a higher layer"
    assert level["errors"] == 0 and level["cli"] > level["commands"]


def _json_section(anchor: str) -> str:
    page = (DOCS / "json.md").read_text()
    for block in re.split(r"\n## ", page)[1:]:
        title, body = block.split("\n", 1)
        if f"{{#{anchor}}}" in title:
            return body
    raise AssertionError(f"docs/json.md has no section {anchor}")


def _undocumented(keys, section: str) -> list[str]:
    return [key for key in keys if not re.search(r"(?<!\w)" + re.escape(key) + r"(?!\w)", section)]


def test_json_page_names_every_key_info_writes(planted_dump):
    from fa_forensics.dump import open_dump

    keys = open_dump(planted_dump).summary()  # what `info --json` writes, besides `warnings`
    assert not _undocumented(keys, _json_section("info")), "info --json keys missing from docs/json.md"


def test_json_page_names_every_key_of_every_analysis():
    """Every key of every analysis's --json (the registry's, derived from the payload types of
    analyses/payloads.py) is named in its section of the page or in the keys every analysis carries."""
    from fa_forensics.analyses.registry import ANALYSES

    common = _json_section("common")
    missing = []
    for analysis in ANALYSES:
        for mode, keys in [(analysis.name, analysis.json_keys), *analysis.other_json_keys.items()]:
            anchor = "bitdiff-add" if mode == "add" else analysis.name
            section = _json_section(anchor) + common
            missing += [f"{analysis.name} ({mode}): {key}" for key in _undocumented(keys, section)]
    assert not missing, "--json keys missing from docs/json.md:\n" + "\n".join(missing)


def test_json_page_names_every_key_bitdiff_add_writes():
    import dataclasses

    from fa_forensics.numerics import explain_add

    explanation = explain_add(-2.4071154594421387, -2.296875)
    keys = ["input_a", "input_b", *(field.name for field in dataclasses.fields(explanation))]
    assert not _undocumented(keys, _json_section("bitdiff-add")), "bitdiff --add keys missing from docs/json.md"
