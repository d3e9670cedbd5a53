"""The capture session: a context manager that records Q, K, V, O, dO and X at chosen training steps.

Conventions (also in docs/capture.md):
- Step k, counting from 0, is the training iteration whose forward/backward passes precede the
  (k+1)-th `optimizer.step()` call (nanoGPT's iter_num). Steps are counted through a global
  optimizer step post-hook on the first optimizer that steps (`step_by="optimizer"`), or only by
  `cap.step()` calls (`step_by="manual"`).
- Layers are numbered from 0 in the order attention calls run within the recorded forward pass.
- With gradient accumulation the forward pass number `micro_batch` (default 0, the first) of a
  step is recorded. Forward passes with gradients disabled (evaluation) are never recorded.
- Only one session is active at a time. Hooks and the SDPA patch are removed on exit, also when
  the block raises; steps that ended before the error are completed, the cut one is not.

Hot path: on a step that is not selected, the SDPA patch, the wrappers of the other watched entry
points (capture/entry_points.py, capture/adapters.py) and every hook check one boolean (`busy`, or
`_active` for the attention modules' input hooks) and return; nothing is cloned, nothing synchronizes.

torch.compile: the hooks and the SDPA patch are traced by dynamo. Each reads its flag in traced
code (dynamo turns the read into a guard: a step that is not busy runs exactly the graph of a run
without capture) and hands over to a `torch.compiler.disable` function only when the flag is set:
busy steps run a second graph, compiled once, that breaks at the hand-overs. No session state is
mutated inside traced code.

Monitor (`monitor_every=N`), alarm and ring: `capture/monitoring.py` (StepMonitor); the session
tells it where steps begin and end, which calls it sees and which losses it is given. A step whose
recorded arrays wait for the step's loss is a `PendingStep`.
"""
from __future__ import annotations

import bisect
import os
import warnings
from dataclasses import dataclass
from collections.abc import Callable
from typing import Optional, Union

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fa_forensics.capture import loss_tap, sdpa
from fa_forensics.capture.adapters import WATCHED_TEXT, built_in_entry_points
from fa_forensics.capture.entry_points import EntryPoint, EntryPointPatcher, TargetSpec
from fa_forensics.capture.events import AttentionCall, CaptureWarning, ModuleInput
from fa_forensics.capture.layouts import check_attention_shapes, check_layout, to_bhtd
from fa_forensics.capture.modules import (
    DEFAULT_ATTENTION_PATTERN, describe_model, find_attention_modules, module_input, replace_module_input,
)
from fa_forensics.capture.selection import (
    CaptureError, CaptureSelection, InvalidCaptureSetting, check_attention_pattern, check_monitor_options,
)
from fa_forensics.capture.monitoring import StepMonitor
from fa_forensics.capture.softmax_variant import SoftmaxVariant
from fa_forensics.capture.recorder import Recorder
from fa_forensics.capture.ring import RingArray, RingStep
from fa_forensics.capture.writer import BackgroundWriter, offload

StepCallback = Callable[["CaptureSession", int, Optional[float]], None]


@dataclass
class StepProgress:
    """Where the step in progress is: reset at every step boundary."""

    micro: int = -1  # index of the current forward pass within the step
    layer: int = 0  # attention calls so far in the current forward pass
    backward_seen: bool = False  # fallback micro-batch detection when no root module is known
    recorded: bool = False  # an array of the step was queued
    calls: int = 0  # attention calls seen with gradients enabled
    loss: Optional[float] = None  # loss given by cap.step() before the boundary


@dataclass
class PendingStep:
    """A recorded step that ended and waits for its loss before it is marked complete in the store."""

    step: int
    loss: Optional[float]  # given at the boundary (or by cap.step() before it)
    tapped: Optional[torch.Tensor]  # the loss tap's sum, the fallback


RANK0_WAIT_SECONDS = 300.0  # how long a rank > 0 waits for rank 0 to create the store (without a process group)


def _rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) from torch.distributed if initialized, else the launcher's environment (RANK and
    WORLD_SIZE, set by torchrun and torch.distributed.launch), else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _launcher_run_id() -> Optional[str]:
    """The id torchrun gives every rank of one run (its rendezvous id), None when there is none."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None


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
        attention=(),
        softmax: Optional[str] = None,
        process_rank: Optional[tuple[int, int]] = None,
        run_id: Optional[str] = None,
    ):
        if step_by not in ("optimizer", "manual"):
            raise CaptureError(f"step_by must be 'optimizer' or 'manual', got {step_by!r}")
        check_monitor_options(monitor_every, alarm, alarm_steps, ring)
        if int(timeline_flush_rows) < 1:
            raise CaptureError("timeline_flush_rows must be >= 1 (timeline rows appended at a time), got "
                               f"{timeline_flush_rows}")
        self.selection = CaptureSelection.build(steps, layers, heads, batch, micro_batch,
                                                allow_no_steps=bool(monitor_every))
        check_attention_pattern(attention_modules)
        self.targets = [t if isinstance(t, TargetSpec) else TargetSpec.parse(t) for t in (attention or ())]
        self.softmax = SoftmaxVariant.parse(softmax)
        self._patcher: Optional[EntryPointPatcher] = None
        self._tapped_loss: Optional[torch.Tensor] = None  # sum of the scalars backward() ran on in a recorded step
        self._entry_depth = 0  # > 0 inside a watched entry point's call: attention calls within it are its own
        self.attention_calls_seen = 0  # attention calls seen with gradients enabled on busy steps
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
        self._now = StepProgress()
        self._pending: Optional[PendingStep] = None
        self._pending_x: Optional[ModuleInput] = None
        self._optimizer_id: Optional[int] = None
        self._handles: list = []
        self._root: Optional[torch.nn.Module] = None
        self._writer: Optional[BackgroundWriter] = None
        self._warned: set[str] = set()
        self.recorded_steps: list[int] = []
        self.steps_without_attention: list[int] = []  # selected steps that ran without a recordable attention call
        self._registered: set[int] = set()  # steps put in the store (as incomplete) when their first array was queued
        self.rank, self.world_size = 0, 1
        self._process_rank = process_rank  # (rank, world size) the launcher gave, else found at start()
        self.run_id = run_id or _launcher_run_id()  # shared by the ranks of one run: orders their store opening
        self.attention_module_names: list[str] = []
        self._modules_by_name: dict[str, torch.nn.Module] = {}
        self.timeline_flush_rows = int(timeline_flush_rows)
        self._monitor: Optional[StepMonitor] = (
            StepMonitor(monitor_every, eps=monitor_eps, alarm=alarm, alarm_steps=alarm_steps,
                        ring=ring) if monitor_every else None)
        self._ring_hot = False  # the current step's selected layers go to the monitor's ring
        self._active = False  # the current step needs its attention calls (recorded or monitored)

    @property
    def monitor_every(self) -> Optional[int]:
        return None if self._monitor is None else self._monitor.every

    @property
    def alarms(self) -> list:
        """Every Alarm raised."""
        return [] if self._monitor is None else self._monitor.alarms

    @property
    def monitored_steps(self) -> list[int]:
        """Steps whose timeline row was written."""
        return [] if self._monitor is None else self._monitor.monitored_steps

    def _monitor_hot(self) -> bool:
        return self._monitor is not None and self._monitor.hot

    def _row_waiting(self) -> bool:
        return self._monitor is not None and self._monitor.row is not None

    # -- public API ----------------------------------------------------------------------
    def __enter__(self) -> CaptureSession:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(failed=exc_type is not None)

    def add_step_callback(self, fn: StepCallback) -> None:
        """Call fn(session, step, loss) after every step boundary (selected or not): the place for per-step
        statistics."""
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
        row_waiting = self._row_waiting()
        if row_waiting:
            self._flush_row(loss)
        if self._pending is not None:
            self._flush_pending(loss)
        elif self._hot and self._now.recorded:  # called before optimizer.step(): the loss of the current step
            self._now.loss = loss
        if not row_waiting and self._monitor_hot():
            self._monitor.reported_loss = loss

    def record(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, scale: Optional[float] = None,
               causal: bool = True, x: Optional[torch.Tensor] = None, layout: str = "BHTD",
               mask: Optional[torch.Tensor] = None) -> None:
        """Record one attention call of custom attention code: q, k, v, o in `layout` (BHTD: (B, H, T, D);
        BTHD: (B, T, H, D)), shapes checked; mask SDPA-style (B or 1, H or 1, Tq, Tk); x (B, T, C) optional."""
        if self.busy:
            self._record_eager(q, k, v, o, scale, causal, x, check_layout(layout), mask)

    @torch.compiler.disable
    def _record_eager(self, q, k, v, o, scale, causal, x, layout, mask) -> None:
        check_attention_shapes(q, k, v, o, layout, "fa_forensics.capture.record")
        if x is not None:
            self._pending_x = ModuleInput("record", x)
        grad_sink = None
        if layout != "BHTD" and o.requires_grad:
            def grad_sink(hook, o=o):
                o.register_hook(lambda grad: hook(to_bhtd(grad, layout)))
        self.on_attention(to_bhtd(q, layout), to_bhtd(k, layout), to_bhtd(v, layout), to_bhtd(o, layout), scale=scale,
                          causal=causal, attn_mask=mask, dropout_p=0.0, source="record", grad_sink=grad_sink,
                          extra={"layout": layout})

    @torch.compiler.disable
    def _on_entry_point(self, ep: EntryPoint, args: tuple, kwargs: dict, out) -> None:
        """A watched entry point returned on a busy step: read the call with its adapter and record it."""
        facts = ep.adapter(args, kwargs, out)
        if facts is None:
            self._warn_once(f"unread:{ep.name}", f"fa-forensics capture: a call of {ep.name} did not pass tensors "
                                                 "as its first three arguments and return one; it is not recorded")
            return
        if facts.warning:
            self._warn_once(f"call:{ep.name}:{facts.warning}", facts.warning)
        self.on_attention(facts.q, facts.k, facts.v, facts.o, scale=facts.scale, causal=facts.causal,
                          attn_mask=facts.mask, dropout_p=facts.dropout_p, source=ep.name, grad_sink=facts.grad_sink,
                          extra=facts.attrs)

    def no_attention_message(self, step: int) -> str:
        """One line for a selected step that ran without an attention call: what is watched, how to add one."""
        return (f"fa-forensics capture: step {step} ran but no attention call was seen with gradients enabled "
                f"(watched: {self.watched_text()}); if the model's attention is its own code, name it with "
                "--attention MODULE:QUALNAME[,layout=BTHD] (e.g. attention:FlashAttentionFunction; attention=[...] "
                "in Python) or call fa_forensics.capture.record(q, k, v, o, layout=...) in it")

    def _entry_point_busy(self) -> bool:
        return self.busy

    def watched_text(self) -> str:
        """The attention entry points this session watches, for messages."""
        return WATCHED_TEXT + "".join(f", {t.to_text()}" for t in self.targets)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if sdpa.active_session() is not None:
            raise CaptureError("another fa-forensics capture session is already active; leave it before starting a new "
                               "one")
        from fa_forensics.dump import DumpWriter  # lazy: keeps `import fa_forensics.capture` light

        self.rank, self.world_size = self._process_rank or _rank_and_world_size()
        attrs = self._run_attrs()
        dist = torch.distributed
        ordered = (self._process_rank is None and self.world_size > 1 and dist.is_available()
                   and dist.is_initialized())
        if ordered and self.rank != 0:
            dist.barrier()  # rank 0 creates (or replaces) the store first; then every rank adds rank_{r}/
        try:  # without a process group the ranks order themselves through rank 0's lock file (dump/ranks.py)
            dump_writer = DumpWriter(self.out, attrs, overwrite=self.overwrite and self.rank == 0, rank=self.rank,
                                     world_size=self.world_size,
                                     allow_other_model=self.allow_other_model, run_id=self.run_id,
                                     rank0_wait=None if ordered or self.world_size == 1 else RANK0_WAIT_SECONDS)
        except OSError as exc:
            raise InvalidCaptureSetting("out",
                                        f"cannot create capture store {self.out}: {exc.strerror or exc}; it must be a "
                                        "writable path") from exc
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
            self._patcher = EntryPointPatcher(self._entry_point_busy, self._on_entry_point, self._enter_entry_point)
            self._patcher.install(built_in_entry_points() + [t.entry_point() for t in self.targets])
            if self._monitor is not None:
                self._monitor.start(self._warn_once)
            loss_tap.install(self)  # the loss of recorded steps when the script does not call cap.step(loss)
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
        self._uninstall_entry_points()
        loss_tap.uninstall(self)
        _set_active(None)
        if self._writer is None:
            return
        try:
            self._flush_waiting()
            if self._monitor is not None:
                self._monitor.close()
            self.busy = self._hot = self._active = self._ring_hot = False
        finally:
            writer, self._writer = self._writer, None
            try:
                writer.close(failed=failed)
            except Exception as exc:
                if not failed:
                    raise
                warnings.warn(f"fa-forensics capture: closing the store after an error also failed: {exc}",
                              RuntimeWarning, stacklevel=2)

    def _enter_entry_point(self, delta: int) -> None:
        self._entry_depth += delta

    def _uninstall_entry_points(self) -> None:
        patcher, self._patcher = self._patcher, None
        if patcher is None:
            return
        missing = [t.to_text() for t in self.targets if t.entry_point().name not in patcher.patched]
        patcher.uninstall()
        for name in missing:
            self._warn_once(f"target:{name}", f"fa-forensics capture: --attention {name} was never patched: its "
                                              "module was not imported during the run or has no such callable; check "
                                              "MODULE:QUALNAME (the module must be importable, not the training "
                                              "script itself)")

    def bind(self, model: torch.nn.Module) -> int:
        """Hook `model`: its forward starts a micro-batch; its attention modules give X. Returns the count found."""
        self._root = model
        # bound by the launcher: check the store's identity, describe the model
        if self.model is None and self._writer is not None:
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
        self._flush_waiting()
        self._now.micro += 1
        self._now.layer = 0
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

    def on_attention(self, q, k, v, o, *, scale, causal: bool, attn_mask: Optional[torch.Tensor], dropout_p: float,
                     source: str,
                     grad_sink: Optional[Callable] = None, grad_enabled: Optional[bool] = None,
                     autocast_dtype: Union[torch.dtype, None, str] = "ambient", extra: Optional[dict] = None) -> None:
        """Called by the SDPA patch and `record` on busy steps; decides whether this call is recorded or monitored.

        grad_sink: inside a compiled graph O carries no autograd history here; the dO hook is handed
        to grad_sink instead of being registered on O. grad_enabled, autocast_dtype: the grad mode and
        autocast dtype (None: autocast off) the call was traced in; by default the ones in effect now.
        """
        if self._entry_depth > 0:
            return  # inside a watched entry point: its own call is recorded when it returns
        if autocast_dtype == "ambient":
            autocast_dtype = sdpa.autocast_dtype(q)
        self._flush_waiting()
        if not self._active or not (torch.is_grad_enabled() if grad_enabled is None else grad_enabled):
            return
        self.attention_calls_seen += 1
        self._now.calls += 1
        if self._root is None:  # no module tree: a new forward pass starts after a backward pass
            now = self._now
            if now.micro < 0 or now.backward_seen:
                now.micro += 1
                now.layer = 0
                now.backward_seen = False
        layer = self._now.layer
        self._now.layer += 1
        x, self._pending_x = self._pending_x, None
        if self._now.micro != self.selection.micro_batch:
            if self._root is None and self._now.micro < self.selection.micro_batch and o.requires_grad:
                o.register_hook(self._mark_backward)
            return
        extra = {"source": source, "softmax": self.softmax.variant_for(source),
                 "softmax_rule": self.softmax.to_text() or "none", **(extra or {})}
        call = AttentionCall(step=self.current_step, layer=layer, q=q, k=k, v=v, o=o, scale=scale, causal=causal,
                             mask=attn_mask,
                             dropout_p=dropout_p, autocast_dtype=autocast_dtype, source=source, x=x,
                             grad_sink=grad_sink, extra=extra)
        if self._monitor_hot():
            name = self._module_name(call)
            self._monitor.observe(call, self.selection.batch, name, self._modules_by_name.get(name))
        if (self._hot or self._ring_hot) and self.selection.wants_layer(layer):
            if not self._hot:
                self._monitor.ring_step_for(call.step)
            if self._recorder.record(call):
                self._now.recorded = True
            else:
                self._warn_once("dims",
                                f"fa-forensics capture: skipped an attention call with q of shape {tuple(q.shape)}; "
                                "only (B, H, T, D) is recorded")

    # -- recording -----------------------------------------------------------------------
    def _queue_array(self, step: int, layer: int, name: str, tensor: torch.Tensor, layer_attrs: dict) -> None:
        """Where the recorder's arrays go: the ring while the step is held there, else the background writer."""
        host, ready = offload(tensor)
        ring_step = None if self._monitor is None else self._monitor.ring_step
        if ring_step is not None and ring_step.step == step:
            ring_step.arrays.append(RingArray(layer, name, host, ready, layer_attrs))
        else:
            if step not in self._registered:
                self._registered.add(step)
                self._writer.register_step(step)
            self._writer.put_array(step, layer, name, host, ready=ready, layer_attrs=layer_attrs)

    def _mark_backward(self, grad=None) -> None:
        self._now.backward_seen = True

    # -- step boundaries -----------------------------------------------------------------
    def _flush_waiting(self) -> None:
        """Write what waited for a loss that did not come (a new forward pass, call or boundary began)."""
        if self._row_waiting():
            self._flush_row(None)
        if self._pending is not None:
            self._flush_pending(None)

    def _end_step(self, loss: Optional[float]) -> None:
        ended = self.current_step
        self._flush_waiting()
        if self._monitor is not None:
            tapped = self._monitor.take_tapped_loss()
        else:
            tapped, self._tapped_loss = self._tapped_loss, None
        if self._hot:
            if self._now.recorded:
                self._pending = PendingStep(ended, loss if loss is not None else self._now.loss, tapped)
                if self._pending.loss is not None or self.step_by == "manual":
                    self._flush_pending(None)
            else:
                self.steps_without_attention.append(ended)
                if self._now.calls:
                    self._warn_once("unselected", f"fa-forensics capture: step {ended} ran {self._now.calls} attention "
                                                  "call(s) but none was selected (check --layers and --micro-batch "
                                                  "against the model); nothing recorded for it")
                else:
                    self._warn_once("empty", self.no_attention_message(ended))
        if self._monitor is not None:
            self._monitor.end_step(ended, loss, tapped)
        self.current_step = ended + 1
        self._now = StepProgress()
        self._begin_step(self.current_step)
        if self._row_waiting():
            self._update_busy()
            if self._monitor.row.given_loss is not None or self.step_by == "manual":
                self._flush_row(None)
        for fn in self._callbacks:
            fn(self, ended, loss)

    def _flush_pending(self, loss: Optional[float]) -> None:
        pending, self._pending = self._pending, None
        if loss is None:
            loss = pending.loss
        if loss is None and pending.tapped is not None:
            loss = float(pending.tapped)
        attrs = {"rank": self.rank, "micro_batch": self.selection.micro_batch}
        if self._monitor is not None and pending.step in self._monitor.extra_steps:
            attrs["recorded_by"] = "alarm"
        self._writer.put_complete(pending.step, loss=loss, **attrs)
        bisect.insort(self.recorded_steps, pending.step)
        self._update_busy()

    def _set_hot(self, hot: bool) -> None:
        self._hot = hot
        self._update_busy()

    def _update_busy(self) -> None:
        monitor_hot = self._monitor_hot()
        self._ring_hot = self._monitor is not None and self._monitor.holds_ring(self._hot)
        self._active = self._hot or monitor_hot
        self.busy = self._active or self._pending is not None or self._row_waiting()

    def _begin_step(self, step: int) -> None:
        """Decide what the step that starts now does: record (selected or asked for by an alarm), monitor, ring."""
        asked = False
        if self._monitor is not None:
            self._monitor.begin_step(step)
            asked = step in self._monitor.extra_steps
        self._set_hot(self.selection.wants_step(step) or asked)

    # -- monitor ---------------------------------------------------------------------------
    def on_backward(self, tensors, grad_tensors) -> None:
        """Called by the loss tap on busy steps: add a scalar loss to the step's sum (no synchronization)."""
        if not self._active:
            return
        value = loss_tap.scalar_loss(tensors, grad_tensors)
        if value is None:
            return
        if self._monitor is not None:
            self._monitor.add_tapped_loss(value)
        elif self._hot:
            self._tapped_loss = value if self._tapped_loss is None else self._tapped_loss + value

    def _module_name(self, call: AttentionCall) -> str:
        """The attention module of a call: the one whose input X came with it, else by call order."""
        if call.x is not None:
            return call.x.name
        if call.layer < len(self.attention_module_names):
            return self.attention_module_names[call.layer]
        return f"attention call {call.layer}"

    def _flush_row(self, loss: Optional[float]) -> None:
        """Write the monitor's waiting timeline row; an alarm it raises may ask for the current step."""
        self._monitor.flush_row(loss, self._writer, self._write_held, self._warn_once)
        if self.current_step in self._monitor.extra_steps and not self._hot:
            self._set_hot(True)
        self._update_busy()

    def _write_held(self, held: RingStep, alarm_step: int) -> bool:
        """Write a step the ring held (unless it is recorded already); True when written."""
        if held.step in self.recorded_steps:
            return False
        self._writer.register_step(held.step)
        for a in held.arrays:
            self._writer.put_array(held.step, a.layer, a.name, a.tensor, ready=a.ready, layer_attrs=a.layer_attrs)
        self._writer.put_complete(held.step, loss=held.loss, rank=self.rank, micro_batch=self.selection.micro_batch,
                                  recorded_by="ring", alarm_step=int(alarm_step))
        bisect.insort(self.recorded_steps, held.step)
        return True

    # -- helpers -------------------------------------------------------------------------
    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

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
                         "rank": self.rank, "world_size": self.world_size,
                         "attention": [t.to_text() for t in self.targets], "softmax": self.softmax.to_text() or "none",
                         **self.run_attrs.get("capture", {})}
        if self._monitor is not None:
            capture_attrs["monitor"] = {**self._monitor.attrs(), "timeline_flush_rows": self.timeline_flush_rows}
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
