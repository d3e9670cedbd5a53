"""Attention written as plain torch ops: softmax(Q·Kᵀ·scale + mask)·V found by following its tensors.

While a `ChainMode` (a TorchFunctionMode) is on the stack, every torch function the model calls passes
through it: the function runs exactly as it would without the mode (its result is returned untouched,
bit for bit), and the mode notes which results belong to an attention chain:

  scores   S = A·Bᵀ: matmul, @, bmm, baddbmm, or einsum with one contracted index; A (…, T, D),
           B (…, S, D); both operands have 3 or more dims (x @ W with a 2-D weight is never scores)
  scale    S·c, S/c for a number or a one-element tensor, any number of times (scale = their product);
           A or B multiplied by a number before the product (timm's q·scale) is kept as q_scale / k_scale
           and the stored Q, K are the product's operands
  softcap  c·tanh(S·σ) written inline (Gemma 2): softcap c, scale σ·c (capture/softcap.py)
  mask     S + bias, S − bias; S.masked_fill(blocked, v), torch.where(allowed, S, v), S[blocked] = v with
           v ≤ −1e4 (or −inf): positions blocked
  reshape  view / reshape / flatten / unflatten of S or P that keep the last two dims
  casts    .to(dtype), .type(dtype), .float(), .half(), .bfloat16(), .double(), .contiguous()
  softmax  over the last dim: torch.softmax, F.softmax, Tensor.softmax, torch.special.softmax (dtype= too)
  dropout  F.dropout or torch.dropout of P (its p counts when training)
  output   O = P·V (the same products), V (…, S, E)

When O is formed the chain is handed over as one `PlainCall`: Q, K, V, O as they entered and left the
products (O is what the model computed), the scale, the mask terms, dropout, the dtypes S, the softmax
and P were in, and the ops in order (capture/chain_call.py makes it one (B, H, T, D) call with its mask).
Any other op on a tensor of the chain simply ends that chain; an in-place op the mode does not know
forgets the tensor. The mode keeps only weak references. `ChainScope` puts a fresh mode on the stack for
one forward pass and takes it off again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from fa_forensics.capture import softcap

BLOCKING = -1e4  # a filled value at or below this blocks its position (exp(v - max) is 0 in fp32)


@dataclass(frozen=True)
class MaskTerm:
    """One mask op on the scores: an additive `bias`, or `blocked` positions (bool, True = blocked).
    `shape`: the scores' shape when it was applied (the term broadcasts to it)."""

    kind: str  # "bias" | "blocked"
    tensor: torch.Tensor
    shape: tuple[int, ...]
    value: float = -math.inf  # what blocked positions were filled with


@dataclass(frozen=True)
class _Scores:
    q: torch.Tensor  # (…, T, D): the product's first operand
    k: torch.Tensor  # (…, S, D): the second operand, transposed back
    scale: float = 1.0
    terms: tuple[MaskTerm, ...] = ()
    ops: tuple[str, ...] = ()
    score_dtype: Optional[torch.dtype] = None
    q_scale: Optional[float] = None
    k_scale: Optional[float] = None
    steps: tuple[dict, ...] = ()  # each op as recorded (`_entry`): name, dtypes, its number
    softcap: Optional[float] = None  # the scores are cap·tanh(S·scale / cap) (capture/softcap.py)


@dataclass(frozen=True)
class _Probs:
    scores: _Scores
    shape: tuple[int, ...]  # the scores' shape at the softmax
    softmax_dtype: torch.dtype
    dropout_p: float = 0.0
    ops: tuple[str, ...] = ()
    steps: tuple[dict, ...] = ()


@dataclass(frozen=True)
class PlainCall:
    """One attention chain, as the model computed it (see the module docstring).

    q (…, T, D), k, v (…, S, D|E) as the products got them; o (…, T, E) the output (a view of
    `o_raw`, the tensor autograd saw; `o_convert` maps a gradient of o_raw the same way);
    `layout`: how O came out of the product (BHTD for matmul; einsum may give e.g. BTHD)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    o_raw: torch.Tensor
    o_convert: Optional[Callable[[torch.Tensor], torch.Tensor]]
    scale: float
    terms: tuple[MaskTerm, ...]
    scores_shape: tuple[int, ...]
    dropout_p: float
    score_dtype: Optional[torch.dtype]
    softmax_dtype: torch.dtype
    p_dtype: torch.dtype
    ops: tuple[str, ...]
    q_scale: Optional[float] = None
    k_scale: Optional[float] = None
    layout: str = "BHTD"
    extra: dict = field(default_factory=dict)
    softcap: Optional[float] = None


# -- reading arguments --------------------------------------------------------------------------------
_IN_PLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                                             "xor", "lshift", "rshift", "matmul")}


def _in_place(name: str) -> bool:
    """torch's in-place ops: `add_`, `masked_fill_`, ... and `+=`-style dunders (not `__get__`)."""
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


def _number(value: object) -> Optional[float]:
    """A plain number, or the value of a one-element tensor; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        return float(value.detach().reshape(()))
    return None


def _blocking_value(value: object) -> Optional[float]:
    """The number `value` stands for when it blocks its position (at or below BLOCKING), else None."""
    number = _number(value)
    return number if number is not None and number <= BLOCKING else None


def _dtype_arg(args: tuple, kwargs: dict) -> Optional[torch.dtype]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
    return None


# -- einsum ---------------------------------------------------------------------------------------------
def _einsum_operands(args: tuple, kwargs: dict) -> Optional[tuple[list[str], str, list[torch.Tensor]]]:
    """(input subscripts, output subscripts, the two operands) with `...` spelled out, or None."""
    if not args or not isinstance(args[0], str):
        return None
    operands = list(args[1][0:2]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    if len(operands) != 2 or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    eq = args[0].replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    ins = lhs.split(",")
    if len(ins) != 2:
        return None
    ellipsis = max((t.dim() - len(s.replace("...", "")) for s, t in zip(ins, operands) if "..." in s), default=0)
    fill = "".join(chr(0x3B1 + i) for i in range(ellipsis))  # Greek letters stand for the `...` dims

    def spell(s: str, t: torch.Tensor) -> str:
        if "..." not in s:
            return s
        own = t.dim() - len(s.replace("...", ""))
        return s.replace("...", fill[ellipsis - own:])

    ins = [spell(s, t) for s, t in zip(ins, operands)]
    if not arrow:
        letters = "".join(ins)
        out = fill + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in fill))
    else:
        out = out.replace("...", fill)
    if any(len(s) != t.dim() or len(set(s)) != len(s) for s, t in zip(ins, operands)):
        return None
    return ins, out, operands


def _permute_to(t: torch.Tensor, have: str, want: str) -> torch.Tensor:
    return t.permute([have.index(c) for c in want])


_EinsumProduct = tuple[torch.Tensor, torch.Tensor, str, str, tuple[torch.Tensor, torch.Tensor]]


def _einsum_product(args: tuple, kwargs: dict) -> Optional[_EinsumProduct]:
    """(A as (…, T, D), B as (…, S, D), the output's letters, them in canonical order, the operands) of a
    two-operand einsum with one contracted index and one free index on each side; None otherwise."""
    parsed = _einsum_operands(args, kwargs)
    if parsed is None:
        return None
    (a, b), out, (ta, tb) = parsed
    contracted = [c for c in a if c in b and c not in out]
    free_a = [c for c in a if c not in b]
    free_b = [c for c in b if c not in a]
    batch = [c for c in out if c in a and c in b]
    if len(contracted) != 1 or len(free_a) != 1 or len(free_b) != 1 or set(out) != {*batch, *free_a, *free_b}:
        return None
    if any(c not in out for c in a if c not in contracted) or ta.dim() < 3 or tb.dim() < 3:
        return None
    batch_s = "".join(batch)
    d, t, s = contracted[0], free_a[0], free_b[0]
    return (_permute_to(ta, a, batch_s + t + d), _permute_to(tb, b, batch_s + s + d), out, batch_s + t + s,
            (ta, tb))


# -- the mode -------------------------------------------------------------------------------------------
class ChainMode(TorchFunctionMode):
    """Follows attention chains through the torch functions the model calls (module docstring).

    report(PlainCall) is called when a chain's output is formed; it runs with this mode off."""

    def __init__(self, report: Callable[[PlainCall], None], on_error: Callable[[BaseException], None]):
        super().__init__()
        self._report = report
        self._on_error = on_error
        self.nodes = WeakIdKeyDictionary()  # tensor -> _Scores | _Probs
        self.scaled = WeakIdKeyDictionary()  # tensor -> (its factor) for tensors multiplied by a number
        self.paused = 0  # > 0 while capture's own code runs with the mode on the stack
        self.broken = False  # a bug in following a chain: stop following, never stop training

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # traced by dynamo (a compiled function called in the forward pass)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.paused or self.broken:
            return out
        handler = _HANDLERS.get(func)
        try:
            if handler is not None:
                handler(self, func, args, kwargs, out)
            elif (args and isinstance(args[0], torch.Tensor) and args[0] in self.nodes
                  and (_in_place(getattr(func, "__name__", "")) or "out" in kwargs)):
                del self.nodes[args[0]]  # changed in place by an op this mode does not follow
        except Exception as exc:  # a chain this mode misreads must never stop training
            from fa_forensics.errors import UserError

            if isinstance(exc, UserError):
                raise
            self.broken = True
            self._on_error(exc)
        return out

    # -- helpers ----------------------------------------------------------------------------------
    def _node(self, t: object) -> Any:
        return self.nodes.get(t) if isinstance(t, torch.Tensor) else None

    def _set(self, out: object, node: _Scores | _Probs) -> None:
        if isinstance(out, torch.Tensor):
            self.nodes[out] = node

    def _product(self, a: torch.Tensor, b_t: torch.Tensor, out: torch.Tensor, name: str,
                 canonical_out: Optional[tuple[str, str]] = None, operands: Optional[tuple] = None) -> None:
        """A product A·B_tᵀ (a (…, T, D), b_t (…, S, D)) that made `out`: scores, or the output of a chain.
        operands: the tensors as the op got them, when a and b_t are views made of them here."""
        first, second = operands or (a, b_t)
        probs = self._node(first)
        if isinstance(probs, _Probs):
            if isinstance(out, torch.Tensor) and b_t.dim() >= 3:
                self._finish(probs, a, b_t, out, name, canonical_out)
            return
        if a.dim() < 3 or b_t.dim() < 3 or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        if canonical_out is not None and canonical_out[0] != canonical_out[1]:
            return  # scores whose last two dims are not (T, S): not softmax-ready
        self._set(out, _Scores(a, b_t, ops=(name,), score_dtype=out.dtype,
                               q_scale=self.scaled.get(first), k_scale=self.scaled.get(second),
                               steps=(_entry(name, out, first, second),)))

    def _finish(self, probs: _Probs, p: torch.Tensor, v_t: torch.Tensor, out: torch.Tensor, name: str,
                canonical_out: Optional[tuple[str, str]]) -> None:
        """O = P·V formed: hand the chain over. v_t: V as (…, E, S) (the second operand transposed)."""
        s = probs.scores
        o, convert, layout = out, None, "BHTD" if out.dim() == 4 else "(B*H)TD" if out.dim() == 3 else "B...TD"
        if canonical_out is not None:
            have, want = canonical_out
            if have != want:
                perm = [have.index(c) for c in want]
                o, convert = out.permute(perm), (lambda g, perm=perm: g.permute(perm))
                if out.dim() == 4:
                    letters = dict(zip(want, "BHTD"))
                    layout = "".join(letters[c] for c in have)
        steps = (*s.steps, *probs.steps, _entry(name, out, p, v_t))
        call = PlainCall(q=s.q, k=s.k, v=v_t.transpose(-1, -2), o=o, o_raw=out, o_convert=convert, scale=s.scale,
                         terms=s.terms, scores_shape=probs.shape, dropout_p=probs.dropout_p,
                         score_dtype=s.score_dtype, softmax_dtype=probs.softmax_dtype, p_dtype=_operand_dtype(p),
                         ops=(*s.ops, *probs.ops, name), q_scale=s.q_scale, k_scale=s.k_scale, layout=layout,
                         softcap=s.softcap, extra={"plain_recipe": plain_recipe(s, probs, steps, layout, out)})
        self.paused += 1
        try:
            self._report(call)
        finally:
            self.paused -= 1


def _operand_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a product computes with `t` in: autocast's for an fp32 operand under autocast."""
    device = t.device.type
    if t.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


# -- the recipe as facts ------------------------------------------------------------------------------------
RECIPE_VERSION = 1


def _dtype_name(t: object) -> str:
    return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else "unknown"


def _entry(op: str, out: object, *inputs: object, **numbers: Any) -> dict:
    """One op of a chain as a JSON-able fact: its name, the dtypes it computed in (an fp32 operand of a product
    under autocast counts in autocast's dtype) and returned, and its numbers (a factor, a fill value, a term)."""
    product = op in ("matmul", "bmm", "einsum", "baddbmm")
    entry: dict = {"op": op,
                   "in": [str(_operand_dtype(t) if product else t.dtype).replace("torch.", "")
                          for t in inputs if isinstance(t, torch.Tensor)],
                   "out": _dtype_name(out)}
    entry.update({k: v for k, v in numbers.items() if v is not None})
    return entry


def _window(terms: tuple[MaskTerm, ...], shape: tuple[int, ...]) -> Optional[int]:
    """w when the blocked positions of the mask terms are exactly a causal band of w keys (i - w < j <= i, aligned
    bottom-right) on every (batch, head), w shorter than the keys; None otherwise (no window)."""
    T, S = shape[-2:]
    blocked = torch.zeros((), dtype=torch.bool)
    for term in terms:
        t = term.tensor.detach().cpu()
        t = t if term.kind == "blocked" else (t <= BLOCKING)
        blocked = blocked | t.expand(*t.shape[:-2], T, S) if t.dim() >= 2 else blocked | t
    if blocked.dim() < 2:
        return None
    i = torch.arange(T).view(T, 1) + (S - T)
    j = torch.arange(S).view(1, S)
    first_seen = (~blocked).int().argmax(dim=-1)  # (…, T): the first key a row may see
    w = int((i.view(-1) - first_seen.reshape(-1, T)).max()) + 1 if first_seen.numel() else 0
    if w >= S or w < 1:
        return None  # every row may see back to the first key: no window
    band = ~((j <= i) & (j > i - w))
    return w if bool((blocked == band).all()) else None


def plain_recipe(s: _Scores, probs: _Probs, steps: tuple[dict, ...], layout: str, out: torch.Tensor) -> dict:
    """The recipe of one plain-attention chain as a JSON-able fact (docs/dump.md): the ops in order with their
    dtypes and numbers, where the scale applies, the mask terms, soft-cap and window, the softmax's dtype and the
    dtype P entered P·V in, the products, the layout, the device, torch's version and CPU thread count."""
    scale_on = [name for name, v in (("q", s.q_scale), ("k", s.k_scale)) if v is not None]
    ops = [e["op"] for e in s.steps]
    before_tanh = ops[:ops.index("tanh")] if "tanh" in ops else ops
    if any(op in ("mul", "div") for op in before_tanh):
        scale_on.append("scores")
    if s.steps and s.steps[0].get("alpha", 1.0) != 1.0:
        scale_on.append("product")
    kinds = sorted({t.kind for t in s.terms})
    window: Optional[int | str]
    try:
        window = _window(s.terms, probs.shape) if s.terms else None
    except RuntimeError:  # terms that do not broadcast to the scores' last two dims as read
        window = "unknown"
    device = out.device.type
    return {
        "version": RECIPE_VERSION,
        "ops": list(steps),
        "scale_on": ",".join(scale_on) or "none",
        "mask": ",".join(kinds) or "none",
        "softcap": s.softcap if s.softcap is not None else "none",
        "window": window if window is not None else "none",
        "score_dtype": str(s.score_dtype).replace("torch.", "") if s.score_dtype is not None else "unknown",
        "softmax_dtype": str(probs.softmax_dtype).replace("torch.", ""),
        "p_cast": steps[-1]["in"][0] if steps and steps[-1]["in"] else "unknown",
        "product": s.steps[0]["op"] if s.steps else "unknown",
        "pv_product": steps[-1]["op"] if steps else "unknown",
        "layout": layout,
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if device == "cpu" else "unknown",
        "autocast": str(torch.get_autocast_dtype(device)).replace("torch.", "")
        if torch.is_autocast_enabled(device) else "none",
    }


# -- handlers: (mode, func, args, kwargs, out) ---------------------------------------------------------------
def _matmul(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dim() >= 2:
        mode._product(a, b.transpose(-1, -2), out, "matmul" if func not in (torch.bmm, torch.Tensor.bmm) else "bmm",
                      operands=(a, b))


def _baddbmm(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    names = ("input", "batch1", "batch2")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    base, a, b = bound.get("input"), bound.get("batch1"), bound.get("batch2")
    beta, alpha = _number(bound.get("beta", 1)), _number(bound.get("alpha", 1))
    if (not (isinstance(base, torch.Tensor) and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
            or beta is None or alpha is None):
        return
    mode._product(a, b.transpose(-1, -2), out, "baddbmm", operands=(a, b))
    node = mode._node(out)
    if isinstance(node, _Scores):
        terms = () if beta == 0 else (MaskTerm("bias", base if beta == 1 else base * beta, tuple(out.shape)),)
        step = {**node.steps[0], "alpha": alpha, "beta": beta}
        mode.nodes[out] = replace(node, scale=alpha, terms=terms, steps=(step,))


def _einsum(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    pieces = _einsum_product(args, kwargs)
    if pieces is not None:
        a, b_t, have, want, operands = pieces
        mode._product(a, b_t, out, "einsum", canonical_out=(have, want), operands=operands)


def _scale(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    if len(args) < 2:
        return
    divide = func in _DIVIDES
    first, second = args[0], args[1]
    if divide and (kwargs.get("rounding_mode") is not None):
        return
    node, factor = mode._node(first), _number(second)
    if node is None and not divide:
        node, factor = mode._node(second), _number(first)
    if isinstance(node, _Scores) and factor is not None and factor != 0:
        step = _entry("div" if divide else "mul", out, first, second, value=factor)
        factor = 1.0 / factor if divide else factor
        terms = tuple(replace(t, tensor=t.tensor * factor) if t.kind == "bias" else t for t in node.terms)
        mode._set(out, replace(node, scale=node.scale * factor, terms=terms,
                               softcap=None if node.softcap is None else node.softcap * factor,
                               ops=(*node.ops, "div" if divide else "mul"), steps=(*node.steps, step)))
        return
    if node is None:  # a number times an activation: remembered in case the product of scores takes it
        tensor = first if isinstance(first, torch.Tensor) else second
        number = _number(second if tensor is first else first)
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 3 and number is not None and number != 0:
            if isinstance(out, torch.Tensor):
                mode.scaled[out] = 1.0 / number if divide else number


def _add(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    if len(args) < 2:
        return
    subtract = func in _SUBTRACTS
    first, second = args[0], args[1]
    alpha = _number(kwargs.get("alpha", 1))
    node, other = mode._node(first), second
    if node is None and not subtract:
        node, other = mode._node(second), first
    if not isinstance(node, _Scores) or not isinstance(other, torch.Tensor) or alpha is None or other.numel() == 1:
        return
    bias = other if alpha == 1 and not subtract else other * (-alpha if subtract else alpha)
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
    step = _entry("sub" if subtract else "add", out, first, second, alpha=None if alpha == 1 else alpha,
                  term=len(node.terms))
    mode._set(out, replace(node, terms=(*node.terms, MaskTerm("bias", bias, shape)),
                           ops=(*node.ops, "sub" if subtract else "add"), steps=(*node.steps, step)))


def _masked_fill(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    names = ("input", "mask", "value")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    node = mode._node(bound.get("input"))
    mask = bound.get("mask")
    if (isinstance(node, _Scores) and isinstance(mask, torch.Tensor)
            and (value := _blocking_value(bound.get("value"))) is not None):
        term = MaskTerm("blocked", mask.bool(), tuple(out.shape), value)
        step = _entry("masked_fill", out, bound.get("input"), value=value, term=len(node.terms))
        mode._set(out, replace(node, terms=(*node.terms, term), ops=(*node.ops, "masked_fill"),
                               steps=(*node.steps, step)))
    elif node is not None and func is torch.Tensor.masked_fill_:
        del mode.nodes[bound["input"]]


def _where(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    if func is torch.Tensor.where:  # self.where(condition, other) = torch.where(condition, self, other)
        args = (args[1], args[0], *args[2:]) if len(args) >= 2 else args
    if len(args) < 3:
        return
    cond, a, b = args[0], args[1], args[2]
    if not isinstance(cond, torch.Tensor):
        return
    if isinstance(mode._node(a), _Scores) and (value := _blocking_value(b)) is not None:
        node, blocked = mode._node(a), ~cond.bool()
    elif isinstance(mode._node(b), _Scores) and (value := _blocking_value(a)) is not None:
        node, blocked = mode._node(b), cond.bool()
    else:
        return
    step = _entry("where", out, a if isinstance(a, torch.Tensor) else b, value=value, term=len(node.terms))
    mode._set(out, replace(node, terms=(*node.terms, MaskTerm("blocked", blocked, tuple(out.shape), value)),
                           ops=(*node.ops, "where"), steps=(*node.steps, step)))


def _setitem(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    if len(args) < 3:
        return
    target, index, value = args[0], args[1], args[2]
    node = mode._node(target)
    if node is None:
        return
    if (isinstance(node, _Scores) and isinstance(index, torch.Tensor) and index.dtype == torch.bool
            and (blocking := _blocking_value(value)) is not None):
        term = MaskTerm("blocked", index, tuple(target.shape), blocking)
        step = _entry("setitem", target, target, value=blocking, term=len(node.terms))
        mode.nodes[target] = replace(node, terms=(*node.terms, term), ops=(*node.ops, "setitem"),
                                     steps=(*node.steps, step))
    else:
        del mode.nodes[target]


def _pass_through(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    """A cast or a reshape keeping the last two dims: the chain goes on through its result."""
    node = mode._node(args[0]) if args else None
    if node is None or not isinstance(out, torch.Tensor):
        return
    src = args[0]
    if out.dim() < 2 or tuple(out.shape[-2:]) != tuple(src.shape[-2:]) or out.numel() != src.numel():
        return
    name = getattr(func, "__name__", "")
    if name in _NAMED_CASTS and out.dtype != src.dtype:
        node = replace(node, ops=(*node.ops, name), steps=(*node.steps, _entry("to", out, src)))
    mode._set(out, node)


def _softmax(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    names = ("input", "dim")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x = bound.get("input")
    node = mode._node(x)
    dim = bound.get("dim")
    if (isinstance(node, _Scores) and isinstance(x, torch.Tensor) and isinstance(dim, int) and dim in (-1, x.dim() - 1)
            and isinstance(out, torch.Tensor)):
        mode._set(out, _Probs(node, tuple(x.shape), out.dtype, ops=("softmax",), steps=(_entry("softmax", out, x),)))


def _dropout(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    names = ("input", "p", "training", "inplace") if func is F.dropout else ("input", "p", "train")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    node = mode._node(bound.get("input"))
    if not isinstance(node, _Probs):
        return
    p = _number(bound.get("p", 0.5))
    training = bound.get("training", bound.get("train", True))
    effective = float(p) if p is not None and training else 0.0
    if node.dropout_p:  # two dropouts in a row keep what both keep
        effective = 1.0 - (1.0 - node.dropout_p) * (1.0 - effective)
    mode._set(out, replace(node, dropout_p=effective, ops=(*node.ops, "dropout"),
                           steps=(*node.steps, _entry("dropout", out, bound.get("input"), value=effective))))


def _tanh(mode: ChainMode, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
    """tanh of the chain's scores: the middle of a soft-cap (capture/softcap.py)."""
    scores = args[0] if args else kwargs.get("input")
    node = mode._node(scores)
    if isinstance(node, _Scores) and isinstance(out, torch.Tensor):
        mode._set(out, softcap.on_tanh(node, _entry("tanh", out, scores)))


_DIVIDES = {torch.Tensor.div, torch.div, torch.Tensor.div_, torch.Tensor.__truediv__, torch.Tensor.__itruediv__,
            torch.true_divide, torch.Tensor.true_divide}
_SUBTRACTS = {torch.Tensor.sub, torch.sub, torch.Tensor.sub_, torch.Tensor.__sub__, torch.Tensor.__isub__}
_NAMED_CASTS = {"to", "type", "float", "half", "bfloat16", "double"}

_Handler = Callable[[ChainMode, Callable[..., Any], tuple, dict, Any], None]
_HANDLERS: dict[Any, _Handler] = {}  # keys: torch functions and Tensor methods, of many signatures


def _register(handler: _Handler, *funcs: Any) -> None:
    for func in funcs:
        _HANDLERS[func] = handler


_register(_matmul, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.bmm,
          torch.Tensor.bmm)
_register(_baddbmm, torch.baddbmm, torch.Tensor.baddbmm)
_register(_einsum, torch.einsum)
_register(_scale, torch.Tensor.mul, torch.mul, torch.Tensor.mul_, torch.Tensor.__mul__, torch.Tensor.__rmul__,
          torch.Tensor.__imul__, *_DIVIDES)
_register(_add, torch.Tensor.add, torch.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
          torch.Tensor.__iadd__, *_SUBTRACTS)
_register(_masked_fill, torch.Tensor.masked_fill, torch.Tensor.masked_fill_, torch.masked_fill)
_register(_where, torch.where, torch.Tensor.where)
_register(_setitem, torch.Tensor.__setitem__)
_register(_pass_through, torch.Tensor.to, torch.Tensor.type, torch.Tensor.float, torch.Tensor.half,
          torch.Tensor.bfloat16, torch.Tensor.double, torch.Tensor.contiguous, torch.Tensor.view, torch.Tensor.reshape,
          torch.reshape, torch.Tensor.flatten, torch.flatten, torch.Tensor.unflatten)
_register(_softmax, torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax)
_register(_dropout, F.dropout, torch.dropout)
_register(_tanh, *softcap.TANH_FUNCS)


# -- the scope: a mode for the length of one forward pass --------------------------------------------------
def has_compiled_part(root: torch.nn.Module) -> bool:
    """The module or one of its submodules runs through torch.compile (a mode on the stack would change
    what dynamo traces, so attention in torch ops is not followed there)."""
    return any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
               for m in root.modules())


class ChainScope:
    """Pushes a fresh ChainMode when a recorded forward pass starts and pops it when it ends."""

    def __init__(self, report: Callable[[PlainCall], None], on_error: Callable[[BaseException], None]):
        self._report = report
        self._on_error = on_error
        self.mode: Optional[ChainMode] = None

    def enter(self, root: Optional[torch.nn.Module]) -> None:
        if self.mode is not None or not torch.is_grad_enabled() or (root is not None and has_compiled_part(root)):
            return
        self.mode = ChainMode(self._report, self._on_error)
        torch.overrides._push_mode(self.mode)

    def leave(self) -> None:
        """Pop the mode (modes pushed above it and not popped are put back as they were)."""
        mode, self.mode = self.mode, None
        if mode is None:
            return
        stack = torch.overrides._get_current_function_mode_stack()
        if mode not in stack:
            return
        above = []
        while torch.overrides._get_current_function_mode() is not mode:
            above.append(torch.overrides._pop_mode())
        torch.overrides._pop_mode()
        for other in reversed(above):
            torch.overrides._push_mode(other)

    def pause(self, delta: int) -> None:
        """+1 / -1 around capture's own code, which runs torch functions while the mode is on the stack."""
        if self.mode is not None:
            self.mode.paused += delta
