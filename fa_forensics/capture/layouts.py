"""Tensor layouts of attention entry points, and the checked conversion to the store's (B, H, T, D).

Attention libraries disagree on where heads go: SDPA, flex_attention and most hand-written kernels
take (B, H, T, D) ("BHTD"); flash_attn and xformers take (B, T, H, D) ("BTHD"). A dump always
stores (B, H, T, D). The conversion is a transpose view named by the caller, never guessed: a
shape that does not fit the named layout is an error, not a silent transpose.
"""
from __future__ import annotations

from typing import Optional

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


def o_grad_sink(o: torch.Tensor, convert) -> Optional[callable]:
    """A grad_sink for a call whose O was converted: the dO hook sits on the O autograd saw and gets
    dO converted the same way (a hook on a converted view would never fire). None when O has no grad."""
    if not o.requires_grad:
        return None

    def sink(hook) -> None:
        o.register_hook(lambda grad: hook(convert(grad)))

    return sink
