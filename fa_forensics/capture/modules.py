"""Finding the attention modules of a model by name, and reading their input X.

The default pattern (capture/settings.py, where every capture default is) matches a module whose qualified
name ends in `<blocks>.<i>.<attn>` where <blocks> is one of h | layers | blocks | layer and <attn> one of
attn | self_attn | attention | self_attention. It covers nanoGPT and Hugging Face GPT-2
(`transformer.h.{i}.attn`), Hugging Face Llama / Mistral / Qwen (`model.layers.{i}.self_attn`),
TransformerLens (`blocks.{i}.attn`), and the same names under wrappers (DDP's `module.`, torch.compile's
`_orig_mod.`).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Optional

import torch

from fa_forensics.capture.settings import DEFAULT_ATTENTION_PATTERN


def find_attention_modules(model: torch.nn.Module,
                           pattern: str = DEFAULT_ATTENTION_PATTERN) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every module of `model` whose name matches `pattern`, in module order."""
    regex = re.compile(pattern)
    return [(name, module) for name, module in model.named_modules() if name and regex.search(name)]


_INPUT_KEYWORDS = ("hidden_states", "x", "query", "input")


def module_input(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """X = the first tensor argument of an attention module's forward (positional or `hidden_states`/`x`)."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for key in _INPUT_KEYWORDS:
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor):
            return value
    return None


def replace_module_input(args: tuple, kwargs: dict, fn: Callable[[torch.Tensor],
                                                                 torch.Tensor]) -> Optional[tuple[tuple, dict]]:
    """(args, kwargs) with X (as found by `module_input`) replaced by fn(X); None when there is no X."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    for key in _INPUT_KEYWORDS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: fn(kwargs[key])}
    return None


_HEAD_COUNT_NAMES = ("num_heads", "n_head", "n_heads", "num_attention_heads")


def module_heads(module: object) -> Optional[int]:
    """The query head count an attention module states (num_heads, n_head, n_heads, num_attention_heads,
    or its config's num_attention_heads / n_head), or None."""
    if module is None:
        return None
    for owner in (module, getattr(module, "config", None)):
        for name in _HEAD_COUNT_NAMES:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def describe_model(model: torch.nn.Module) -> dict:
    """{"model": {class, n_params, compiled, wrapper}, "device"}: the class is the model's own under
    torch.compile (`_orig_mod`) and DDP/FSDP-style wrappers (`module`)."""
    inner, wrappers = model, []
    while True:
        child = getattr(inner, "_orig_mod", None) or getattr(inner, "module", None)
        if not isinstance(child, torch.nn.Module):
            break
        wrappers.append(type(inner).__name__)
        inner = child
    first = next(iter(model.parameters()), None)
    return {"model": {"class": type(inner).__name__, "n_params": int(sum(p.numel() for p in model.parameters())),
                      "compiled": "OptimizedModule" in wrappers, "wrappers": wrappers},
            "device": str(first.device) if first is not None else "unknown"}
