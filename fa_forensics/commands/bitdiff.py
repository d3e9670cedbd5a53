"""`fa-forensics bitdiff`: Explain one addition bit by bit, or compare two O tensors bit by bit."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "bitdiff", "Explain one addition bit by bit, or compare two O tensors bit by bit.", "issue 3")
