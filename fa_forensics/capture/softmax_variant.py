"""Which softmax a recorded attention call computed: standard, or the paper's stabilized one.

A kernel's O does not say which shift rule produced it, and a replay must use the same one. The
built-in entry points (SDPA, flash_attn, xformers, flex_attention, Hugging Face's own attention
functions) and attention written as torch ops (its softmax is torch's) compute the standard softmax.
For custom attention the user says it, at capture time, in one of three ways (`--softmax` /
`softmax=`; `record(..., softmax=...)` for one call):

- `standard` or `stabilized`: every custom call computes that one;
- `ENV=VALUE`: stabilized exactly when the environment variable ENV equals VALUE at the call
  (the paper's code switches with STABLE=1: `--softmax STABLE=1`), else standard;
- not given: `unknown` for custom calls (a function registered with Hugging Face's registry under a name
  of its own included), said once per entry point at capture.

Each layer's attribute `softmax` holds the answer, `softmax_rule` the rule it came from.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from fa_forensics.capture.selection import InvalidCaptureSetting

VARIANTS = ("standard", "stabilized")
BUILT_IN_SOURCES = ("sdpa", "torch_ops")  # plus every name starting with a built-in library's prefix
_BUILT_IN_PREFIXES = ("flash_attn.", "xformers.", "torch.nn.attention.")
# Hugging Face's own attention functions (read from their arguments when nothing inside them was seen)
_HF_BUILT_IN = tuple(f"transformers:{name}" for name in (
    "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention", "paged|eager",
    "paged|sdpa", "paged|flash_attention_2", "paged|flash_attention_3"))


@dataclass(frozen=True)
class SoftmaxVariant:
    """The rule: a fixed variant, an environment switch, or nothing known."""

    fixed: Optional[str] = None
    env: Optional[str] = None
    env_value: Optional[str] = None

    @classmethod
    def parse(cls, text: Optional[str]) -> SoftmaxVariant:
        if text is None or isinstance(text, SoftmaxVariant):
            return text or cls()
        text = str(text).strip()
        if text.lower() in VARIANTS:
            return cls(fixed=text.lower())
        name, eq, value = text.partition("=")
        if eq and name.strip() and name.strip().replace("_", "a").isalnum():
            return cls(env=name.strip(), env_value=value)
        raise InvalidCaptureSetting("softmax", f"{text!r} is not a softmax rule; write standard, stabilized or "
                                               "ENV=VALUE (stabilized when the environment variable ENV equals VALUE, "
                                               "e.g. STABLE=1)")

    def to_text(self) -> Optional[str]:
        if self.fixed:
            return self.fixed
        return None if self.env is None else f"{self.env}={self.env_value}"

    def variant_for(self, source: str) -> str:
        """The variant of one call of `source` (an entry point's name, "sdpa" or "record")."""
        if source in BUILT_IN_SOURCES or source in _HF_BUILT_IN or source.startswith(_BUILT_IN_PREFIXES):
            return "standard"
        if self.fixed:
            return self.fixed
        if self.env is not None:
            return "stabilized" if os.environ.get(self.env) == self.env_value else "standard"
        return "unknown"
