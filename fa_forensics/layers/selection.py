"""The shared dump-selection and replay layer of every analysis.

`select` turns the CLI's (--step, --layer, --head) into validated (step, layer, heads) triples;
`load` reads one layer-step with all selected heads batched (one read per tensor, never head by
head) and runs every registered layer check, whose messages become the layer's `warnings`;
`replay_layer` replays it under a config with the dump's own softmax scale and causal flag;
`as_seen_by` rounds the inputs to what a config sees. The recipe side (which config to replay)
is fidelity's (`fidelity.pair.lp_hp_pair`); this layer only takes configs.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from fa_forensics.enums import Backend
from fa_forensics.errors import DumpError, NothingSelected
from fa_forensics.layers.checks import with_checks
from fa_forensics.layers.finite import finite_x, screen
from fa_forensics.replay.config import ReplayConfig

BatchSel = Union[int, slice, None]


@dataclass(frozen=True)
class LayerSelection:
    """One layer of one step and the heads of it to analyse."""

    step: int
    layer: int
    heads: list[int]


@dataclass(frozen=True)
class LayerTensors:
    """One layer-step as stored, selected heads batched in dim 1.

    q, k, v, o, do: (B, h, T, D) in the dtype training used (o / do None when not captured);
    x: (B, T, C) the attention module's input, or None; scale α and the causal flag from the dump;
    mask: SDPA's attn_mask as captured, broadcastable to (B, h, T, Tk) (bool, True = may attend, or
    an additive float bias), or None; every replay of the layer applies it.
    """

    step: int
    layer: int
    heads: list[int]
    q: torch.Tensor  # (B, h, T, D)
    k: torch.Tensor  # (B, h, T, D)
    v: torch.Tensor  # (B, h, T, D)
    o: Optional[torch.Tensor]  # (B, h, T, D)
    do: Optional[torch.Tensor]  # (B, h, T, D)
    x: Optional[torch.Tensor]  # (B, T, C)
    scale: float
    causal: bool
    warnings: tuple[str, ...] = ()  # one line each, from the registered layer checks
    source: object = None  # the Dump it was read from (None when built in memory)
    mask: Optional[torch.Tensor] = None  # (B or 1, h or 1, T, Tk)
    # (batch, heads) of the layer as stored, whatever was selected: what a kernel's launch heuristics read
    # (the memory-efficient backward's key splits); None: the tensors' own
    launch: Optional[tuple[int, int]] = None
    softcap: Optional[float] = None  # the soft-cap training applied to the scores (cap·tanh(S·α / cap)), or None

    def with_facts(self, config: ReplayConfig) -> ReplayConfig:
        """`config` with what the layer recorded of its scores that a recipe does not name (the soft-cap)."""
        return config if self.softcap is None or config.softcap is not None else config.with_(softcap=self.softcap)

    @property
    def where(self) -> str:
        """'step S layer L' for messages."""
        return f"step {self.step} layer {self.layer}"


def select(dump, step: Optional[int] = None, layer: Optional[int] = None,
           head: Optional[int] = None) -> list[LayerSelection]:
    """Validated selections, sorted by (step, layer); None means every complete step / layer / head.

    Raises DumpError (one line naming what exists) for a step, layer or head the dump lacks.
    """
    if not dump.steps:
        damaged = dict(getattr(dump, "damage", {}) or {})
        cut = [s for s in (getattr(dump, "incomplete_steps", []) or []) if s not in damaged]
        said = [f"step(s) {', '.join(map(str, cut))} cut off while writing"] if cut else []
        said += [f"step {s} damaged, {problems[0].line(dump.path)}" for s, problems in sorted(damaged.items())
                 if problems][:3]
        extra = f" ({'; '.join(said)})" if said else ""
        raise DumpError(f"{dump.path}: no complete step to analyse{extra}; capture again or pick another dump")
    triples = dump.select(
        steps=None if step is None else [step],
        layers=None if layer is None else [layer],
        heads=None if head is None else [head],
    )
    out = [LayerSelection(int(s), int(l), [int(h) for h in hs]) for s, l, hs in triples]
    if not out:
        raise NothingSelected(dump.path, step, layer, head)
    return screen(dump, sorted(out, key=lambda s: (s.step, s.layer)))  # heads with non-finite inputs left out, named


def load(dump, sel: LayerSelection, batch: BatchSel = None) -> LayerTensors:
    """Read q, k, v, o, do (selected heads batched) and x of one layer-step, plus its scale and causal
    flag, and attach the warnings of every registered layer check (`checks.with_checks`)."""
    info = dump.layer_info(sel.step, sel.layer)
    for name in ("q", "k", "v"):
        if not dump.has(sel.step, sel.layer, name):
            raise DumpError(f"{dump.path}: step {sel.step} layer {sel.layer} has no '{name}' array; a replay needs q, "
                            "k and v")

    def read(name: str, heads=sel.heads) -> Optional[torch.Tensor]:
        if not dump.has(sel.step, sel.layer, name):
            return None
        return dump.read(sel.step, sel.layer, name, heads=heads, batch=batch)

    q = read("q")  # (B, h, T, D)
    scale = getattr(info, "scale", None)
    if scale is None or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        scale = 1.0 / math.sqrt(q.shape[-1])
    causal = getattr(info, "causal", None)
    t = LayerTensors(
        step=sel.step, layer=sel.layer, heads=list(sel.heads),
        q=q, k=read("k"), v=read("v"), o=read("o"), do=read("do"), x=None,
        scale=float(scale), causal=True if causal is None else bool(causal), source=dump, mask=read("mask"),
        launch=(int((info.arrays.get("q") or q.shape)[0]), int(info.n_heads)),
        softcap=_softcap((getattr(info, "call", None) or {}).get("softcap")),
    )
    x, x_warnings = finite_x(t, read("x", heads=None))  # non-finite x: None, with a warning
    t = replace(t, x=x, warnings=tuple(x_warnings))
    return with_checks(t, dump, info)


def _softcap(value: object) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def collect_warnings(layers: Iterable[LayerTensors]) -> tuple[str, ...]:
    """The warnings of several layer-steps, in order, without repeats (for a Result's `warnings`)."""
    out: list[str] = []
    for t in layers:
        out.extend(w for w in t.warnings if w not in out)
    return tuple(out)


def replay_layer(t: LayerTensors, config: ReplayConfig, *, backward: bool, backend: Backend = Backend.EMULATE):
    """Replay one layer-step (all selected heads at once) under `config`; the backward only if asked.

    The dump's scale, causal flag and recorded mask override the config's (they describe what training did);
    what a kernel's launch decides is read from the layer as stored, not from the selected heads (`t.launch`).
    """
    from fa_forensics.replay import replay  # lazy: the replay engine imports torch-heavy modules
    from fa_forensics.replay.emulate.run import launch_config

    if backward and t.do is None:
        raise DumpError(f"{t.where}: the dump has no 'do' (upstream gradient) array; this analysis needs a capture "
                        "with dO")
    config = t.with_facts(config)
    if t.launch is not None:
        B, H = t.launch
        config = launch_config(config, torch.Size((B, H, *t.q.shape[2:])), t.k.shape[-2])
    return replay(t.q, t.k, t.v, config, t.do if backward else None, backend=Backend(backend).value, causal=t.causal,
                  scale=t.scale, mask=t.mask)


def as_seen_by(t: LayerTensors, lp: ReplayConfig) -> LayerTensors:
    """`t` with q, k, v and dO rounded (nearest-even) to `lp.input_dtype`: the inputs as the recipe sees them.

    Both sides of an lp/hp comparison replay these (paper Eq. 4 compares two computations on the same
    inputs), so that the input cast of a dump finer than the recipe (fp32 training, bf16 recipe) is
    never counted as a kernel error; `input_cast_error` measures that cast apart. When the cast
    changes any value, the returned layer carries a warning saying so.
    """
    from fa_forensics.numerics import round_to

    fmt = lp.input_dtype.value

    def seen(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x is None or fmt == "fp32" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return x
        return round_to(x.to(torch.float32), fmt).to(torch.float32)

    q, k, v, do = (seen(x) for x in (t.q, t.k, t.v, t.do))
    if all(a is b or torch.equal(a.to(torch.float32), b) for a, b in ((t.q, q), (t.k, k), (t.v, v))):
        return t
    message = (f"{t.where}: the stored q, k, v ({str(t.q.dtype).removeprefix('torch.')}) are finer than the recipe's "
               f"{fmt} inputs; both sides replay them rounded to {fmt}, and the input cast's own error is reported "
               "apart")
    return replace(t, q=q, k=k, v=v, do=do,
                   warnings=(*t.warnings, message) if message not in t.warnings else t.warnings)


def mask_of(mask: Optional[torch.Tensor], batch: int, head: int) -> Optional[torch.Tensor]:
    """The (T, K) attn_mask of one (batch entry, selected head) of a layer's broadcastable mask, or None."""
    if mask is None:
        return None
    return mask[batch if mask.shape[0] > 1 else 0, head if mask.shape[1] > 1 else 0]


def as_f64(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Upcast a stored / replayed tensor to float64 for exact analysis arithmetic."""
    return None if x is None else x.to(torch.float64)


def heads_of(selections: Sequence[LayerSelection]) -> int:
    """Total number of (step, layer, head) items in a selection list (for progress bars)."""
    return sum(len(s.heads) for s in selections)

