"""What to record: steps, layers, heads, batch slice, micro-batch; and the parsers for their text forms.

Text forms (CLI and the launcher's environment variable):
- steps: "100,200", ranges "100:200:10" (stop exclusive, like Python), mixed "5,10:13".
- layers / heads: "1" or "0,3" (None = every one).
- batch: "0:2" (a slice of dim 0), "3" (one sample), "" or None (the whole batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
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


def parse_steps(text: str) -> frozenset[int]:
    """Parse "100,200,300:400:10" into a set of step numbers (stop exclusive)."""
    steps: set[int] = set()
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
                steps.update(range(start, stop, stride))
            else:
                steps.add(int(part))
        except ValueError:
            raise CaptureError(
                f"bad step selection {part!r} in {text!r}; use numbers and ranges like 100,200 or 100:200:10 (stop "
                "exclusive)"
            ) from None
    if not steps or min(steps) < 0:
        raise CaptureError(f"step selection {text!r} selects no step (or a negative one); give steps >= 0 like 5,6,7")
    return frozenset(steps)


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

    steps: frozenset[int]
    layers: Optional[tuple[int, ...]] = None
    heads: Optional[tuple[int, ...]] = None
    batch: Optional[slice] = None
    micro_batch: int = 0

    @classmethod
    def build(cls, steps, layers: Indices = None, heads: Indices = None, batch=None, micro_batch: int = 0,
              allow_no_steps: bool = False) -> CaptureSelection:
        """Normalize user values (text or Python) into a selection, with one-line errors.

        allow_no_steps: an empty step selection is fine (the monitor, an alarm or the ring decide what is written).
        """
        if steps is not None and not isinstance(steps, (str, int)):
            steps = list(steps)
        if allow_no_steps and (steps is None or (isinstance(steps, str) and not steps.strip()) or steps == []):
            step_set = frozenset()
        elif isinstance(steps, str):
            step_set = parse_steps(steps)
        elif isinstance(steps, int):
            step_set = frozenset([steps])
        else:
            step_set = frozenset(int(s) for s in (steps or ()))
            if not step_set or min(step_set) < 0:
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
        """The selection as JSON-ready store attributes."""
        return {
            "steps": sorted(self.steps),
            "layers": None if self.layers is None else list(self.layers),
            "heads": None if self.heads is None else list(self.heads),
            "batch": format_batch(self.batch),
            "micro_batch": self.micro_batch,
        }

    def to_text(self) -> dict:
        """The selection in its text form (what the launcher passes through the environment)."""
        return {
            "steps": ",".join(str(s) for s in sorted(self.steps)),
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


def check_monitor_options(monitor_every, alarm, alarm_steps, ring) -> None:
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
