"""`fa-forensics fix-check`: Check whether the stabilized softmax removes the bias (paper §4, App. C)."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "fix-check", "Check whether the stabilized softmax removes the bias (paper §4, App. C).", "issue 5")
