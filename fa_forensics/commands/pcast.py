"""`fa-forensics pcast`: FP8 P-cast study: sink-induced collapse, reverse iteration, S = 2^8."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "pcast", "FP8 P-cast study: sink-induced collapse, reverse iteration, S = 2^8.", "issue 7")
