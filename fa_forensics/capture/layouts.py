"""Tensor layouts of attention entry points, and the checked conversion to the store's (B, H, T, D).

Attention libraries disagree on where heads go: SDPA, flex_attention and most hand-written kernels
take (B, H, T, D) ("BHTD"); flash_attn and xformers take (B, T, H, D) ("BTHD"). A dump always
stores (B, H, T, D). The conversion is a transpose view named by the caller, never guessed: a
shape that does not fit the named layout is an error, not a silent transpose. Beyond q, k, v and o
agreeing with each other, `check_call_context` checks the reading against what surrounds the call:
the input X of the attention module (its length and width) and the head count the module states. A
layout those make unambiguous is the call's layout, whichever way it was first read; an ambiguous
one is not stored (the call is skipped with its reason, training goes on).
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
    """One way of reading a call's q: batch, heads, length, head_dim. `swap`: the two dims of the tensors as
    first read (B, H, T, D) to exchange so that they are (B, H, T, D) in this reading (None: as read)."""

    layout: str
    B: int
    H: int
    T: int
    D: int
    swap: Optional[tuple[int, int]] = None

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

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """A (B, H, T, D)-read tensor (or a 4-D mask) as this reading's (B, H, T, D): a view."""
        if self.swap is None or t.dim() != 4:
            return t
        return t.transpose(*self.swap)


@dataclass(frozen=True)
class LayoutVerdict:
    """What the shapes around a call say of its layout: store it in `reading`; `line`: what to say (None: nothing);
    `skip`: why the call cannot be stored (its layout is ambiguous), or None."""

    reading: Reading
    line: Optional[str] = None
    skip: Optional[str] = None
    checked: bool = True  # False: X and the module could not be matched with any reading


def check_call_context(passed: tuple[int, ...], readings: tuple[Reading, ...], where: str, x: Optional[torch.Tensor],
                       x_name: str, heads: Optional[int], *, fixed: bool, advice: str = "") -> LayoutVerdict:
    """Check the reading a call was first read in (readings[0]) against X's length and width and the module's
    head count, and against the other ways the same tensor could be read (readings[1:]). `passed`: q's shape as
    the call passed it (messages print it so).

    - readings[0] is not contradicted: it stands.
    - it is contradicted and exactly one other reading fits: that reading is the call's layout. Where the layout
      is `fixed` (a library's kernel takes one layout, and computed over the axes it takes), readings[0] stands
      as what the kernel computed, and the line says the model passes the other layout (`advice`: what to fix);
      otherwise the call is stored in the reading that fits, and the line says so.
    - it is contradicted and more than one reading fits, or one fits without support: ambiguous, skipped.
    - it is contradicted and no reading fits (X or the module cannot be matched with the call): it stands, with
      a line that the layout could not be checked.
    Width decides only where two readings fit X's length (length = heads)."""
    stored = readings[0]
    if x is None and heads is None:
        return LayoutVerdict(stored)

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

    stored_bad, _, why = verdict(stored)
    if not stored_bad:
        return LayoutVerdict(stored)
    said = f"{where}: q {tuple(passed)} read as {stored.layout} has {stored.text()}, but {'; '.join(why)}"
    open_readings = [(r, verdict(r)) for r in readings[1:]]
    fits = [r for r, (bad, supported, _) in open_readings if not bad and supported]
    unsupported = [r for r, (bad, supported, _) in open_readings if not bad and not supported]
    if len(fits) == 1 and not unsupported:
        other = fits[0]
        if fixed:
            return LayoutVerdict(stored, f"fa-forensics capture: {said}; read as {other.layout} ({other.text()}) "
                                         f"it fits: {advice}. Recorded as {where} computed it")
        return LayoutVerdict(other, f"fa-forensics capture: {said}; read as {other.layout} ({other.text()}) it "
                                    f"fits, and these layers are recorded so (stored as (B, H, T, D); "
                                    f"`fa-forensics info` shows the layout)")
    if fits or unsupported:
        names = " or ".join(r.layout for r in (*fits, *unsupported))
        return LayoutVerdict(stored, skip=f"{said}; it could be read as {names} and nothing decides which, so the "
                                          "call is not recorded; report it with fa_forensics.capture.record(q, k, "
                                          "v, o, layout=...) or name its layout in --attention")
    return LayoutVerdict(stored, f"fa-forensics capture: {said}; the layout could not be checked against them",
                         checked=False)
