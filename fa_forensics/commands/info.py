"""`fa-forensics info`: Describe a dump: steps, layers, heads, shapes, dtypes, capture settings."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "info", "Describe a dump: steps, layers, heads, shapes, dtypes, capture settings.", "issue 2")
