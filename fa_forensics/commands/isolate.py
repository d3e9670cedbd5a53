"""`fa-forensics isolate`: Replay under single repairs to localize the failing operation (paper §3.2)."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "isolate", "Replay under single repairs to localize the failing operation (paper §3.2).", "issue 5")
