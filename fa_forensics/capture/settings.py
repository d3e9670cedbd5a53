"""Every option of a capture in one frozen dataclass: its default, its checks and its JSON form.

`CaptureSettings` is what `fa_forensics.capture(**options)`, `fa-forensics capture`, `demo-train` and the
launcher's processes (through the environment variable, `to_json` / `from_json`) hand to a `CaptureSession`.
Importing it is light (no torch): the commands read their option defaults from it.
Values are given in any form the library accepts (text like "100:200:10" or Python values) and kept
normalized: steps a `StepSet`, layers and heads tuples, batch a slice, the alarm its `AlarmSettings`, custom
attention its `TargetSpec`s, softmax a `SoftmaxVariant`. A value that cannot work raises
`InvalidCaptureSetting` (or `CaptureError`) at construction, in one line.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Optional

from fa_forensics.capture.selection import (
    CaptureError, CaptureSelection, check_attention_pattern, check_monitor_options, check_tensorboard_option,
    format_batch,
)
from fa_forensics.capture.softmax_variant import SoftmaxVariant

if TYPE_CHECKING:
    from fa_forensics.monitor.alarm import AlarmRule
    from fa_forensics.monitor.alarm_settings import AlarmSettings

# Attention modules by name: `<blocks>.<i>.<attn>` (nanoGPT, Hugging Face GPT-2 / Llama / Mistral / Qwen,
# TransformerLens, also under DDP's `module.` and torch.compile's `_orig_mod.`; capture/modules.py).
DEFAULT_ATTENTION_PATTERN = r"(^|\.)(h|layers|blocks|layer)\.\d+\.(attn|self_attn|attention|self_attention)$"

STEP_BY = ("optimizer", "manual")


@dataclass(frozen=True)
class CaptureSettings:
    """What a capture records and how: the keyword arguments of `fa_forensics.capture`, each default written here.

    out: the dump store. steps / layers / heads / batch / micro_batch: the selection (capture/selection.py).
    attention_modules: regex over module names marking attention modules (their input is X).
    step_by: "optimizer" (a global optimizer.step() post-hook counts steps) or "manual" (cap.step() does).
    overwrite / allow_other_model: replace a store at `out`, add steps to one that holds another model's.
    max_queue: arrays of selected steps that may wait for the disk before training waits. max_held_mb: memory
      the ring's and an alarm's steps may hold waiting for the disk. writer_duty: the share of time the writer
      thread may write while little waits (1 writes at full speed).
    keep_sdpa_patch: leave the SDPA patch in place after the session (the launcher's processes).
    monitor_every / alarm / alarm_steps / ring / monitor_tensorboard / monitor_eps / timeline_flush_rows: the
      training monitor (capture/monitoring.py, docs/monitor.md).
    attention: custom entry points to watch (`MODULE:QUALNAME,layout=BTHD,...`); softmax: the variant
      custom attention computes ("standard", "stabilized" or "ENV=VALUE").
    run_id: shared by the ranks of one run; orders their opening of the store.
    """

    out: str = "run.zarr"
    steps: Any = (0,)
    layers: Any = None
    heads: Any = None
    batch: Any = "0:2"
    micro_batch: int = 0
    attention_modules: str = DEFAULT_ATTENTION_PATTERN
    step_by: str = "optimizer"
    overwrite: bool = False
    allow_other_model: bool = False
    max_queue: int = 64
    max_held_mb: float = 256.0
    writer_duty: float = 0.1
    keep_sdpa_patch: bool = False
    monitor_every: Optional[int] = None
    alarm: Any = False
    alarm_steps: int = 3
    ring: int = 0
    monitor_tensorboard: Optional[str] = None
    monitor_eps: float = 1e-3
    timeline_flush_rows: int = 16
    attention: Any = ()
    softmax: Any = None
    run_id: Optional[str] = None

    def __post_init__(self) -> None:
        """Check every value and keep it normalized (the one place capture settings are checked)."""
        def keep(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if self.step_by not in STEP_BY:
            raise CaptureError(f"step_by must be 'optimizer' or 'manual', got {self.step_by!r}")
        check_monitor_options(self.monitor_every, self.alarm, self.alarm_steps, self.ring)
        check_tensorboard_option(self.monitor_every, self.monitor_tensorboard)
        if int(self.timeline_flush_rows) < 1:
            raise CaptureError("timeline_flush_rows must be >= 1 (timeline rows appended at a time), got "
                               f"{self.timeline_flush_rows}")
        check_attention_pattern(self.attention_modules)
        from fa_forensics.capture.targets import TargetSpec  # imports torch: only when settings are made

        targets = tuple(t if isinstance(t, TargetSpec) else TargetSpec.parse(t) for t in (self.attention or ()))
        softmax = self.softmax if isinstance(self.softmax, SoftmaxVariant) else SoftmaxVariant.parse(self.softmax)
        selection = CaptureSelection.build(self.steps, self.layers, self.heads, self.batch, self.micro_batch,
                                           allow_no_steps=bool(self.monitor_every))
        if not float(self.max_held_mb) > 0:
            raise CaptureError(f"max_held_mb must be a positive number of megabytes, got {self.max_held_mb}")
        if not 0 < float(self.writer_duty) <= 1:
            raise CaptureError(f"writer_duty must be in (0, 1] (the share of time the writer may write), got "
                               f"{self.writer_duty}")
        keep("out", os.fspath(self.out))
        for name in ("steps", "layers", "heads", "batch", "micro_batch"):
            keep(name, getattr(selection, name))
        keep("attention", targets)
        keep("softmax", softmax)
        keep("alarm", _alarm_settings(self.alarm))
        keep("alarm_steps", int(self.alarm_steps))
        keep("ring", int(self.ring))
        keep("max_queue", int(self.max_queue))
        keep("max_held_mb", float(self.max_held_mb))
        keep("writer_duty", float(self.writer_duty))
        keep("timeline_flush_rows", int(self.timeline_flush_rows))
        keep("monitor_eps", float(self.monitor_eps))
        keep("attention_modules", str(self.attention_modules))
        keep("overwrite", bool(self.overwrite))
        keep("allow_other_model", bool(self.allow_other_model))
        keep("keep_sdpa_patch", bool(self.keep_sdpa_patch))
        if self.monitor_tensorboard is not None:
            keep("monitor_tensorboard", os.fspath(self.monitor_tensorboard))

    @property
    def selection(self) -> CaptureSelection:
        """Which attention calls are recorded, and which part of each."""
        return CaptureSelection(self.steps, self.layers, self.heads, self.batch, self.micro_batch)

    def alarm_rule(self) -> Optional[AlarmRule]:
        """A fresh alarm rule of these settings (None without an alarm)."""
        from fa_forensics.monitor.alarm import AlarmRule

        return None if self.alarm is None else AlarmRule(self.alarm)

    def replace(self, **changes: Any) -> CaptureSettings:
        """A checked copy with `changes`."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """The settings in their text forms, JSON-ready (what `from_dict` reads back)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                **self.selection.to_text(),
                "batch": format_batch(self.batch),
                "attention": [t.to_text() for t in self.attention],
                "softmax": self.softmax.to_text(),
                "alarm": None if self.alarm is None else self.alarm.to_dict()}

    def to_json(self) -> str:
        """The settings as one JSON object (the form that travels to a launched script)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, values: dict) -> CaptureSettings:
        """Settings from `to_dict`'s form (keys left out take their defaults); CaptureError for an unknown key."""
        if not isinstance(values, dict):
            raise CaptureError(f"capture settings must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise CaptureError(f"unknown capture setting(s) {', '.join(map(repr, unknown))}; known: "
                               f"{', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> CaptureSettings:
        """Settings from `to_json`'s text; CaptureError (one line) for text that is not such an object."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CaptureError(f"capture settings are not valid JSON ({exc})") from None
        return cls.from_dict(values)


def default_of(name: str) -> Any:
    """The default of one setting as declared (before normalization), for option declarations."""
    return next(f.default for f in fields(CaptureSettings) if f.name == name)


def _alarm_settings(alarm: object) -> Optional[AlarmSettings]:
    """The alarm's settings: False/None = no alarm, True = the defaults, an AlarmRule, AlarmSettings or a dict of
    settings (as `AlarmRule.settings()` gives; checked)."""
    if alarm is None or alarm is False:
        return None
    from fa_forensics.monitor.alarm import rule_from_settings

    rule = rule_from_settings(alarm)
    return None if rule is None else rule.config
