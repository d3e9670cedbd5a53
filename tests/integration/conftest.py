"""Every test here runs real training end to end: all are marked slow, left out of the fast loop."""
import pytest


def pytest_itemcollected(item) -> None:
    """Called through this directory's hooks only (pytest scopes it by path), so it marks the tests of this folder."""
    item.add_marker(pytest.mark.slow)
