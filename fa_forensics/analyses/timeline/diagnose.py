"""Which training instability a monitored timeline shows, from its arrays alone: a pure function to a frozen
`InstabilityFinding` (the mechanism, its evidence numbers, where and the step it started, the action it supports).

The mechanisms the literature describes (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
training instabilities"; Dehghani et al. 2023, qk-layernorm), each read against the run's own early values:
- attention-logit growth: a head's max logit rises to many times its early value (and to a size at which the
  softmax is one-hot), and stays there; its top-1 probability goes to 1 (attention-entropy collapse);
- attention-entropy collapse alone: the top-1 probability (or the entropy) of a head that started spread out
  saturates, and the loss jumps after it;
- output-logit divergence: the log-sum-exp of the language-model head's logits (`output_lse`) drifts away from
  its early value;
- an optimizer or learning-rate blow-up: the loss jumps with W_Q's norm (or every indicator) jumping in the same
  step, and no attention or output precursor before it;
- a loss spike the timeline does not explain (no precursor, no parameter jump).
Whichever started first is the mechanism named; the others found are listed in `also`. A series the timeline does
not hold is missing evidence (`missing`), never a zero.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np

EARLY_STEPS = 5  # the run's early values: the median of its first monitored steps (at most a tenth of them)
LOGIT_GROWTH = 10.0  # a grown max logit: at least this many times the head's early value ...
LOGIT_FLOOR = 50.0  # ... and at least this large (a logit gap of 50 leaves e^-50 to the other keys)
SUSTAINED = 3  # monitored steps a change must last (fewer where the run ends first)
COLLAPSE_TOP1 = 0.99  # mean top-1 probability of a collapsed head ...
SPREAD_TOP1 = 0.9  # ... that started below this
COLLAPSE_ENTROPY = 0.05  # nats: attention entropy of a collapsed head ...
SPREAD_ENTROPY = 0.5  # ... that started above this
LSE_RISE = 10.0  # nats: output log-sum-exp drift counted as divergence, at least, ...
LSE_FACTOR = 3.0  # ... and at least (this − 1) × its early magnitude
LOSS_RISE = 0.5  # nats above the median of the trailing window: a loss spike
LOSS_WINDOW = 20
JUMP = 2.0  # a one-step rise by this factor ...
JUMP_SHARE = 0.5  # ... in at least this share of the heads: every indicator jumping at once

# The mechanisms, each with the action it supports.
ACTIONS = {
    "attention-logit-growth": "add qk-layernorm (a LayerNorm on each head's queries and keys), or lower the learning "
                              "rate / lengthen its warm-up",
    "attention-entropy-collapse": "add qk-layernorm, or lower the learning rate / lengthen its warm-up",
    "output-logit-divergence": "add a z-loss (about 1e-4 · log-sum-exp² of the output logits), or lower the output "
                               "layer's learning rate",
    "optimizer-blow-up": "lengthen the learning-rate warm-up or lower the learning rate, and clip the gradient norm",
    "loss-spike": "look at the data and the update of the step where the loss jumped: the timeline shows no precursor",
    "none": "",
    "no-evidence": "",
}
NAMES = {
    "attention-logit-growth": "attention-logit growth",
    "attention-entropy-collapse": "attention-entropy collapse",
    "output-logit-divergence": "output-logit divergence",
    "optimizer-blow-up": "an optimizer or learning-rate blow-up",
    "loss-spike": "a loss spike without a precursor",
    "none": "no instability",
    "no-evidence": "no evidence",
}


@dataclass(frozen=True)
class InstabilityFinding:
    """The mechanism a timeline shows and its evidence."""

    mechanism: str  # a key of ACTIONS
    step: Optional[int]  # the monitored step it started (None: nothing started)
    layer: Optional[int]
    head: Optional[int]
    evidence: tuple[tuple[str, float], ...]  # named numbers, e.g. ("early max logit", 0.05)
    loss_spike_step: Optional[int]  # the first loss spike (None: none)
    also: tuple[str, ...] = ()  # other mechanisms with evidence, in the order they started
    missing: tuple[str, ...] = ()  # series the timeline does not hold

    @property
    def found(self) -> bool:
        return self.mechanism not in ("none", "no-evidence")

    @property
    def name(self) -> str:
        return NAMES[self.mechanism]

    @property
    def action(self) -> str:
        return ACTIONS[self.mechanism]

    def number(self, name: str) -> float:
        return dict(self.evidence).get(name, float("nan"))

    def to_json(self) -> dict:
        return {"mechanism": self.mechanism, "name": self.name, "found": self.found, "step": self.step,
                "layer": self.layer, "head": self.head,
                "evidence": {k: (float(v) if np.isfinite(v) else None) for k, v in self.evidence},
                "loss_spike_step": self.loss_spike_step, "action": self.action, "also": list(self.also),
                "missing": list(self.missing), "summary": summary(self)}


@dataclass(frozen=True)
class _Onset:
    mechanism: str
    step: int
    index: int
    layer: Optional[int]
    head: Optional[int]
    evidence: tuple[tuple[str, float], ...]


def _early(x: np.ndarray) -> np.ndarray:
    """The median over the first monitored steps of each series (axis 0), ignoring non-finite values."""
    k = max(1, min(EARLY_STEPS, len(x) // 10))
    head = np.where(np.isfinite(x[:k]), x[:k], np.nan)
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmedian(head, axis=0)


def _first_sustained(mask: np.ndarray) -> Optional[int]:
    """The first index from which `mask` (1-D) holds for SUSTAINED steps (or to the end of the run)."""
    n = len(mask)
    for i in np.flatnonzero(mask):
        end = min(n, i + SUSTAINED)
        if mask[i:end].all():
            return int(i)
    return None


def _heads(x: np.ndarray) -> list[tuple[int, int]]:
    return [(layer, head) for layer in range(x.shape[1]) for head in range(x.shape[2])]


def _logit_growth(steps, max_logit, top1, entropy) -> Optional[_Onset]:
    base = _early(max_logit)
    best = None
    for layer, head in _heads(max_logit):
        v = max_logit[:, layer, head]
        b = base[layer, head]
        if not np.isfinite(b):
            continue
        threshold = max(LOGIT_GROWTH * abs(b), LOGIT_FLOOR)
        i = _first_sustained(np.isfinite(v) & (v > threshold))
        if i is None:
            continue
        peak = float(np.nanmax(np.where(np.isfinite(v), v, np.nan)))
        if best is None or (i, -peak) < (best.index, -dict(best.evidence)["peak max logit"]):
            evidence = [("early max logit", float(b)), ("max logit at onset", float(v[i])),
                        ("peak max logit", peak), ("growth", peak / abs(b) if b else float("inf"))]
            evidence += _attention_state(top1, entropy, layer, head, i)
            best = _Onset("attention-logit-growth", int(steps[i]), i, layer, head, tuple(evidence))
    return best


def _attention_state(top1, entropy, layer, head, i) -> list[tuple[str, float]]:
    """The head's early and latest top-1 probability (and entropy) beside a logit finding."""
    out = []
    for name, x in (("top-1 probability", top1), ("attention entropy", entropy)):
        if x is None:
            continue
        v = x[:, layer, head]
        finite = np.flatnonzero(np.isfinite(v))
        if len(finite):
            out += [(f"early {name}", float(_early(v[:, None])[0])), (f"last {name}", float(v[finite[-1]]))]
    return out


def _collapse(steps, top1, entropy) -> Optional[_Onset]:
    best = None
    for name, x, collapsed, spread in (("top-1 probability", top1, lambda v: v >= COLLAPSE_TOP1,
                                        lambda b: b < SPREAD_TOP1),
                                       ("attention entropy", entropy, lambda v: v <= COLLAPSE_ENTROPY,
                                        lambda b: b > SPREAD_ENTROPY)):
        if x is None:
            continue
        base = _early(x)
        for layer, head in _heads(x):
            v, b = x[:, layer, head], base[layer, head]
            if not (np.isfinite(b) and spread(b)):
                continue
            with np.errstate(invalid="ignore"):
                i = _first_sustained(np.isfinite(v) & collapsed(v))
            if i is not None and (best is None or i < best.index):
                best = _Onset("attention-entropy-collapse", int(steps[i]), i, layer, head,
                              ((f"early {name}", float(b)), (f"{name} at onset", float(v[i]))))
    return best


def _output_divergence(steps, lse) -> Optional[_Onset]:
    if lse is None:
        return None
    b = float(_early(lse[:, None])[0])
    if not np.isfinite(b):
        return None
    rise = max(LSE_RISE, (LSE_FACTOR - 1.0) * abs(b))
    with np.errstate(invalid="ignore"):
        i = _first_sustained(np.isfinite(lse) & (np.abs(lse - b) > rise))
    if i is None:
        return None
    finite = lse[np.isfinite(lse)]
    far = float(finite[np.argmax(np.abs(finite - b))])
    return _Onset("output-logit-divergence", int(steps[i]), i, None, None,
                  (("early output log-sum-exp", b), ("output log-sum-exp at onset", float(lse[i])),
                   ("farthest output log-sum-exp", far)))


def loss_spike(loss: np.ndarray, start: int = 1) -> Optional[int]:
    """The index (from `start` on) of the first monitored step whose loss is not finite (after finite values), or from
    which it exceeds the median of the window before it by more than LOSS_RISE nats for SUSTAINED steps (or to the
    run's end); None when there is none. One hard batch whose loss falls back at once is not a spike."""
    for t in range(max(1, start), len(loss)):
        before = loss[max(0, t - LOSS_WINDOW):t]
        before = before[np.isfinite(before)]
        if not len(before):
            continue
        if not np.isfinite(loss[t]):  # a non-finite loss is a failure, never one hard batch
            return t
        after = loss[t:t + SUSTAINED]
        with np.errstate(invalid="ignore"):
            if (~np.isfinite(after) | (after > float(np.median(before)) + LOSS_RISE)).all():
                return t
    return None


def _jumped(x: Optional[np.ndarray], t: int) -> float:
    """The share of heads whose value rose JUMP-fold (or turned non-finite) from index t − 1 to t."""
    if x is None or t < 1:
        return 0.0
    prev, now = x[t - 1].ravel(), x[t].ravel()
    ok = np.isfinite(prev) & (prev > 0)
    if not ok.any():
        return 0.0
    with np.errstate(all="ignore"):
        rose = ~np.isfinite(now[ok]) | (now[ok] >= JUMP * prev[ok])
    return float(rose.mean())


def diagnose(step, loss=None, max_logit=None, top1_prob=None, wq_sigma=None, near_max_ties=None,
             attn_entropy=None, output_lse=None) -> InstabilityFinding:
    """The instability a timeline shows. Arrays as the timeline stores them: step, loss, output_lse (S,); the
    others (S, L, H). Any but `step` may be None (missing evidence)."""
    steps = np.asarray(step)
    arrays = {"loss": loss, "max_logit": max_logit, "top1_prob": top1_prob, "wq_sigma": wq_sigma,
              "near_max_ties": near_max_ties, "attn_entropy": attn_entropy, "output_lse": output_lse}
    arrays = {k: None if v is None else np.asarray(v, dtype=np.float64) for k, v in arrays.items()}
    missing = tuple(k for k, v in arrays.items() if v is None or v.size == 0 or len(v) != len(steps))
    a = {k: (None if k in missing else v) for k, v in arrays.items()}
    if not len(steps) or (a["loss"] is None and a["max_logit"] is None and a["output_lse"] is None):
        return InstabilityFinding("no-evidence", None, None, None, (), None, missing=missing)
    spike = loss_spike(a["loss"]) if a["loss"] is not None else None
    spike_step = None if spike is None else int(steps[spike])
    growth = _logit_growth(steps, a["max_logit"], a["top1_prob"], a["attn_entropy"]) \
        if a["max_logit"] is not None else None
    collapse = _collapse(steps, a["top1_prob"], a["attn_entropy"])
    if collapse is not None and (spike is None or spike <= collapse.index):
        collapse = None  # a sharp head the loss never suffered from is learning, not a failure
    output = _output_divergence(steps, a["output_lse"])
    onsets = sorted((o for o in (growth, collapse, output) if o is not None),
                    key=lambda o: (o.index, o.mechanism != "attention-logit-growth"))
    if growth is not None and collapse is not None and collapse.layer == growth.layer and collapse.head == growth.head:
        onsets = [o for o in onsets if o is not collapse]  # one head: the collapse is the growth's consequence
    jump = max(_jumped(a["wq_sigma"], spike), _jumped(a["max_logit"], spike)) if spike is not None else 0.0
    precursor = [o for o in onsets if spike is None or o.index < spike]
    spike_evidence: tuple[tuple[str, float], ...] = ()
    if spike is not None:
        before = a["loss"][max(0, spike - LOSS_WINDOW):spike]
        spike_evidence = (("loss before the spike", float(np.median(before[np.isfinite(before)]))),
                          ("loss at the spike", float(a["loss"][spike])))
    if spike is not None and not precursor and jump >= JUMP_SHARE:
        evidence = (*spike_evidence, ("share of heads jumping at the spike", jump),
                    *((("W_Q norm jump", _ratio(a["wq_sigma"], spike)),) if a["wq_sigma"] is not None else ()))
        return InstabilityFinding("optimizer-blow-up", spike_step, None, None, evidence, spike_step,
                                  tuple(o.mechanism for o in onsets), missing)
    if onsets:
        first = onsets[0]
        lead = (("steps from onset to the loss spike", float(spike_step - first.step)),) \
            if spike is not None and first.index < spike else ()
        return InstabilityFinding(first.mechanism, first.step, first.layer, first.head,
                                  (*first.evidence, *spike_evidence, *lead), spike_step,
                                  tuple(o.mechanism for o in onsets[1:]), missing)
    if spike is not None:
        return InstabilityFinding("loss-spike", spike_step, None, None,
                                  (*spike_evidence, ("share of heads jumping at the spike", jump)), spike_step,
                                  (), missing)
    return InstabilityFinding("none", None, None, None, (), None, (), missing)


def _ratio(x: np.ndarray, t: int) -> float:
    """The largest one-step rise factor over heads from index t − 1 to t."""
    with np.errstate(all="ignore"):
        r = x[t] / x[t - 1]
    r = r[np.isfinite(r)]
    return float(r.max()) if r.size else float("nan")


def diagnose_timeline(timeline: Mapping[str, np.ndarray]) -> InstabilityFinding:
    """`diagnose` over the arrays of a dump's timeline (`Dump.timeline`)."""
    names = ("loss", "max_logit", "top1_prob", "wq_sigma", "near_max_ties", "attn_entropy", "output_lse")
    return diagnose(timeline["step"], **{n: timeline.get(n) for n in names})


def _num(x: float) -> str:
    return f"{x:.3g}" if np.isfinite(x) else "n/a"


def _loss(x: float) -> str:
    return f"{x:.3g}" if np.isfinite(x) else "a non-finite value"


def summary(f: InstabilityFinding) -> str:
    """One sentence: the mechanism, where and when it started, its evidence."""
    where = f" in layer {f.layer} head {f.head}" if f.layer is not None else ""
    spike = (f"; the loss jumped at step {f.loss_spike_step} ({_num(f.number('loss before the spike'))} → "
             f"{_loss(f.number('loss at the spike'))})" if f.loss_spike_step is not None else "")
    if f.mechanism == "attention-logit-growth":
        text = (f"attention-logit growth{where} from step {f.step}: its max logit rose from "
                f"{_num(f.number('early max logit'))} early in the run to {_num(f.number('peak max logit'))} "
                f"({_num(f.number('growth'))}×)")
        if np.isfinite(f.number("last top-1 probability")):
            text += (f", its mean top-1 probability from {_num(f.number('early top-1 probability'))} to "
                     f"{_num(f.number('last top-1 probability'))}")
        return text + spike
    if f.mechanism == "attention-entropy-collapse":
        name = "top-1 probability" if np.isfinite(f.number("early top-1 probability")) else "attention entropy"
        return (f"attention-entropy collapse{where} from step {f.step}: its {name} went from "
                f"{_num(f.number(f'early {name}'))} to {_num(f.number(f'{name} at onset'))}{spike}")
    if f.mechanism == "output-logit-divergence":
        return (f"output-logit divergence from step {f.step}: the log-sum-exp of the output logits went from "
                f"{_num(f.number('early output log-sum-exp'))} early in the run to "
                f"{_num(f.number('farthest output log-sum-exp'))}{spike}")
    if f.mechanism == "optimizer-blow-up":
        return (f"an optimizer or learning-rate blow-up at step {f.step}: the loss jumped "
                f"({_num(f.number('loss before the spike'))} → {_loss(f.number('loss at the spike'))}) with "
                f"{f.number('share of heads jumping at the spike'):.0%} of the heads' W_Q norm or max logit jumping "
                f"{JUMP:g}-fold in the same step, and no attention or output precursor")
    if f.mechanism == "loss-spike":
        return (f"the loss jumped at step {f.step} ({_num(f.number('loss before the spike'))} → "
                f"{_loss(f.number('loss at the spike'))}) with no attention or output precursor and no parameter "
                "jump in the timeline")
    if f.mechanism == "none":
        return "no instability in the timeline: no attention-logit growth, entropy collapse, output-logit drift or " \
               "loss spike"
    return "the timeline holds neither a loss nor attention statistics to diagnose"
