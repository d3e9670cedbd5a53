"""`fa-forensics delta-bias`: Bias of δ = rowsum(dO∘O) per token, step, layer and head (paper Fig. 5)."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "delta-bias", "Bias of δ = rowsum(dO∘O) per token, step, layer and head (paper Fig. 5).", "issue 5")
