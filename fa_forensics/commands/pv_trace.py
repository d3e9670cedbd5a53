"""`fa-forensics pv-trace`: Trace the error of one P̄V dot product down to the bits (paper Fig. 6)."""
from __future__ import annotations

import typer

from fa_forensics.commands.common import register_not_available


def register(app: typer.Typer) -> None:
    register_not_available(app, "pv-trace", "Trace the error of one P̄V dot product down to the bits (paper Fig. 6).", "issue 5")
