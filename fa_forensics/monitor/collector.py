"""The per-step collector of the training monitor: one timeline row from the attention calls of a step.

A capture session calls `begin(step)` when a monitored step starts, `observe_call(...)` for every
attention call of the recorded forward pass (layer = call order), and `finish()` when the step
ends. `finish` returns the row: per metric of TIMELINE_METRICS an (L, H) float64 array (NaN where
nothing was measured). Statistics stay on the device until `finish`, so a GPU run synchronizes
once per monitored step, not once per layer.

Score precision: the statistics count repeated maxima in the precision the monitored kernel forms
its scores in (`score_dtype`). By default that is the kernel's 16-bit dtype (bf16 for a bf16 or
bf16-autocast run: the paper's recipe, whose S is bf16); pass score_dtype=torch.float32 for a
kernel that keeps S in fp32 (FlashAttention's tensor-core accumulator).

On a GPU the statistics are one fused Triton kernel per call (monitor/stats.py), enqueued on the
training stream: no copies, no worker thread and no synchronization until `finish`.
Off the training thread (CPU): with `background=True` (the capture default) each call's work runs on one
worker thread (torch releases the GIL inside its kernels; the thread is started with the collector).
The training thread only copies the batch slice of q, k (once, as the fp32 values the statistics
use) and the W_Q block (a few hundred KB; the weights are copied because the optimizer updates
them in place) and goes on; `finish` waits for the worker, which has had the
whole backward pass and optimizer step to catch up. Results are identical either way.

attn_entropy: the mean softmax entropy per head (nats), NaN where the statistics' path does not measure it (the
fused GPU kernel). qk_norm: per layer, whether its attention module normalizes q and k (monitor/qk_norm.py),
in which case W_Q's norm does not reach the logits.

wq_sigma: σ_max of each head's block of W_Q, exact (float64 Gram eigenvalue), on the weights the
step's forward pass used (found by `find_query_weights` on the attention module). When no weight
is found the value is NaN and `warn(key, message)` is called once per module.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from typing import Optional

import numpy as np
import torch

from fa_forensics.monitor.qk_norm import has_qk_norm
from fa_forensics.monitor.spectral import ScaledGram, find_query_weights, head_spectral_norms
from fa_forensics.monitor.stats import TIMELINE_METRICS, HeadStats, head_statistics

WarnFn = Callable[[str, str], None]


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    """A private fp32 copy (one copy: the fp32 values the statistics use anyway; exact for 16-bit inputs)."""
    return t.float() if t.dtype != torch.float32 else t.clone()


def p_bar_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype P̄ is cast to before P̄V: the 16-bit input dtype, else bf16 (the paper's setting)."""
    return q_dtype if q_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _to_host(entries: list) -> list:
    """[(layer, metric, tensor)] → [(layer, metric, float64 numpy)], one concatenated copy per device."""
    by_device: dict = {}
    for entry in entries:
        by_device.setdefault(entry[2].device, []).append(entry)
    out = []
    for group in by_device.values():
        flat = torch.cat([t.detach().double().reshape(-1) for _, _, t in group]).cpu().numpy()
        start = 0
        for layer, metric, t in group:
            out.append((layer, metric, flat[start:start + t.numel()]))
            start += t.numel()
    return out


class StepCollector:
    """Collects HeadStats and W_Q spectral norms of one monitored step, layer by layer."""

    def __init__(self, *, eps: float = 1e-3, chunk: int = 128, warn: Optional[WarnFn] = None,
                 background: bool = False, score_dtype: Optional[torch.dtype] = None):
        self.eps = eps
        self.score_dtype = score_dtype  # None: the P̄ dtype of each call (the kernel's 16-bit dtype)
        self._pool = ThreadPoolExecutor(max_workers=1,
                                        thread_name_prefix="fa-forensics-monitor") if background else None
        if self._pool is not None:
            self._pool.submit(lambda: None)  # start the thread now, not in the first monitored step (≈ 5 ms there)
        self.chunk = chunk
        self._warn = warn or (lambda key, message: None)
        self._calls: dict[int, Future] = {}  # layer -> (HeadStats, σ (H,) or None)
        self._heads: dict[int, int] = {}  # layer -> query heads of its last call
        self.qk_norm: dict[int, Optional[bool]] = {}  # layer -> its module normalizes q and k (monitor/qk_norm.py)
        self._shape: Optional[tuple[int, int]] = None  # (L, H), fixed by the first row
        self.step: Optional[int] = None

    def begin(self, step: int) -> None:
        self.step = step
        self._calls = {}

    @torch.no_grad()
    def observe_call(self, layer: int, q: torch.Tensor, k: torch.Tensor, *, scale: Optional[float], causal: bool,
                     p_dtype: torch.dtype, module: Optional[torch.nn.Module], module_name: str,
                     score_dtype: Optional[torch.dtype] = None) -> None:
        """Statistics of one attention call: q (B, H, T, D), k (B, Hk, Tk, D) (grouped K heads are expanded).

        score_dtype: the precision the kernel forms S in; None = the collector's, else p_dtype."""
        if q.dim() != 4 or k.dim() != 4 or layer in self._calls:
            return
        H = q.shape[1]
        self._heads[layer] = H
        try:
            if layer not in self.qk_norm:
                self.qk_norm[layer] = has_qk_norm(module)
            w_q = find_query_weights(module, H) if module is not None else None  # (H, D, C_in)
            if w_q is None:
                what = "no module was found for it" if module is None else "none of the documented weight names matched"
                self._warn(f"wq:{module_name}", f"fa-forensics monitor: no W_Q found for attention module "
                                                f"{module_name!r} (layer {layer}; {what}); wq_sigma is NaN for it")
            q, k = q.detach(), k.detach()
            s_dtype = score_dtype or self.score_dtype or p_dtype
            if self._pool is None or q.is_cuda:  # a GPU enqueues the work on its stream: in order, nothing to copy
                done: Future = Future()
                done.set_result(self._compute(layer, q, k, w_q, scale, causal, p_dtype, s_dtype))
                self._calls[layer] = done
            else:  # copies: the worker must not see later in-place updates (optimizer step, reused buffers)
                w_copy = None if w_q is None else w_q.clone()
                self._calls[layer] = self._pool.submit(self._compute, layer, _fp32_copy(q), _fp32_copy(k), w_copy,
                                                       scale, causal, p_dtype, s_dtype)
        except Exception as exc:  # the monitor never stops training: the layer's row is NaN, said once
            failed: Future = Future()
            failed.set_exception(exc)
            self._calls[layer] = failed

    def _compute(self, layer, q, k, w_q, scale, causal, p_dtype, s_dtype) -> tuple[HeadStats, Optional[torch.Tensor]]:
        H = q.shape[1]
        if k.shape[1] != H:  # grouped-query attention: one K head per group of query heads
            k = k.repeat_interleave(H // k.shape[1], dim=1)
        with torch.autocast(q.device.type, enabled=False):  # called inside the forward pass: keep fp32 statistics
            stats = head_statistics(q, k, scale=scale, causal=causal, eps=self.eps, p_dtype=p_dtype,
                                    chunk=self.chunk, to_cpu=False, score_dtype=s_dtype)
            if w_q is None:
                sigma = None
            elif w_q.is_cuda:  # no synchronization here: the eigenvalues are taken on the host at `finish`
                sigma = ScaledGram(w_q).to_host()
            else:
                sigma = head_spectral_norms(w_q)  # (H,)
        return stats, sigma

    def finish(self) -> Optional[dict[str, np.ndarray]]:
        """The row of the step: metric -> (L, H) float64, or None if no attention call was seen.

        A layer whose statistics raised (whatever its inputs held) is NaN in the row, with one warning:
        nothing here raises into the training loop."""
        futures, self._calls = self._calls, {}
        if not futures:
            return None
        calls = {}
        for layer, future in futures.items():
            try:
                calls[layer] = future.result()
            except Exception as exc:
                self._failed(exc, f"layer {layer}")
        n_layers = max(futures) + 1
        n_heads = max(self._heads.get(layer, 1) for layer in futures)
        if self._shape is None:
            self._shape = (n_layers, n_heads)
        elif (n_layers, n_heads) != self._shape and (n_layers > self._shape[0] or n_heads > self._shape[1]):
            self._warn("shape", f"fa-forensics monitor: step {self.step} has {n_layers} layers × {n_heads} heads, "
                                f"the timeline {self._shape[0]} × {self._shape[1]}; the extra ones are not kept")
        L, H = self._shape
        row = {m: np.full((L, H), np.nan) for m in TIMELINE_METRICS}
        try:
            self._fill(row, calls)
        except Exception as exc:
            self._failed(exc, "the step")
            row = {m: np.full((L, H), np.nan) for m in TIMELINE_METRICS}
        return row

    def _fill(self, row: dict, calls: dict) -> None:
        """Copy the layers' statistics into the row (one device → host copy per device)."""
        L, H = self._shape
        entries = []  # (layer, metric, tensor on its device)
        grams = []  # (layer, ScaledGram on the host)
        for layer, (stats, sigma) in calls.items():
            if layer >= L:
                continue
            entries += [(layer, "max_logit", stats.max_logit), (layer, "near_max_ties", stats.near_max_ties),
                        (layer, "p_one_extra", stats.p_one_extra), (layer, "top1_prob", stats.top1_prob)]
            if stats.attn_entropy is not None:  # the fused GPU kernel does not measure it: NaN in the row
                entries.append((layer, "attn_entropy", stats.attn_entropy))
            if isinstance(sigma, ScaledGram):
                grams.append((layer, sigma))
            elif sigma is not None:
                entries.append((layer, "wq_sigma", sigma))
        for layer, metric, v in _to_host(entries):  # one synchronization per device
            v = v[:H]
            row[metric][layer, : v.shape[0]] = v
        for layer, gram in grams:  # their copies were queued before the statistics' copy: complete now
            v = gram.sigma().double().numpy()[:H]
            row["wq_sigma"][layer, : v.shape[0]] = v

    def _failed(self, exc: Exception, what: str) -> None:
        self._warn(f"failed:{type(exc).__name__}",
                   f"fa-forensics monitor: the statistics of {what} at step {self.step} could not be computed "
                   f"({type(exc).__name__}: {exc}); they are NaN in the timeline and training goes on")

    def close(self) -> None:
        """Stop the worker thread (pending work is finished first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
