"""Assemble the report's index.html: the verdict (report/verdict.py), a paragraph of findings, then one section per analysis
(its verdict, key numbers, figures beside the page and the command's own printed tables).

`findings` turns each command's documented JSON keys into one sentence; it reads keys defensively
(a command whose JSON lacks a key gives a shorter sentence, never an exception).
"""
from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Optional

from fa_forensics.analyses.registry import BY_NAME
from fa_forensics.analyses.wording import percent
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
    """One sentence per analysis from its JSON payload."""
    if name == "isolate":
        culprits = d.get("culprits") or []
        heads = d.get("heads") or []
        top = heads[0] if heads else None
        where = (f"; the largest Σδ error is at step {top.get('step')}, layer {top.get('layer')}, head {top.get('head')} "
                 f"({_num(top.get('delta_err_sum'))})") if isinstance(top, dict) else ""
        return (f"isolate: repairs that remove ≥ 90% of the δ error: {', '.join(map(str, culprits)) or 'none'}{where}.")
    if name == "delta-bias":
        rows = d.get("per_step") or []
        sig = [r for r in rows if isinstance(r, dict) and (r.get("p_value") or 1) < 0.01]
        pos = [r for r in sig if (r.get("delta_err_sum") or 0) > 0]
        feats = [str(f.get("feature")) for f in (d.get("top_features") or [])[:3] if isinstance(f, dict)]
        return (f"delta-bias: {len(sig)} of {len(rows)} (step, layer, head) items have a significant Σ(δ_lp − δ_hp) "
                f"(sign test p < 0.01), {len(pos)} of them positive; top features by dO·(O_lp − O_hp): {', '.join(feats) or 'n/a'}.")
    if name == "rank1-sim":
        cols = [str(c.get("feature")) for c in (d.get("top_columns") or [])[:3] if isinstance(c, dict)]
        return (f"rank1-sim: mean off-diagonal cosine {_num(d.get('cosine_offdiag_mean'), '.2f')}, effective rank "
                f"{_num(d.get('effective_rank'), '.2f')}, stand-out input features {', '.join(cols) or 'n/a'}, "
                f"accumulation exponent {_num(d.get('accumulation_exponent'), '.2f')} (≈ 1 compounds, ≈ 0.5 washes out).")
    if name == "pv-trace":
        where = (f"pv-trace: at step {d.get('step')}, layer {d.get('layer')}, head {d.get('head')}, "
                 f"row {d.get('row')}, feature {d.get('feature')}")
        n_ones = len(d.get("p_one_positions") or [])
        share = percent(d.get("frac_error_from_p_one"), missing="")
        if d.get("final_error") == 0:
            return f"{where} the P̄V dot product has no error (low precision and fp32 agree)."
        if not share:
            return (f"{where} the P̄V error is {_num(d.get('final_error'))}; no share of it could be attributed "
                    "to P̄ = 1 terms.")
        return (f"{where} the P̄V error is {_num(d.get('final_error'))}; {share} of it entered at the {n_ones} terms "
                "where P̄ = 1.")
    if name == "bitdiff":
        feats = d.get("biased_features") or []
        top = feats[0] if feats else None
        tail = (f"; most biased: layer {top.get('layer')} head {top.get('head')} feature {top.get('feature')} "
                f"({_num(top.get('mean'))} ± {_num(top.get('se'), '.1e')})") if isinstance(top, dict) else ""
        return (f"bitdiff: {percent(d.get('mismatch_rate'), 1, missing='an unknown share')} "
                f"of O elements differ between the {d.get('a', 'bf16')} and {d.get('b', 'fp32')} replays; {len(feats)} feature(s) significantly biased{tail}.")
    if name == "fix-check":
        return f"fix-check: {d.get('verdict', 'n/a')}"
    if name == "pcast":
        heads = d.get("heads") or []
        return f"pcast: {len(heads)} head(s) analysed for FP8 P-cast collapse." if heads else "pcast: ran."
    return None


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
"""


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
        parts.append(f"<p class='meta'>command: <code>fa-forensics {e(' '.join(s.args))}</code> · exit code {s.exit_code} · {s.seconds:.1f} s</p>")
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
