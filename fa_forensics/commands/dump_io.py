"""`fa-forensics import` / `export`: convert between safetensors files and dump stores."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "import", "Import a safetensors file (names step{S}.layer{L}.{q,k,v,o,do,x}) into a dump store.", "issue 2")
    register_not_available(app, "export", "Export a dump store to a safetensors file with the same tensor names.", "issue 2")
