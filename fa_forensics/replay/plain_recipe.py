"""The recipe of attention written as plain tensor ops, as capture records it (`plain_recipe` in a layer's attrs).

A `PlainRecipe` is the op sequence capture saw for one layer (capture/torch_ops.py): the scores' product
(matmul, bmm, einsum or baddbmm), the ops on the scores in order (a factor, a mask or bias term, a tanh of a
soft-cap, casts), the softmax with its dtype, the cast of P and the product P·V, each with the dtypes it
computed in and returned; and where it ran (device, torch version, CPU thread count). Replays read it through
`ReplayConfig.plain` (replay/eager.py). This module is light (no torch): the presets that carry a default
recipe are listed by the CLI's help.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fa_forensics.errors import ConfigError

PRODUCTS = ("matmul", "bmm", "einsum", "baddbmm")
SCALES = ("mul", "div")
MASKS = ("add", "sub", "masked_fill", "where", "setitem")
ELEMENTWISE = ("tanh", "to", "dropout")
KNOWN_OPS = (*PRODUCTS, *SCALES, *MASKS, *ELEMENTWISE, "softmax")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class PlainOp:
    """One op: its name, the dtypes of its tensor inputs and output, and its number (a factor, a divisor, a fill
    value, a dropout p); `alpha`, `beta` of a baddbmm."""

    op: str
    ins: tuple[str, ...]
    out: str
    value: Optional[float] = None
    alpha: float = 1.0
    beta: float = 1.0

    def to_fact(self) -> dict:
        fact: dict[str, Any] = {"op": self.op, "in": list(self.ins), "out": self.out}
        if self.value is not None:
            fact["value"] = self.value
        if self.op == "baddbmm":
            fact.update(alpha=self.alpha, beta=self.beta)
        return fact


def _dtype(value: object, where: str) -> str:
    if value not in DTYPES:
        raise ConfigError(f"plain_recipe: {where} is {value!r}, not one of {', '.join(DTYPES)}")
    return str(value)


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"plain_recipe: {where} is {value!r}, not a number")
    return float(value)


@dataclass(frozen=True, repr=False)
class PlainRecipe:
    """A recorded op sequence (see the module docstring); `device` "unknown" for one not recorded."""

    ops: tuple[PlainOp, ...]
    device: str = "unknown"
    threads: Optional[int] = None
    torch_version: str = "unknown"

    def __post_init__(self) -> None:
        names = [o.op for o in self.ops]
        if not names or names[0] not in PRODUCTS or names[-1] not in PRODUCTS or names.count("softmax") != 1:
            raise ConfigError(f"plain_recipe: ops {' '.join(names) or '(none)'} are not product … softmax … product")
        if names.index("softmax") == len(names) - 1:
            raise ConfigError("plain_recipe: no product follows the softmax")

    def __repr__(self) -> str:
        return f"PlainRecipe({self.describe()})"

    __str__ = __repr__

    def describe(self) -> str:
        """One line: the ops with their output dtypes ("matmul→bfloat16 mul(0.25) add→float32 softmax→float32 …")."""
        parts = []
        for o in self.ops:
            number = "" if o.op not in (*SCALES, "dropout") else f"({o.value:g})" if o.value is not None else "(α)"
            parts.append(f"{o.op}{number}→{o.out}")
        where = f" on {self.device}" + (f", {self.threads} threads" if self.threads else "")
        return " ".join(parts) + where

    # ---- the parts of the sequence --------------------------------------------------------------------------
    @property
    def softmax_at(self) -> int:
        return [o.op for o in self.ops].index("softmax")

    @property
    def scores_ops(self) -> tuple[PlainOp, ...]:
        """The ops between the scores' product and the softmax."""
        return self.ops[1:self.softmax_at]

    @property
    def probs_ops(self) -> tuple[PlainOp, ...]:
        """The ops between the softmax and P·V."""
        return self.ops[self.softmax_at + 1:-1]

    @property
    def input_dtype(self) -> str:
        return self.ops[0].ins[0] if self.ops[0].ins else "unknown"

    @property
    def score_dtype(self) -> str:
        return self.ops[0].out

    @property
    def softmax_dtype(self) -> str:
        return self.ops[self.softmax_at].out

    @property
    def p_dtype(self) -> str:
        """The dtype P entered P·V in."""
        return self.ops[-1].ins[0] if self.ops[-1].ins else self.softmax_dtype

    @property
    def o_dtype(self) -> str:
        return self.ops[-1].out

    @property
    def has_softcap(self) -> bool:
        return any(o.op == "tanh" for o in self.ops)

    # ---- reading and writing the fact ------------------------------------------------------------------------
    def to_fact(self) -> dict:
        return {"ops": [o.to_fact() for o in self.ops], "device": self.device,
                "threads": self.threads if self.threads is not None else "unknown", "torch": self.torch_version}

    @classmethod
    def from_fact(cls, fact: object) -> PlainRecipe:
        """The recipe of a recorded `plain_recipe` attribute; ConfigError naming the first malformed field."""
        if not isinstance(fact, dict) or not isinstance(fact.get("ops"), list):
            raise ConfigError("plain_recipe: not an object with a list of ops")
        ops = []
        for i, entry in enumerate(fact["ops"]):
            where = f"ops[{i}]"
            if not isinstance(entry, dict) or entry.get("op") not in KNOWN_OPS:
                raise ConfigError(f"plain_recipe: {where} is {entry!r}, not one of the ops {', '.join(KNOWN_OPS)}")
            ins = entry.get("in", [])
            if not isinstance(ins, list):
                raise ConfigError(f"plain_recipe: {where}.in is {ins!r}, not a list of dtypes")
            value = entry.get("value")
            ops.append(PlainOp(
                op=entry["op"], ins=tuple(_dtype(d, f"{where}.in") for d in ins),
                out=_dtype(entry.get("out"), f"{where}.out"),
                value=None if value is None else _number(value, f"{where}.value"),
                alpha=_number(entry.get("alpha", 1.0), f"{where}.alpha"),
                beta=_number(entry.get("beta", 1.0), f"{where}.beta")))
        threads = fact.get("threads")
        device = fact.get("device", "unknown")
        return cls(tuple(ops), device=device if isinstance(device, str) else "unknown",
                   threads=threads if type(threads) is int and threads > 0 else None,
                   torch_version=str(fact.get("torch", "unknown")))


def hf_eager(dtype: str = "bfloat16", autocast: bool = True) -> PlainRecipe:
    """Hugging Face's `eager_attention_forward` (Llama and most models): matmul, × the replay's scale (a factor
    without a recorded value), + the additive mask (fp32), softmax in fp32, P cast back to the input dtype,
    matmul; `autocast`: under autocast the scores are in `dtype` and the mask's add promotes them to fp32."""
    score = dtype
    return PlainRecipe((
        PlainOp("matmul", (dtype, dtype), score),
        PlainOp("mul", (score,), score),
        PlainOp("add", (score, "float32"), "float32" if autocast else score),
        PlainOp("softmax", ("float32",), "float32"),
        PlainOp("to", ("float32",), dtype),
        PlainOp("matmul", (dtype, dtype), dtype),
    ))
