"""Fixtures the fidelity tests share."""
from __future__ import annotations

import pytest

import fa_forensics.fidelity.match as match_mod


@pytest.fixture
def counted(monkeypatch):
    """The list that gains one entry per `match_layer` call (the real one still runs): how often a layer-step was
    matched."""
    calls = []
    real = match_mod.match_layer
    monkeypatch.setattr(match_mod, "match_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls
