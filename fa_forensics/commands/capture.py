"""`fa-forensics capture`: Run a training script with capture active and record chosen steps."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "capture", "Run a training script with capture active and record chosen steps.", "issue 2")
