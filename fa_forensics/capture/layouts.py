"""Tensor layouts of attention entry points, and the checked conversion to the store's (B, H, T, D).

Attention libraries disagree on where heads go: SDPA, flex_attention and most hand-written kernels
take (B, H, T, D) ("BHTD"); flash_attn and xformers take (B, T, H, D) ("BTHD"). A dump always
stores (B, H, T, D). The conversion is a transpose view named by the caller, never guessed: a
shape that does not fit the named layout is an error, not a silent transpose. Beyond q, k, v and o
agreeing with each other, `check_call_context` checks the reading against what surrounds the call:
the input X of the attention module (its length and width) and the head count the module states.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from fa_forensics.capture.selection import InvalidCaptureSetting

LAYOUTS = ("BHTD", "BTHD")


def check_layout(layout: str) -> str:
    """The layout name in upper case; InvalidCaptureSetting("layout") for any other name."""
    name = str(layout).upper()
    if name not in LAYOUTS:
        raise InvalidCaptureSetting("layout", f"{layout!r} is not a layout; choose BHTD (B, heads, T, head_dim: SDPA, "
                                              "flex_attention) or BTHD (B, T, heads, head_dim: flash_attn, xformers)")
    return name


def to_bhtd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t` as (B, H, T, D): a transpose view for BTHD, `t` itself for BHTD."""
    return t.transpose(1, 2) if layout == "BTHD" else t


def check_attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, layout: str,
                           where: str, o_layout: Optional[str] = None) -> None:
    """q, k, v (in `layout`) and o (in `o_layout`, default `layout`) must be 4-D with one batch size, one
    head_dim, k and v alike, o like q (V's head_dim may differ from Q's only where O follows V), and
    heads of k dividing heads of q.

    Raises InvalidCaptureSetting("layout") naming `where` (the entry point) and the shapes seen."""
    o_layout = o_layout or layout
    shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in (("q", q), ("k", k), ("v", v), ("o", o)))
    read = layout if o_layout == layout else f"{layout}, o as {o_layout}"

    def fail(why: str) -> None:
        raise InvalidCaptureSetting("layout", f"{where}: {why} ({shapes} read as {read}); name the layout the "
                                              "function takes (BHTD or BTHD) or fix the shapes passed")

    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        if t.dim() != 4:
            fail(f"{name} is {t.dim()}-D, a {layout if name != 'o' else o_layout} tensor is 4-D")
    qb, kb, vb, ob = to_bhtd(q, layout), to_bhtd(k, layout), to_bhtd(v, layout), to_bhtd(o, o_layout)
    if len({qb.shape[0], kb.shape[0], vb.shape[0], ob.shape[0]}) != 1:
        fail("q, k, v and o have different batch sizes")
    if kb.shape[:3] != vb.shape[:3]:
        fail("k and v differ in batch, heads or length")
    if qb.shape[3] != kb.shape[3]:
        fail("q and k have different head_dim")
    if ob.shape[:3] != qb.shape[:3] or ob.shape[3] != vb.shape[3]:
        other = "BTHD" if o_layout == "BHTD" else "BHTD"
        ot = to_bhtd(o, other)
        hint = (f"; o fits {other}: name it with o_layout={other}"
                if ot.shape[:3] == qb.shape[:3] and ot.shape[3] == vb.shape[3] else "")
        fail(f"o is not (B, heads of q, T of q, head_dim of v){hint}")
    if kb.shape[1] == 0 or qb.shape[1] % kb.shape[1]:
        fail(f"q's {qb.shape[1]} heads are not a multiple of k's {kb.shape[1]}")


GradHook = Callable[[torch.Tensor], Any]  # the session's dO hook


def o_grad_sink(o: torch.Tensor,
                convert: Callable[[torch.Tensor], torch.Tensor]) -> Optional[Callable[[GradHook], None]]:
    """A grad_sink for a call whose O was converted: the dO hook sits on the O autograd saw and gets
    dO converted the same way (a hook on a converted view would never fire). None when O has no grad."""
    if not o.requires_grad:
        return None

    def sink(hook: GradHook) -> None:
        o.register_hook(lambda grad: hook(convert(grad)))

    return sink


# -- the call against what surrounds it ---------------------------------------------------------------------
@dataclass(frozen=True)
class Reading:
    """One way of reading a call's q: batch, heads, length, head_dim."""

    layout: str
    B: int
    H: int
    T: int
    D: int

    def length_fits(self, x: torch.Tensor) -> Optional[bool]:
        """X (B, T, C) or (T, B, C) has this batch and length (or B = 1 and T all of X's tokens, packed); None
        when X is not a 2-D or 3-D tensor."""
        if x.dim() == 2:  # packed tokens (N, C)
            return self.B * self.T == x.shape[0]
        if x.dim() != 3:
            return None
        bx, tx = int(x.shape[0]), int(x.shape[1])
        return (self.B, self.T) in ((bx, tx), (tx, bx)) or (self.B == 1 and self.T == bx * tx)

    def width_fits(self, x: torch.Tensor) -> Optional[bool]:
        return None if x.dim() not in (2, 3) else self.H * self.D == x.shape[-1]

    def heads_fit(self, heads: Optional[int]) -> Optional[bool]:
        """The module's head count is a multiple of H (a tensor-parallel shard holds a part of the heads)."""
        return None if heads is None else heads % self.H == 0

    def text(self) -> str:
        return f"batch {self.B}, {self.H} heads, length {self.T}"


def check_call_context(q: torch.Tensor, readings: tuple[Reading, ...], where: str, x: Optional[torch.Tensor],
                       x_name: str, heads: Optional[int], advice: str) -> Optional[str]:
    """Check the reading a call was stored in (readings[0]) against X's length and width and the module's
    head count, and against the other way the same tensor could be read (readings[1:]).

    Raises InvalidCaptureSetting("layout") when the shapes contradict the reading and another reading fits
    them (the stored arrays would be transposed): before anything of the call is stored. Returns a line
    when the reading is contradicted and no other fits (X or the module cannot be matched with the call),
    else None. Width decides only where both readings fit X's length (length = heads)."""
    if x is None and heads is None:
        return None

    def verdict(r: Reading) -> tuple[bool, bool, list[str]]:
        """(contradicted, supported, what contradicts it)."""
        length = r.length_fits(x) if x is not None else None
        width = r.width_fits(x) if x is not None else None
        fit_heads = r.heads_fit(heads)
        others = [o.length_fits(x) for o in readings if o is not r] if x is not None else []
        ambiguous = length is True and any(o is True for o in others)
        why = []
        if x is not None and length is False:
            why.append(f"X {tuple(x.shape)} of {x_name} has another batch or length")
        if x is not None and width is False and ambiguous:
            why.append(f"X {tuple(x.shape)} of {x_name} is {x.shape[-1]} wide, not heads × head_dim = "
                       f"{r.H * r.D}")
        if fit_heads is False:
            why.append(f"{x_name} states {heads} heads")
        supported = length is True and (not ambiguous or width is True) or fit_heads is True
        return bool(why), supported, why

    stored_bad, _, why = verdict(readings[0])
    if not stored_bad:
        return None
    for other in readings[1:]:
        bad, supported, _ = verdict(other)
        if not bad and supported:
            raise InvalidCaptureSetting(
                "layout", f"{where}: q {tuple(q.shape)} read as {readings[0].layout} has {readings[0].text()}, but "
                          f"{'; '.join(why)}; read as {other.layout} ({other.text()}) it fits: {advice} "
                          "(nothing of this call was stored)")
    return (f"fa-forensics capture: {where}: q {tuple(q.shape)} read as {readings[0].layout} has "
            f"{readings[0].text()}, but {'; '.join(why)}; the layout could not be checked against them")
