"""The page of `report --rank all`: one line per rank, its verdict and a link to its own report (rank_<r>/)."""
from __future__ import annotations

import html
from pathlib import Path


def render_ranks_index(dump: str, payloads: list[dict]) -> str:
    """The page as a string: `payloads` are the rank reports' JSON payloads (rank, verdict, index)."""
    e = html.escape
    rows = "".join(
        f"<tr><td><a href='rank_{int(p['rank'])}/index.html'>rank {int(p['rank'])}</a></td>"
        f"<td>{e(str(p['verdict']))}</td></tr>" for p in payloads)
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>fa-forensics report: {e(dump)}, every rank</title></head><body>"
            f"<h1>fa-forensics report: {e(dump)}, every rank</h1>"
            f"<p>{len(payloads)} ranks, one report each.</p>"
            f"<table><tr><th>rank</th><th>verdict</th></tr>{rows}</table></body></html>\n")


def write_ranks_index(out: Path, dump: str, payloads: list[dict]) -> Path:
    """Write out/index.html for the rank reports in out/rank_<r>/ and return its path."""
    from fa_forensics.dump.safe_files import atomic_write

    path = Path(out) / "index.html"
    atomic_write(path, render_ranks_index(dump, payloads), "out")
    return path
