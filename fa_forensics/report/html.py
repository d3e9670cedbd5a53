"""Assemble the report's index.html: the verdict (report/verdict.py), a paragraph of findings, then one section
per analysis (its verdict, key numbers, figures beside the page and the command's own printed tables).

`findings` gathers each analysis's one sentence (`finding` in its room's table.py), made from its documented
JSON keys read defensively (a command whose JSON lacks a key gives a shorter sentence, never an exception).
"""
from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Optional

from fa_forensics.analyses.registry import BY_NAME
from fa_forensics.report.verdict import report_verdict


def _title(name: str) -> str:
    """The registered title of an analysis's section (its name when it has none)."""
    analysis = BY_NAME.get(name)
    return analysis.section.title if analysis is not None and analysis.section is not None else name


def _num(x, fmt: str = "+.3e") -> str:
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return format(x, fmt)
    return "n/a"


def _finding(name: str, d: dict) -> Optional[str]:
    """One sentence per analysis from its JSON payload (the analysis's own `finding`, in its room)."""
    analysis = BY_NAME.get(name)
    return analysis.finding(d) if analysis is not None and analysis.section is not None else None


def findings(sections) -> list[str]:
    """The first paragraph of the report: one sentence per analysis that produced JSON."""
    out = []
    for s in sections:
        if s.data is not None:
            sentence = _finding(s.name, s.data)
            if sentence:
                out.append(sentence)
    return out


def _scalars(d: dict) -> list[tuple[str, str]]:
    """Top-level scalar keys of a payload, for a compact table."""
    rows = []
    for k, v in d.items():
        if isinstance(v, bool) or v is None or isinstance(v, (int, float, str)):
            text = _num(v, ".4g") if isinstance(v, float) else str(v)
            rows.append((k, text))
    return rows[:16]


_CSS = """
body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em} h2{font-size:1.15em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
.lead{background:#f4f8fb;border-left:4px solid #0072B2;padding:.6em 1em}
.verdict{background:#fdf6e3;border-left:4px solid #D55E00;padding:.6em 1em}
.note{color:#a33} table{border-collapse:collapse;font-size:.85em} td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.5em 0} pre{background:#fafafa;font-size:.75em;overflow-x:auto;padding:.5em}
.meta{color:#666;font-size:.85em}
"""  # noqa: E501 - the page's style sheet, kept byte for byte


def render(dump: str, sections, *, info: Optional[dict] = None, seconds: float = 0.0) -> str:
    """The whole page as a string."""
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>fa-forensics report: {e(dump)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>fa-forensics report: {e(dump)}</h1>"]
    found = findings(sections)
    missing = [s.name for s in sections if s.data is None]
    parts.append(f"<p class='verdict'><strong>{e(report_verdict(sections))}</strong></p>")
    lead = " ".join(e(f) for f in found) or "No analysis produced a result."
    if missing:
        lead += " " + e(f"Not available for this dump: {', '.join(missing)} (see the notes below).")
    parts.append(f"<p class='lead'>{lead}</p>")
    if info:
        parts.append("<p class='meta'>" + e(", ".join(f"{k}: {v}" for k, v in info.items())) + "</p>")
    parts.append(f"<p class='meta'>{len(sections)} analyses in {seconds:.0f} s. Each section's figures and JSON are in "
                 "the folder of the same name beside this page.</p>")
    for s in sections:
        parts.append(f"<h2 id='{e(s.name)}'>{e(_title(s.name))}</h2>")
        parts.append(f"<p class='meta'>command: <code>fa-forensics {e(' '.join(s.args))}</code> · exit code "
                     f"{s.exit_code} · {s.seconds:.1f} s</p>")
        if s.data is None:
            parts.append(f"<p class='note'>{e(s.note or 'no result')}</p>")
            continue
        sentence = _finding(s.name, s.data)
        if sentence:
            parts.append(f"<p>{e(sentence)}</p>")
        rows = _scalars(s.data)
        if rows:
            parts.append("<table><tr><th>key</th><th>value</th></tr>" +
                         "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in rows) + "</table>")
        for fig in s.figures:
            parts.append(f"<div><img src='{e(fig)}' alt='{e(fig)}'></div>")
        if s.text.strip():
            parts.append(f"<details><summary>printed output</summary><pre>{e(s.text)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out_dir: Path, dump: str, sections, *, info: Optional[dict] = None, seconds: float = 0.0) -> Path:
    """Write out_dir/index.html and return its path."""
    from fa_forensics.dump.safe_files import atomic_write

    path = Path(out_dir) / "index.html"
    atomic_write(path, render(dump, sections, info=info, seconds=seconds), "out")
    return path
