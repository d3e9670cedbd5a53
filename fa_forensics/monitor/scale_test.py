"""The alarm rule's scale test: a value against the run's own early values, not against a trailing window.

A trailing window moves with a slow drift, and a warm-up delays every alarm by its length; attention
logits that grow from the first steps on (Wortsman et al. 2023: attention-logit growth without
qk-layernorm) are already far from where they started when the warm-up ends. This test compares each
cell with its reference, the median of its first `reference_steps` finite monitored values, and alarms
when, for `scale_persist` consecutive monitored steps:
- max_logit: the max logit is at least `logit_ratio` × its reference and `logit_rise` logits above it
  (both: a ratio alone fires on heads that start near 0, a rise alone on runs whose logits start large);
- attn_entropy (softmax saturation): the mean top-1 probability is at least `saturation_top1` and the
  mean attention entropy has fallen to `entropy_fraction` × its reference or below (the head attends to
  one key on nearly every row, and did not at the start);
- output_lse: the mean log-sum-exp of the output logits is `output_lse_rise` nats or more away from its
  reference, either way (output-logit divergence; z-loss keeps it near 0).
Like the other tests it alarms once per excursion.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

SCALED = ("max_logit", "attn_entropy", "output_lse")


class ScaleTest:
    """The scale test's state for one metric over all its cells ((L, H), or () for output_lse)."""

    def __init__(self, metric: str, shape: tuple, reference_steps: int):
        self.metric, self.shape = metric, shape
        self.early = np.full((int(reference_steps), *shape), np.nan)
        self.count = np.zeros(shape, dtype=np.int64)  # finite values kept in `early`
        self.streak = np.zeros(shape, dtype=np.int64)
        self.alarmed = np.zeros(shape, dtype=bool)
        self._reference: Optional[np.ndarray] = None

    def reference(self) -> np.ndarray:
        """Each cell's reference (NaN until it has `reference_steps` finite values); computed again only on a step
        that added a value to some cell's early values (it is fixed once they are all full)."""
        if self._reference is None:
            with np.errstate(all="ignore"):
                self._reference = np.where(self.count >= self.early.shape[0], np.median(self.early, axis=0), np.nan)
        return self._reference

    def observe(self, x: np.ndarray, s, top1: Optional[np.ndarray] = None) -> list[tuple]:
        """Feed one value per cell; [(index, reference)] for the cells that alarm now."""
        x = np.asarray(x, dtype=np.float64)
        ref = self.reference()
        with np.errstate(all="ignore"):
            if self.metric == "max_logit":
                out = (x >= ref * s.logit_ratio) & (x - ref >= s.logit_rise)
            elif self.metric == "attn_entropy":
                t = np.full(self.shape, np.nan) if top1 is None else np.asarray(top1, dtype=np.float64)
                out = (t >= s.saturation_top1) & (x <= ref * s.entropy_fraction)
            else:
                out = np.abs(x - ref) >= s.output_lse_rise
        out = out & np.isfinite(x) & np.isfinite(ref)
        filling = np.isfinite(x) & (self.count < self.early.shape[0])
        if filling.any():
            slot = np.minimum(self.count, self.early.shape[0] - 1)
            idx = np.nonzero(filling) if self.shape else ()
            if self.shape:
                self.early[(slot[idx], *idx)] = x[idx]
            else:
                self.early[int(slot)] = x
            self.count = self.count + filling
            self._reference = None
        self.streak = np.where(out, self.streak + 1, 0)
        fire = (self.streak >= s.scale_persist) & ~self.alarmed
        self.alarmed = (self.alarmed & out) | fire
        cells = list(zip(*np.nonzero(fire))) if self.shape else ([()] if bool(fire) else [])
        return [(index, float(ref[index])) for index in cells]
