"""`fa-forensics report`: Run every analysis with defaults and write one HTML page."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "report", "Run every analysis with defaults and write one HTML page.", "issue 5")
