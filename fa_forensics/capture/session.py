"""The capture session: a context manager that records Q, K, V, O, dO and X at chosen training steps.

Conventions (also in the README):
- Step k, counting from 0, is the training iteration whose forward/backward passes precede the
  (k+1)-th `optimizer.step()` call (nanoGPT's iter_num). Steps are counted through a global
  optimizer step post-hook on the first optimizer that steps (`step_by="optimizer"`), or only by
  `cap.step()` calls (`step_by="manual"`).
- Layers are numbered from 0 in the order attention calls run within the recorded forward pass.
- With gradient accumulation the forward pass number `micro_batch` (default 0, the first) of a
  step is recorded. Forward passes with gradients disabled (evaluation) are never recorded.
- Only one session is active at a time. Hooks and the SDPA patch are removed on exit, also when
  the block raises; steps that ended before the error are completed, the cut one is not.

Hot path: on a step that is not selected, the SDPA patch and every hook check one boolean
(`busy`, or `_active` for the attention modules' input hooks) and return; nothing is cloned,
nothing synchronizes.

torch.compile: the hooks and the SDPA patch are traced by dynamo. Each reads its flag in traced
code (dynamo turns the read into a guard: a step that is not busy runs exactly the graph of a run
without capture) and hands over to a `torch.compiler.disable` function only when the flag is set:
busy steps run a second graph, compiled once, that breaks at the hand-overs. No session state is
mutated inside traced code.

Monitor (`monitor_every=N`): every N-th step (step % N == 0) is "monitored": each attention call
of the recorded forward pass feeds `StepCollector` (per-head statistics on the batch slice, W_Q
spectral norms), and when the step ends ONE timeline row is appended to the store (step, loss,
(L, H) arrays, `alarms` count; rows reach the store `timeline_flush_rows` (16) at a time, see capture/writer.py).
The loss is the one given by `cap.step(loss)`, else the scalar on
which `backward()` was called (the loss tap). The row is written when its loss is known: at
`cap.step()`, or at the next forward pass / attention call / step end / exit.
Alarm (`alarm=True` or an `AlarmRule`): each row feeds the rule; an alarm prints one line to
stderr and the next `alarm_steps` steps are recorded in full (all selected layers). Ring
(`ring=K`): monitored steps that are not written are kept in host memory, the last K of them;
an alarm writes them too (the steps before the spike, and the spike step itself).
"""
from __future__ import annotations

import bisect
import os
import warnings
from typing import Callable, Optional, Union

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fa_forensics.capture import loss_tap, sdpa
from fa_forensics.capture.events import AlarmWarning, AttentionCall, CaptureWarning, ModuleInput, TimelineRow
from fa_forensics.capture.modules import DEFAULT_ATTENTION_PATTERN, find_attention_modules, module_input, replace_module_input
from fa_forensics.capture.selection import CaptureError, CaptureSelection, InvalidCaptureSetting
from fa_forensics.capture.recorder import Recorder
from fa_forensics.capture.ring import RingArray, RingStep, StepRing
from fa_forensics.capture.writer import BackgroundWriter, offload

StepCallback = Callable[["CaptureSession", int, Optional[float]], None]


def _rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) from torch.distributed if initialized, else torchrun's environment, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class CaptureSession:
    """Records selected attention calls of a training run into a dump store (format v1).

    Use through `fa_forensics.capture(model, out=..., steps=...)`. Attributes read by callers:
    `current_step` (the step in progress), `selection`, `rank`, `world_size`, `recorded_steps`.
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module],
        out,
        steps,
        layers=None,
        heads=None,
        batch=None,
        micro_batch: int = 0,
        attention_modules: str = DEFAULT_ATTENTION_PATTERN,
        *,
        step_by: str = "optimizer",
        overwrite: bool = False,
        allow_other_model: bool = False,
        max_queue: int = 64,
        on_step: Optional[StepCallback] = None,
        run_attrs: Optional[dict] = None,
        keep_sdpa_patch: bool = False,
        monitor_every: Optional[int] = None,
        alarm=False,
        alarm_steps: int = 3,
        ring: int = 0,
        monitor_eps: float = 1e-3,
        timeline_flush_rows: int = 16,
    ):
        if step_by not in ("optimizer", "manual"):
            raise CaptureError(f"step_by must be 'optimizer' or 'manual', got {step_by!r}")
        check_monitor_options(monitor_every, alarm, alarm_steps, ring)
        if int(timeline_flush_rows) < 1:
            raise CaptureError(f"timeline_flush_rows must be >= 1 (timeline rows appended at a time), got {timeline_flush_rows}")
        self.selection = CaptureSelection.build(steps, layers, heads, batch, micro_batch, allow_no_steps=bool(monitor_every))
        check_attention_pattern(attention_modules)
        self.out = os.fspath(out)
        self.model = model
        self.pattern = attention_modules
        self.step_by = step_by
        self.overwrite = overwrite
        self.allow_other_model = allow_other_model
        self.max_queue = max_queue
        self.run_attrs = dict(run_attrs or {})
        self.keep_sdpa_patch = keep_sdpa_patch
        self._callbacks: list[StepCallback] = [on_step] if on_step else []
        self._recorder = Recorder(self.selection, self._queue_array, self._mark_backward)
        # step state
        self.current_step = 0
        self.busy = False  # the one flag every hook checks: this step is selected, or a step awaits completion
        self._hot = False  # the current step is selected
        self._micro = -1  # index of the current forward pass within the step
        self._layer = 0  # attention calls so far in the current forward pass
        self._backward_seen = False  # fallback micro-batch detection when no root module is known
        self._step_recorded = False  # an array of the current step was queued
        self._step_loss: Optional[float] = None  # loss given by cap.step() before the boundary
        self._pending_loss: Optional[float] = None
        self._pending: Optional[int] = None  # an ended step whose completion waits for its loss
        self._pending_x: Optional[ModuleInput] = None
        self._optimizer_id: Optional[int] = None
        self._handles: list = []
        self._root: Optional[torch.nn.Module] = None
        self._writer: Optional[BackgroundWriter] = None
        self._warned: set[str] = set()
        self.recorded_steps: list[int] = []
        self._registered: set[int] = set()  # steps put in the store (as incomplete) when their first array was queued
        self.rank, self.world_size = 0, 1
        self.attention_module_names: list[str] = []
        self._modules_by_name: dict[str, torch.nn.Module] = {}
        # monitor state (all idle unless monitor_every is given)
        self.monitor_every = int(monitor_every) if monitor_every else None
        self.alarm_steps = int(alarm_steps)
        self.monitor_eps = monitor_eps
        self.timeline_flush_rows = int(timeline_flush_rows)
        self._collector = None  # a StepCollector when monitoring
        self._rule = None  # an AlarmRule when alarms are on
        if alarm:
            from fa_forensics.monitor.alarm import AlarmRule

            self._rule = alarm if isinstance(alarm, AlarmRule) else AlarmRule()
        self._ring: Optional[StepRing] = StepRing(ring) if ring else None
        self._ring_step: Optional[RingStep] = None  # the current step's arrays, held for the ring
        self._monitor_hot = False  # the current step is monitored
        self._ring_hot = False  # the current step's selected layers go to the ring
        self._active = False  # the current step needs its attention calls (recorded or monitored)
        self._extra_steps: set[int] = set()  # steps an alarm asked for
        self._reported_loss: Optional[float] = None  # cap.step(loss) before the boundary (monitor)
        self._tapped_loss: Optional[torch.Tensor] = None  # sum of scalars backward() was called on
        self._pending_tapped: Optional[torch.Tensor] = None  # ... of the ended step awaiting completion
        self._row: Optional[TimelineRow] = None  # the ended monitored step's row awaiting its loss
        self.alarms: list = []  # every Alarm raised
        self.monitored_steps: list[int] = []

    # -- public API ----------------------------------------------------------------------
    def __enter__(self) -> "CaptureSession":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(failed=exc_type is not None)

    def add_step_callback(self, fn: StepCallback) -> None:
        """Call fn(session, step, loss) after every step boundary (selected or not): the place for per-step statistics."""
        self._callbacks.append(fn)

    def step(self, loss=None) -> None:
        """Mark the end of a step (`step_by="manual"`), or give the loss of the step just ended ("optimizer").

        With step_by="optimizer", call it after optimizer.step() (the loss goes to the step that just
        ended) or before it (the loss goes to the current step); either way it never advances the count.
        """
        loss = _as_float(loss)
        if self.step_by == "manual":
            self._end_step(loss)
            return
        row_waiting = self._row is not None
        if row_waiting:
            self._flush_row(loss)
        if self._pending is not None:
            self._flush_pending(loss)
        elif self._hot and self._step_recorded:  # called before optimizer.step(): the loss of the current step
            self._step_loss = loss
        if not row_waiting and self._monitor_hot:
            self._reported_loss = loss

    def record(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, scale: Optional[float] = None,
               causal: bool = True, x: Optional[torch.Tensor] = None) -> None:
        """Record one attention call of custom attention code: q, k, v, o (B, H, T, D); x (B, T, C) optional."""
        if self.busy:
            self._record_eager(q, k, v, o, scale, causal, x)

    @torch.compiler.disable
    def _record_eager(self, q, k, v, o, scale, causal, x) -> None:
        if x is not None:
            self._pending_x = ModuleInput("record", x)
        self.on_attention(q, k, v, o, scale=scale, causal=causal, attn_mask=None, dropout_p=0.0, source="record")

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if sdpa.active_session() is not None:
            raise CaptureError("another fa-forensics capture session is already active; leave it before starting a new one")
        from fa_forensics.dump import DumpWriter  # lazy: keeps `import fa_forensics.capture` light

        self.rank, self.world_size = _rank_and_world_size()
        attrs = self._run_attrs()
        dist = torch.distributed
        ordered = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        if ordered and self.rank != 0:
            dist.barrier()  # rank 0 creates (or replaces) the store first; then every rank adds rank_{r}/
        try:
            dump_writer = DumpWriter(self.out, attrs, overwrite=self.overwrite and self.rank == 0, rank=self.rank, world_size=self.world_size,
                                     allow_other_model=self.allow_other_model)
        except OSError as exc:
            raise InvalidCaptureSetting("out", f"cannot create capture store {self.out}: {exc.strerror or exc}; it must be a writable path") from exc
        finally:
            if ordered and self.rank == 0:
                dist.barrier()
        self._writer = BackgroundWriter(dump_writer, max_queue=self.max_queue, timeline_rows=self.timeline_flush_rows)
        try:
            if self.model is not None:
                self.bind(self.model)
            if self.step_by == "optimizer":
                self._handles.append(register_optimizer_step_post_hook(self._on_optimizer_step))
            sdpa.install(self)
            if self.monitor_every:
                from fa_forensics.monitor.collector import StepCollector

                self._collector = StepCollector(eps=self.monitor_eps, warn=self._warn_once_key, background=True)
                loss_tap.install(self)
            _set_active(self)
            self._begin_step(0)
        except BaseException:
            self._remove_hooks()
            self._writer.close(failed=True)
            raise

    def stop(self, failed: bool = False) -> None:
        """Remove every hook and patch, complete the step(s) that ended, flush and close the store."""
        self._remove_hooks()
        sdpa.uninstall(self, keep_patch=self.keep_sdpa_patch)
        loss_tap.uninstall(self)
        _set_active(None)
        if self._writer is None:
            return
        try:
            if self._row is not None:
                self._flush_row(None)
            if self._pending is not None:
                self._flush_pending(None)
            self._ring_step = None
            if self._collector is not None:
                self._collector.close()
            self.busy = self._hot = self._active = self._monitor_hot = self._ring_hot = False
        finally:
            writer, self._writer = self._writer, None
            try:
                writer.close(failed=failed)
            except Exception as exc:
                if not failed:
                    raise
                warnings.warn(f"fa-forensics capture: closing the store after an error also failed: {exc}", RuntimeWarning)

    def bind(self, model: torch.nn.Module) -> int:
        """Hook `model`: its forward starts a micro-batch; its attention modules give X. Returns the count found."""
        self._root = model
        if self.model is None and self._writer is not None:  # bound by the launcher: check the store's identity, describe the model
            from fa_forensics.dump.identity import model_fingerprint

            described = describe_model(model)
            described["model"]["fingerprint"] = model_fingerprint(model)
            self._writer.set_model(described["model"])
            self._writer.put_run_attrs(described)
        found = find_attention_modules(model, self.pattern)
        self.attention_module_names = [name for name, _ in found]
        self._modules_by_name = dict(found)
        self._handles.append(model.register_forward_pre_hook(self._on_root_forward))
        for name, module in found:
            self._handles.append(module.register_forward_pre_hook(self._x_hook(name), with_kwargs=True))
        return len(found)

    # -- hooks (hot path first) ----------------------------------------------------------
    def _on_root_forward(self, module, args) -> None:
        if self.busy:
            self._root_forward_eager()

    @torch.compiler.disable
    def _root_forward_eager(self) -> None:
        if not torch.is_grad_enabled():
            return
        if self._row is not None:
            self._flush_row(None)
        if self._pending is not None:
            self._flush_pending(None)
        self._micro += 1
        self._layer = 0
        self._pending_x = None

    def _x_hook(self, name: str):
        def hook(module, args, kwargs):
            if self._active:
                if torch.compiler.is_compiling():  # inside a compiled graph: X passes through an opaque op
                    from fa_forensics.capture.graph_ops import tap_input

                    grad_enabled = torch.is_grad_enabled()
                    return replace_module_input(args, kwargs, lambda x: tap_input(x, name, grad_enabled))
                self._take_x(name, module_input(args, kwargs))
            return None

        return hook

    @torch.compiler.disable
    def _take_x(self, name: str, x: Optional[torch.Tensor]) -> None:
        if torch.is_grad_enabled():
            self.take_input(name, x)

    def take_input(self, name: str, x: Optional[torch.Tensor]) -> None:
        """X of the attention module `name`, kept for its attention call (called with gradients enabled)."""
        self._pending_x = None if x is None else ModuleInput(name, x)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._optimizer_id is None:
            self._optimizer_id = id(optimizer)
        elif id(optimizer) != self._optimizer_id:
            return  # a second optimizer of the same run (e.g. Muon + AdamW): count steps once
        self._end_step(None)

    def on_attention(self, q, k, v, o, *, scale, causal: bool, attn_mask: Optional[torch.Tensor], dropout_p: float, source: str,
                     grad_sink: Optional[Callable] = None, grad_enabled: Optional[bool] = None,
                     autocast_dtype: Union[torch.dtype, None, str] = "ambient") -> None:
        """Called by the SDPA patch and `record` on busy steps; decides whether this call is recorded or monitored.

        grad_sink: inside a compiled graph O carries no autograd history here; the dO hook is handed
        to grad_sink instead of being registered on O. grad_enabled, autocast_dtype: the grad mode and
        autocast dtype (None: autocast off) the call was traced in; by default the ones in effect now.
        """
        if autocast_dtype == "ambient":
            autocast_dtype = _autocast_dtype(q)
        if self._row is not None:
            self._flush_row(None)
        if self._pending is not None:
            self._flush_pending(None)
        if not self._active or not (torch.is_grad_enabled() if grad_enabled is None else grad_enabled):
            return
        if self._root is None:  # no module tree: a new forward pass starts after a backward pass
            if self._micro < 0 or self._backward_seen:
                self._micro += 1
                self._layer = 0
                self._backward_seen = False
        layer = self._layer
        self._layer += 1
        x, self._pending_x = self._pending_x, None
        if self._micro != self.selection.micro_batch:
            if self._root is None and self._micro < self.selection.micro_batch and o.requires_grad:
                o.register_hook(self._mark_backward)
            return
        call = AttentionCall(step=self.current_step, layer=layer, q=q, k=k, v=v, o=o, scale=scale, causal=causal, mask=attn_mask,
                             dropout_p=dropout_p, autocast_dtype=autocast_dtype, source=source, x=x, grad_sink=grad_sink)
        if self._monitor_hot:
            self._monitor_call(call)
        if (self._hot or self._ring_hot) and self.selection.wants_layer(layer):
            if not self._hot and self._ring_step is None:
                self._ring_step = RingStep(call.step)
            if self._recorder.record(call):
                self._step_recorded = True
            else:
                self._warn_once("dims", f"fa-forensics capture: skipped an attention call with q of shape {tuple(q.shape)}; "
                                        "only (B, H, T, D) is recorded")

    # -- recording -----------------------------------------------------------------------
    def _queue_array(self, step: int, layer: int, name: str, tensor: torch.Tensor, layer_attrs: dict) -> None:
        """Where the recorder's arrays go: the ring while the step is held there, else the background writer."""
        host, ready = offload(tensor)
        ring_step = self._ring_step
        if ring_step is not None and ring_step.step == step:
            ring_step.arrays.append(RingArray(layer, name, host, ready, layer_attrs))
        else:
            if step not in self._registered:
                self._registered.add(step)
                self._writer.register_step(step)
            self._writer.put_array(step, layer, name, host, ready=ready, layer_attrs=layer_attrs)

    def _mark_backward(self, grad=None) -> None:
        self._backward_seen = True

    # -- step boundaries -----------------------------------------------------------------
    def _end_step(self, loss: Optional[float]) -> None:
        ended = self.current_step
        if self._row is not None:
            self._flush_row(None)
        if self._pending is not None:
            self._flush_pending(None)
        tapped, self._tapped_loss = self._tapped_loss, None
        if self._hot:
            if self._step_recorded:
                self._pending = ended
                self._pending_loss = loss if loss is not None else self._step_loss
                self._pending_tapped = tapped
                if self._pending_loss is not None or self.step_by == "manual":
                    self._flush_pending(None)
            else:
                self._warn_once(f"empty{ended}", f"fa-forensics capture: step {ended} was selected but no attention call was seen (with gradients enabled); nothing recorded for it")
        row = None
        if self._monitor_hot:
            explicit = loss if loss is not None else self._reported_loss
            if self._ring_step is not None:
                self._ring_step.loss = explicit
                self._ring.push(self._ring_step)
            row = TimelineRow(ended, self._collector.finish(), explicit, tapped)
        self._ring_step = None
        self.current_step = ended + 1
        self._micro, self._layer, self._backward_seen = -1, 0, False
        self._step_recorded = False
        self._step_loss = None
        self._begin_step(self.current_step)
        if row is not None:
            self._row = row
            self._update_busy()
            if row.given_loss is not None or self.step_by == "manual":
                self._flush_row(None)
        for fn in self._callbacks:
            fn(self, ended, loss)

    def _flush_pending(self, loss: Optional[float]) -> None:
        step, self._pending = self._pending, None
        tapped, self._pending_tapped = self._pending_tapped, None
        if loss is None:
            loss = self._pending_loss
        if loss is None and tapped is not None:
            loss = float(tapped)
        attrs = {"rank": self.rank, "micro_batch": self.selection.micro_batch}
        if step in self._extra_steps:
            attrs["recorded_by"] = "alarm"
        self._writer.put_complete(step, loss=loss, **attrs)
        bisect.insort(self.recorded_steps, step)
        self._update_busy()

    def _set_hot(self, hot: bool) -> None:
        self._hot = hot
        self._update_busy()

    def _update_busy(self) -> None:
        self._ring_hot = self._ring is not None and self._monitor_hot and not self._hot
        self._active = self._hot or self._monitor_hot
        self.busy = self._active or self._pending is not None or self._row is not None

    def _begin_step(self, step: int) -> None:
        """Decide what the step that starts now does: record (selected or asked for by an alarm), monitor, ring."""
        self._monitor_hot = bool(self.monitor_every) and step % self.monitor_every == 0
        self._reported_loss = None
        if self._monitor_hot:
            self._collector.begin(step)
        self._set_hot(self.selection.wants_step(step) or step in self._extra_steps)

    # -- monitor -------------------------------------------------------------------------
    def on_backward(self, tensors, grad_tensors) -> None:
        """Called by the loss tap on busy steps: add a scalar loss to the step's sum (no synchronization)."""
        if not self._active:
            return
        value = loss_tap.scalar_loss(tensors, grad_tensors)
        if value is not None:
            self._tapped_loss = value if self._tapped_loss is None else self._tapped_loss + value

    def _monitor_call(self, call: AttentionCall) -> None:
        q, k, layer = call.q, call.k, call.layer
        if q.dim() != 4:
            return
        batch = self.selection.batch
        q_b, k_b = (q, k) if batch is None else (q[batch], k[batch])  # the capture's batch slice keeps it cheap
        if call.x is not None:
            name = call.x.name
        elif layer < len(self.attention_module_names):
            name = self.attention_module_names[layer]
        else:
            name = f"attention call {layer}"
        module = self._modules_by_name.get(name)
        from fa_forensics.monitor.collector import p_bar_dtype

        self._collector.observe_call(layer, q_b, k_b, scale=call.scale, causal=call.causal, p_dtype=p_bar_dtype(call.kernel_dtype),
                                     module=module, module_name=name)

    def _flush_row(self, loss: Optional[float]) -> None:
        """Write the pending timeline row (its loss: given now, else reported, else tapped) and run the alarm rule."""
        row, self._row = self._row, None
        step, series, explicit, tapped = row.step, row.series, row.given_loss, row.tapped_loss
        if loss is None:
            loss = explicit
        if loss is None and tapped is not None:
            loss = float(tapped)  # the one read of the tapped scalar (a device sync on GPU)
        ring_last = self._ring.last() if self._ring is not None else None
        if ring_last is not None and ring_last.step == step:
            ring_last.loss = loss
        if series is None:
            self._warn_once("monitor-empty", f"fa-forensics monitor: step {step} was monitored but no attention call was seen "
                                             "(with gradients enabled); its timeline row holds only the loss")
            series = {}
        alarms = []
        if self._rule is not None:
            alarms = self._rule.observe(step, loss=loss, near_max_ties=series.get("near_max_ties"), wq_sigma=series.get("wq_sigma"))
        self._writer.put_timeline(step, loss=float("nan") if loss is None else loss, alarms=len(alarms), **series)
        self.monitored_steps.append(step)
        if alarms:
            self._raise_alarm(step, alarms)
        self._update_busy()

    def _raise_alarm(self, step: int, alarms: list) -> None:
        """One AlarmWarning (one line); the next alarm_steps steps are recorded; the ring's steps are written."""
        self.alarms.extend(alarms)
        follow = range(step + 1, step + 1 + self.alarm_steps)
        self._extra_steps.update(follow)
        written = self._write_ring(step)
        self._writer.flush_timeline()  # the alarm's row (and those before it) on disk now
        first = max(alarms, key=lambda a: a.z)
        more = f" (+{len(alarms) - 1} more)" if len(alarms) > 1 else ""
        what = f"recording steps {follow.start}..{follow.stop - 1} in full" if self.alarm_steps > 0 else "no steps after it recorded (alarm_steps = 0)"
        if written:
            what += f", and steps {_span(written)} from the ring"
        warnings.warn(AlarmWarning(f"{first.message()}{more}; {what}"), stacklevel=2)
        if self.current_step in self._extra_steps and not self._hot:
            self._set_hot(True)

    def _write_ring(self, alarm_step: int) -> list[int]:
        if self._ring is None:
            return []
        written = []
        for held in self._ring.drain():
            if held.step in self.recorded_steps:
                continue
            self._writer.register_step(held.step)
            for a in held.arrays:
                self._writer.put_array(held.step, a.layer, a.name, a.tensor, ready=a.ready, layer_attrs=a.layer_attrs)
            self._writer.put_complete(held.step, loss=held.loss, rank=self.rank, micro_batch=self.selection.micro_batch,
                                      recorded_by="ring", alarm_step=int(alarm_step))
            bisect.insort(self.recorded_steps, held.step)
            written.append(held.step)
        return written

    # -- helpers -------------------------------------------------------------------------
    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _warn_once_key(self, key: str, message: str) -> None:
        self._warn_once(key, message)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(CaptureWarning(message), stacklevel=3)

    def _run_attrs(self) -> dict:
        from fa_forensics import __version__

        model_attrs = dict(self.run_attrs.get("model", {}))
        device = self.run_attrs.get("device")
        if self.model is not None:
            from fa_forensics.dump.identity import model_fingerprint

            described = describe_model(self.model)
            model_attrs = {**described["model"], "fingerprint": model_fingerprint(self.model), **model_attrs}
            device = device or described["device"]
        capture_attrs = {**self.selection.to_attrs(), "attention_modules": self.pattern, "step_by": self.step_by,
                         "rank": self.rank, "world_size": self.world_size, **self.run_attrs.get("capture", {})}
        if self.monitor_every:
            capture_attrs["monitor"] = {
                "every": self.monitor_every, "eps": self.monitor_eps,
                "alarm": None if self._rule is None else {"window": self._rule.window, "min_history": self._rule.min_history,
                                                          "z_threshold": self._rule.z_threshold, "min_change": dict(self._rule.min_change)},
                "alarm_steps": self.alarm_steps, "ring": 0 if self._ring is None else self._ring.capacity,
                "timeline_flush_rows": self.timeline_flush_rows,
            }
        return {
            **{k: v for k, v in self.run_attrs.items() if k not in ("model", "capture")},
            "tool_version": __version__,
            "torch_version": torch.__version__,
            "device": device or "unknown",
            "amp_dtype": self.run_attrs.get("amp_dtype", "recorded per layer (attrs.dtype)"),
            "model": model_attrs,
            "capture": capture_attrs,
            "world_size": self.world_size,
        }


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


def check_attention_pattern(pattern: str) -> None:
    """InvalidCaptureSetting("attention_modules") for a module-name regex that does not compile."""
    import re

    try:
        re.compile(pattern)
    except (re.error, TypeError) as exc:
        raise InvalidCaptureSetting("attention_modules", f"{pattern!r} is not a valid regular expression ({exc}); e.g. 'attn$'") from None


def check_monitor_options(monitor_every, alarm, alarm_steps, ring) -> None:
    """InvalidCaptureSetting for monitor settings that cannot work (together)."""
    if monitor_every is not None and (not isinstance(monitor_every, int) or monitor_every < 1):
        raise InvalidCaptureSetting("monitor_every", f"must be a step interval >= 1, got {monitor_every!r}")
    if alarm and not monitor_every:
        raise InvalidCaptureSetting("alarm", "the alarm watches the monitor's statistics (e.g. every step: 1)", needs=("monitor_every",))
    if int(alarm_steps) < 0:
        raise InvalidCaptureSetting("alarm_steps", f"must be >= 0, got {alarm_steps}")
    if int(ring) < 0:
        raise InvalidCaptureSetting("ring", f"must be >= 0 steps, got {ring}")
    if ring and not alarm:
        raise InvalidCaptureSetting("ring", "the ring keeps recent steps for the alarm to write", needs=("alarm", "monitor_every"))


def _span(steps: list[int]) -> str:
    """'5..8' for consecutive steps, else '5, 7, 9'."""
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}"
    return ", ".join(map(str, steps))


def _autocast_dtype(q: torch.Tensor) -> Optional[torch.dtype]:
    """Autocast's dtype on q's device when autocast is on there, else None."""
    device_type = q.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _as_float(loss) -> Optional[float]:
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().item())
    return float(loss)


_ACTIVE: Optional[CaptureSession] = None


def _set_active(session: Optional[CaptureSession]) -> None:
    global _ACTIVE
    _ACTIVE = session


def active() -> Optional[CaptureSession]:
    """The active capture session, or None."""
    return _ACTIVE
