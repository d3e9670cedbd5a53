"""mkdocs hook: the CLI reference page, generated from the typer app at build time.

A page that holds the marker `<!-- cli-reference -->` gets, in its place, one section per command of
`fa_forensics.cli.app` (in --help order): its help text, its usage line and a table of its arguments and
options as `--help` words them (defaults included). Nothing is copied by hand, so the page follows the app.
"""
from __future__ import annotations

import html

try:  # recent typer versions carry their own copy of click
    from typer._click import Context
except ImportError:  # older typer runs on click itself
    from click import Context

MARKER = "<!-- cli-reference -->"
PROG = "fa-forensics"


def _cell(text: str) -> str:
    """Text for a markdown table cell: pipes escaped, angle brackets kept literal, one line."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def _code_cell(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _help_paragraphs(text: str) -> str:
    """Click's help text as markdown: its no-rewrap markers dropped, angle brackets kept literal."""
    lines = [line for line in text.splitlines() if line.strip() != "\b"]
    return html.escape("\n".join(lines).strip(), quote=False)


def command_sections(app=None) -> list[tuple[str, str]]:
    """(command name, markdown section) for every command of the app, in --help order."""
    import typer

    if app is None:
        from fa_forensics.cli import app
    group = typer.main.get_command(app)
    root = Context(group, info_name=PROG)
    sections = []
    for name in group.list_commands(root):
        command = group.get_command(root, name)
        if command is None or getattr(command, "hidden", False):
            continue
        ctx = Context(command, info_name=name, parent=root)
        usage = " ".join([PROG, name, *command.collect_usage_pieces(ctx)])
        rows = []
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            record = param.get_help_record(ctx)
            if record is None:
                continue
            opts, help_text = record
            rows.append(f"| {_code_cell(opts)} | {_cell(help_text)} |")
        parts = [f"## `{PROG} {name}`", "", _help_paragraphs(command.help or ""), "", "```text", usage, "```", ""]
        if rows:
            parts += ["| argument / option | meaning |", "|---|---|", *rows, ""]
        sections.append((name, "\n".join(parts)))
    return sections


def reference_markdown(app=None) -> str:
    """The whole generated reference: the root options, then one section per command."""
    import typer

    if app is None:
        from fa_forensics.cli import app
    group = typer.main.get_command(app)
    root = Context(group, info_name=PROG)
    root_rows = []
    for param in group.params:
        record = param.get_help_record(root)
        if record is not None:
            root_rows.append(f"| {_code_cell(record[0])} | {_cell(record[1])} |")
    head = [_help_paragraphs(group.help or ""), "", "```text", f"{PROG} [OPTIONS] COMMAND [ARGS]...", "```", ""]
    if root_rows:
        head += ["| option | meaning |", "|---|---|", *root_rows, ""]
    return "\n".join(head + [section for _, section in command_sections(app)])


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference_markdown())
