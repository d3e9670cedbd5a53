"""`fa-forensics rank1-sim`: Similarity of the rank-1 gradient terms (PK)[T]ᵀX[T] (paper Fig. 4)."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "rank1-sim", "Similarity of the rank-1 gradient terms (PK)[T]ᵀX[T] (paper Fig. 4).", "issue 5")
