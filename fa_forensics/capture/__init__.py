"""Capture: record Q, K, V, O, dO and X of chosen training steps into a dump store.

    with fa_forensics.capture(model, out="run.zarr", steps=[100, 200], layers=[1], batch=slice(0, 2)) as cap:
        for it in range(n_iters):
            loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
            cap.step(loss)            # optional: stores the loss of the step that just ended

Watched without any change to the model: F.scaled_dot_product_attention, flash_attn, xformers'
memory_efficient_attention, flex_attention, Hugging Face's attention functions (any attn_implementation)
and attention written as torch ops inside the model's forward (softmax(Q·Kᵀ·scale + mask)·V, followed on
recorded steps only: capture/torch_ops.py). Custom attention is named with `attention=
["MODULE:QUALNAME,layout=BHTD"]` (a function or an autograd Function, its arguments and result mapped by
options: capture/targets.py, docs/capture-custom-attention.md) or reports its calls with
`fa_forensics.capture.record(q, k, v, o, layout="BHTD", scale=..., causal=...)` (a no-op when no capture
is active). Every call's layout is checked against its shapes, X and the module (capture/layouts.py).
Unmodified scripts: `fa-forensics capture --out run.zarr --steps 100 [--attention
attention:FlashAttentionFunction --softmax STABLE=1] -- python train.py`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from fa_forensics import lazy_exports, make_callable
from fa_forensics.capture.selection import (
    CaptureError, CaptureSelection, InvalidCaptureSetting, parse_batch, parse_index_list, parse_steps,
)
from fa_forensics.capture.settings import DEFAULT_ATTENTION_PATTERN, CaptureSettings

if TYPE_CHECKING:  # the same names, for readers of the source (type checkers, the API docs)
    import torch

    from fa_forensics.capture.modules import find_attention_modules
    from fa_forensics.capture.session import CaptureSession, StepCallback, active

__all__ = [
    "capture",
    "record",
    "CaptureSession",
    "CaptureSettings",
    "CaptureSelection",
    "CaptureError",
    "InvalidCaptureSetting",
    "DEFAULT_ATTENTION_PATTERN",
    "find_attention_modules",
    "parse_steps",
    "parse_index_list",
    "parse_batch",
    "active",
]


def capture(model: Optional[torch.nn.Module] = None, *args: Any, on_step: Optional[StepCallback] = None,
            run_attrs: Optional[dict] = None, **options: Any) -> CaptureSession:
    """A context manager recording the selected steps of training into the store `out`.

    model: the model (its attention modules give X; its forward marks micro-batches); None works
      for SDPA/record-only capture. args / options: the fields of `CaptureSettings` (positional in its order:
      out, steps, layers, heads, batch, micro_batch, attention_modules), each with its default there:
      steps: iterable of step numbers or text "100,200:300:10"; layers / heads: indices (None = all);
      batch: slice of the batch dimension (None = whole batch); micro_batch: which forward pass of a step is
      recorded under gradient accumulation; attention_modules: regex over module names (default covers nanoGPT,
      HF GPT-2 and Llama); step_by ("optimizer" | "manual"), overwrite, max_queue, max_held_mb, writer_duty, the
      monitor's settings, attention (custom entry points to watch), softmax (the variant custom attention
      computes). on_step: fn(session, step, loss) after every step boundary; run_attrs: store attributes.
    """
    from fa_forensics.capture.session import CaptureSession

    return CaptureSession(model, CaptureSettings(*args, **options), on_step=on_step, run_attrs=run_attrs)


def record(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, scale: Optional[float] = None,
           causal: bool = True, x: Optional[torch.Tensor] = None, layout: str = "BHTD",
           mask: Optional[torch.Tensor] = None, softmax: Optional[str] = None) -> None:
    """Report one attention call of custom attention code to the active capture session (no-op without one).

    layout: how q, k, v, o are laid out, "BHTD" (B, heads, T, head_dim) or "BTHD" (B, T, heads, head_dim);
    the shapes are checked against it and against X and the module (InvalidCaptureSetting naming the shapes)
    and stored as (B, H, T, D). softmax: "standard" or "stabilized", what this code computes (default: the
    session's `softmax` rule, else recorded as unknown)."""
    from fa_forensics.capture.session import active

    session = active()
    if session is not None and session.busy:
        session.record(q, k, v, o, scale=scale, causal=causal, x=x, layout=layout, mask=mask, softmax=softmax)


__getattr__ = lazy_exports(__name__, {  # torch is imported when a session is first needed
    "CaptureSession": "fa_forensics.capture.session",
    "active": "fa_forensics.capture.session",
    "find_attention_modules": "fa_forensics.capture.modules",
})

make_callable(__name__)  # `fa_forensics.capture(...)` is this package called as its function `capture`
