"""`fa-forensics synth`: Plant a synthetic dump with known ties, sign skew and stand-out features."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "synth", "Plant a synthetic dump with known ties, sign skew and stand-out features.", "issue 2")
