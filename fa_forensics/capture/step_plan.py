"""What the step in progress does with its attention calls, decided once when it begins.

A step is recorded in full (selected by `steps`, or asked for by an alarm), monitored (every `monitor_every`-th:
its calls feed the timeline row) and, monitored but not recorded with a ring, held in the ring (its selected
layers wait in host memory for an alarm); or it does nothing. The session computes a `StepPlan` when a step
begins (and again when an alarm asks for the step in progress) and its hooks read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepPlan:
    """What step `step` does, and why (`why`: "selected", "alarm", "monitored" or "not selected")."""

    step: int
    record: bool = False  # recorded in full
    monitor: bool = False  # its calls feed the monitor's timeline row
    ring: bool = False  # its selected layers go to the ring
    why: str = "not selected"
    active: bool = field(init=False)  # its attention calls are needed (recorded, monitored or held)

    def __post_init__(self) -> None:
        object.__setattr__(self, "active", self.record or self.monitor)

    @classmethod
    def decide(cls, step: int, *, selected: bool, asked: bool, monitored: bool, ring_kept: bool) -> StepPlan:
        """The plan of a step: `selected` by the steps setting, `asked` for by an alarm, `monitored` this step,
        `ring_kept`: the monitor keeps a ring."""
        record = selected or asked
        why = "selected" if selected else "alarm" if asked else "monitored" if monitored else "not selected"
        return cls(step, record=record, monitor=monitored, ring=ring_kept and monitored and not record, why=why)

    @property
    def action(self) -> str:
        """"record", "ring", "monitor" or "nothing"."""
        return "record" if self.record else "ring" if self.ring else "monitor" if self.monitor else "nothing"
