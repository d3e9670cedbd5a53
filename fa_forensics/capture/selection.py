"""What to record: steps, layers, heads, batch slice, micro-batch; and the parsers for their text forms.

Text forms (CLI and the launcher's environment variable):
- steps: "100,200", ranges "100:200:10" (stop exclusive, like Python), mixed "5,10:13".
- layers / heads: "1" or "0,3" (None = every one).
- batch: "0:2" (a slice of dim 0), "3" (one sample), "" or None (the whole batch).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional, Union

from fa_forensics.errors import InvalidSetting, UserError


class CaptureError(UserError):
    """Capture cannot do what was asked (bad selection, unwritable store, writer failure)."""


class InvalidCaptureSetting(InvalidSetting, CaptureError):
    """A capture setting (`.setting`: the keyword of `fa_forensics.capture`, e.g. "heads") that cannot
    work, and why (`.reason`); `.needs`: the settings it cannot work without, if that is the problem.
    `fa-forensics capture` words it with its options' names."""

    def __init__(self, setting: str, reason: str, needs: tuple[str, ...] = ()) -> None:
        self.needs = tuple(needs)
        super().__init__(setting, f"needs {' and '.join(needs)}: {reason}" if needs else reason)
        self.why = reason


class StepSet:
    """A set of step numbers kept as ranges (stop exclusive), never listed: `--steps 0:1000000000000000000` costs
    three numbers, and asking whether a step is in it is arithmetic. Iteration is lazy and ascending."""

    __slots__ = ("_ranges",)

    def __init__(self, ranges: Iterable[range] = ()) -> None:
        kept = (r for r in ranges if r.stop > r.start and r.step > 0)
        self._ranges: tuple[range, ...] = tuple(sorted(kept, key=lambda r: (r.start, r.stop, r.step)))

    @classmethod
    def of(cls, steps: Iterable[int]) -> StepSet:
        """The set of a finite iterable of step numbers (runs of consecutive steps kept as one range)."""
        values = sorted({int(s) for s in steps})
        ranges, start = [], None
        for i, v in enumerate(values):
            if start is None:
                start = v
            if i + 1 == len(values) or values[i + 1] != v + 1:
                ranges.append(range(start, v + 1))
                start = None
        return cls(ranges)

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and any(step in r for r in self._ranges)

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def __iter__(self) -> Iterator[int]:
        last = None
        for step in heapq.merge(*self._ranges):
            if step != last:
                yield step
                last = step

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepSet):
            return self._ranges == other._ranges or set(itertools.islice(self, 10**6)) == set(
                itertools.islice(other, 10**6))
        if isinstance(other, (set, frozenset)):
            return set(itertools.islice(self, len(other) + 1)) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._ranges)

    def __repr__(self) -> str:
        return f"StepSet({self.to_text()!r})"

    def first(self) -> int:
        """The smallest step (ValueError when empty)."""
        return min(r.start for r in self._ranges)

    def below(self, stop: int) -> Iterator[int]:
        """The steps < `stop`, ascending (as many as `stop` bounds)."""
        return itertools.takewhile(lambda s: s < stop, iter(self))

    def from_step(self, start: int) -> StepSet:
        """The steps >= `start`."""
        clipped = []
        for r in self._ranges:
            if r.stop <= start:
                continue
            first = r.start if r.start >= start else r.start + -(-(start - r.start) // r.step) * r.step
            clipped.append(range(first, r.stop, r.step))
        return StepSet(clipped)

    def up_to(self, limit: int) -> list[int]:
        """The first `limit` steps as a list (the whole set when it holds no more)."""
        return list(itertools.islice(self, limit))

    def to_text(self) -> str:
        """The text form `parse_steps` reads back: '5,10:13,20:30:5'."""
        parts = []
        for r in self._ranges:
            if r.start + r.step >= r.stop:
                parts.append(str(r.start))
            else:
                parts.append(f"{r.start}:{r.stop}" + (f":{r.step}" if r.step != 1 else ""))
        return ",".join(parts)


def parse_steps(text: str) -> StepSet:
    """Parse "100,200,300:400:10" into the set of step numbers it names (stop exclusive), kept as ranges."""
    ranges: list[range] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            if ":" in part:
                fields = [int(f) if f.strip() else None for f in part.split(":")]
                if len(fields) not in (2, 3) or fields[0] is None or fields[1] is None:
                    raise ValueError
                start, stop = fields[0], fields[1]
                stride = fields[2] if len(fields) == 3 and fields[2] is not None else 1
                if stride <= 0:
                    raise ValueError
                ranges.append(range(start, stop, stride))
            else:
                ranges.append(range(int(part), int(part) + 1))
        except ValueError:
            raise CaptureError(
                f"bad step selection {part!r} in {text!r}; use numbers and ranges like 100,200 or 100:200:10 (stop "
                "exclusive)"
            ) from None
    steps = StepSet(ranges)
    if not steps or steps.first() < 0:
        raise CaptureError(f"step selection {text!r} selects no step (or a negative one); give steps >= 0 like 5,6,7")
    return steps


def parse_index_list(text: Optional[str], what: str) -> Optional[tuple[int, ...]]:
    """Parse "0,3" into (0, 3); None or "" means every one."""
    if text is None or str(text).strip() in ("", "all"):
        return None
    try:
        values = tuple(sorted({int(p) for p in str(text).split(",") if p.strip()}))
    except ValueError:
        raise CaptureError(f"bad {what} selection {text!r}; give comma-separated indices from 0 like 0,3") from None
    if not values or values[0] < 0:
        raise CaptureError(f"bad {what} selection {text!r}; indices count from 0")
    return values


def parse_batch(text: Optional[str]) -> Optional[slice]:
    """Parse "0:2" into slice(0, 2) and "3" into slice(3, 4); None or "" means the whole batch."""
    if text is None or str(text).strip() in ("", ":", "all"):
        return None
    try:
        if ":" in str(text):
            start, stop = (int(f) if f.strip() else None for f in str(text).split(":"))
            batch = slice(start or 0, stop)
        else:
            index = int(text)
            batch = slice(index, index + 1)
    except ValueError:
        raise CaptureError(f"bad batch selection {text!r}; give a slice like 0:2 or one index like 3") from None
    if batch.start < 0 or (batch.stop is not None and batch.stop <= batch.start):
        raise CaptureError(f"batch selection {text!r} selects no sample; give start:stop with 0 <= start < stop, like "
                           "0:2, or one index like 3")
    return batch


def format_batch(batch: Optional[slice]) -> Optional[str]:
    """The text form of a batch slice (for the store's capture attributes)."""
    if batch is None:
        return None
    return f"{batch.start or 0}:{'' if batch.stop is None else batch.stop}"


Indices = Union[None, int, Iterable[int]]
Steps = Union[None, str, int, StepSet, Iterable[int]]  # what `CaptureSelection.build` reads as steps
LISTED_STEPS = 4096  # a selection of more steps is recorded in the store by its text form


def _as_index_tuple(value: Indices, what: str) -> Optional[tuple[int, ...]]:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_index_list(value, what)
    if isinstance(value, int):
        value = [value]
    values = tuple(sorted({int(v) for v in value}))
    if not values or values[0] < 0:
        raise CaptureError(f"bad {what} selection {value!r}; give indices from 0 (or None for every one)")
    return values


@dataclass(frozen=True)
class CaptureSelection:
    """Which attention calls are recorded, and which part of each.

    steps: step numbers (step k = the iteration before the (k+1)-th optimizer.step()).
    layers: attention-call indices within the recorded forward pass (None = all).
    heads: head indices in dim 1 of (B, H, T, D) (None = all).
    batch: slice of dim 0 (None = the whole batch).
    micro_batch: which forward pass of a step is recorded under gradient accumulation.
    """

    steps: StepSet
    layers: Optional[tuple[int, ...]] = None
    heads: Optional[tuple[int, ...]] = None
    batch: Optional[slice] = None
    micro_batch: int = 0

    @classmethod
    def build(cls, steps: Steps, layers: Indices = None, heads: Indices = None,
              batch: Union[None, str, int, slice] = None, micro_batch: int = 0,
              allow_no_steps: bool = False) -> CaptureSelection:
        """Normalize user values (text or Python) into a selection, with one-line errors.

        allow_no_steps: an empty step selection is fine (the monitor, an alarm or the ring decide what is written).
        """
        if steps is not None and not isinstance(steps, (str, int, StepSet)):
            steps = list(steps)
        if allow_no_steps and (steps is None or (isinstance(steps, str) and not steps.strip()) or steps == []):
            step_set = StepSet()
        elif isinstance(steps, StepSet):
            step_set = steps
        elif isinstance(steps, str):
            step_set = parse_steps(steps)
        elif isinstance(steps, int):
            step_set = StepSet.of([steps])
        else:
            step_set = StepSet.of(steps or ())
            if not step_set or step_set.first() < 0:
                raise CaptureError(f"capture needs at least one step >= 0 to record, got {steps!r}")
        if isinstance(batch, str) or batch is None:
            batch = parse_batch(batch)
        elif isinstance(batch, int):
            batch = slice(batch, batch + 1)
        elif not isinstance(batch, slice) or batch.step not in (None, 1):
            raise CaptureError(f"bad batch selection {batch!r}; give a slice like slice(0, 2)")
        else:
            batch = parse_batch(format_batch(batch))  # the same checks as the text form
        if int(micro_batch) < 0:
            raise CaptureError(f"micro_batch must be >= 0, got {micro_batch}")
        return cls(step_set, _as_index_tuple(layers, "layer"), _as_index_tuple(heads, "head"), batch, int(micro_batch))

    def wants_step(self, step: int) -> bool:
        return step in self.steps

    def wants_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def to_attrs(self) -> dict:
        """The selection as JSON-ready store attributes (steps listed when there are at most LISTED_STEPS, else
        in their text form)."""
        listed = self.steps.up_to(LISTED_STEPS + 1)
        return {
            "steps": listed if len(listed) <= LISTED_STEPS else self.steps.to_text(),
            "layers": None if self.layers is None else list(self.layers),
            "heads": None if self.heads is None else list(self.heads),
            "batch": format_batch(self.batch),
            "micro_batch": self.micro_batch,
        }

    def to_text(self) -> dict:
        """The selection in its text form (what the launcher passes through the environment)."""
        return {
            "steps": self.steps.to_text(),
            "layers": None if self.layers is None else ",".join(map(str, self.layers)),
            "heads": None if self.heads is None else ",".join(map(str, self.heads)),
            "batch": format_batch(self.batch),
            "micro_batch": self.micro_batch,
        }


def check_attention_pattern(pattern: str) -> None:
    """InvalidCaptureSetting("attention_modules") for a module-name regex that does not compile."""
    import re

    try:
        re.compile(pattern)
    except (re.error, TypeError) as exc:
        raise InvalidCaptureSetting("attention_modules",
                                    f"{pattern!r} is not a valid regular expression ({exc}); e.g. 'attn$'") from None


def check_monitor_options(monitor_every: Optional[int], alarm: object, alarm_steps: int, ring: int) -> None:
    """InvalidCaptureSetting for monitor settings that cannot work (together)."""
    if monitor_every is not None and (not isinstance(monitor_every, int) or monitor_every < 1):
        raise InvalidCaptureSetting("monitor_every", f"must be a step interval >= 1, got {monitor_every!r}")
    if alarm and not monitor_every:
        raise InvalidCaptureSetting("alarm", "the alarm watches the monitor's statistics (e.g. every step: 1)",
                                    needs=("monitor_every",))
    if int(alarm_steps) < 0:
        raise InvalidCaptureSetting("alarm_steps", f"must be >= 0, got {alarm_steps}")
    if int(ring) < 0:
        raise InvalidCaptureSetting("ring", f"must be >= 0 steps, got {ring}")
    if ring and not alarm:
        raise InvalidCaptureSetting("ring", "the ring keeps recent steps for the alarm to write",
                                    needs=("alarm", "monitor_every"))


def check_tensorboard_option(monitor_every: Optional[int], tensorboard: Optional[str]) -> None:
    """InvalidCaptureSetting for TensorBoard output without the monitor that fills it."""
    if tensorboard is not None and not monitor_every:
        raise InvalidCaptureSetting("monitor_tensorboard", "TensorBoard gets the monitor's timeline rows",
                                    needs=("monitor_every",))
