"""Steps an alarm announced that the store does not hold: what the capture wrote about them, in words.

The capture writes every drop into the store's monitor attributes (`capture.monitor.dropped_steps`: step,
reason, the episode's first alarm step, MB); `info`, `verify`, `timeline` and `report` show them with
`dropped_text`, so a step announced on stderr as recorded is either in the store or named as dropped.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def dropped_steps(attrs: Mapping[str, Any]) -> list[dict]:
    """The drops a dump's attributes record ([] when none, or for a capture without a monitor)."""
    monitor = (attrs.get("capture") or {}).get("monitor") or {}
    drops = monitor.get("dropped_steps") or []
    return [dict(d) for d in drops if isinstance(d, Mapping) and "step" in d]


def dropped_text(drops: list[dict]) -> str:
    """'steps 58, 59 (alarm episode from step 57): held by the ring ...' grouped by episode and reason, or ''."""
    groups: dict[tuple, list[int]] = {}
    for d in drops:
        groups.setdefault((d.get("episode"), str(d.get("reason", "no reason recorded"))), []).append(int(d["step"]))
    parts = []
    for (episode, reason), steps in groups.items():
        which = f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, sorted(steps)))
        where = "" if episode is None else f" (alarm episode from step {episode})"
        parts.append(f"{which}{where}: {reason}")
    return "; ".join(parts)
