"""`fa-forensics timeline`: Training-time figures from a dump's timeline (paper Fig. 2, 3, 11, 13)."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "timeline", "Training-time figures from a dump's timeline (paper Fig. 2, 3, 11, 13).", "issue 6")
