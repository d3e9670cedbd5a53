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
points (capture/entry_points.py, capture/adapters.py) and every hook check one boolean (`busy`, or the
step plan's `active` for the attention modules' input hooks) and return; nothing is cloned, nothing synchronizes.
What a step does (recorded in full, monitored, held in the ring, nothing) is its `StepPlan`
(capture/step_plan.py), decided when it begins and again when an alarm asks for it.

torch.compile: the hooks and the SDPA patch are traced by dynamo. In traced code they read no
session state (dynamo would turn a read into a guard, and the first recorded step would recompile):
they insert the opaque custom ops of capture/graph_ops.py on every step, and the ops' bodies read
the flags when the compiled graph runs. One graph, compiled at the session's first step, serves
recorded and unrecorded steps. No session state is mutated inside traced code.

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
from types import TracebackType
from typing import Any, Optional, SupportsFloat, Union

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fa_forensics.capture import loss_tap, sdpa
from fa_forensics.capture.adapters import WATCHED, built_in_entry_points
from fa_forensics.capture.entry_points import CallFacts, EntryPoint, EntryPointPatcher
from fa_forensics.capture.events import AttentionCall, CaptureWarning, ModuleInput
from fa_forensics.capture.hf_attention import hf_call_facts, hf_entry_points
from fa_forensics.capture.call_screen import SourceChecks, relaid
from fa_forensics.capture.layouts import (
    LayoutVerdict, Reading, check_attention_shapes, check_call_context, check_layout, to_bhtd,
)
from fa_forensics.capture.modules import (
    describe_model, find_attention_modules, module_heads, module_input, replace_module_input,
)
from fa_forensics.capture.selection import CaptureError, InvalidCaptureSetting
from fa_forensics.capture.monitoring import StepMonitor
from fa_forensics.capture.settings import CaptureSettings
from fa_forensics.capture.recorder import Recorder
from fa_forensics.capture.chain_call import combine_mask, to_heads
from fa_forensics.capture.torch_ops import ChainScope, PlainCall
from fa_forensics.capture.ring import RingArray, RingStep
from fa_forensics.capture.step_plan import StepPlan
from fa_forensics.capture.writer import BackgroundWriter, offload

StepCallback = Callable[["CaptureSession", int, Optional[float]], None]
GradHook = Callable[[torch.Tensor], None]  # the recorder's dO hook, handed a gradient as (B, H, T, D)
Loss = Union[torch.Tensor, SupportsFloat, None]  # a loss as scripts give it


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

    def __init__(self, model: Optional[torch.nn.Module], settings: CaptureSettings, *,
                 on_step: Optional[StepCallback] = None, run_attrs: Optional[dict] = None,
                 process_rank: Optional[tuple[int, int]] = None):
        """model: bound at start (None: the launcher binds one at its first forward, or SDPA/record-only capture);
        settings: what to record and how (checked when they were made); on_step: a step callback; run_attrs: store
        attributes merged into the run's; process_rank: (rank, world size) the launcher gave, else found at start()."""
        self.settings = settings
        self.selection = settings.selection
        self.targets = list(settings.attention)
        self._target_names = {t.to_text() for t in self.targets}
        self.softmax = settings.softmax
        self._patcher: Optional[EntryPointPatcher] = None
        self._tapped_loss: Optional[torch.Tensor] = None  # sum of the scalars backward() ran on in a recorded step
        self._entry_depth = 0  # > 0 inside a watched entry point's call: attention calls within it are its own
        self.attention_calls_seen = 0  # attention calls seen with gradients enabled on busy steps
        self.out = settings.out
        self.model = model
        self.pattern = settings.attention_modules
        self.step_by = settings.step_by
        self.run_attrs = dict(run_attrs or {})
        self._callbacks: list[StepCallback] = [on_step] if on_step else []
        self._recorder = Recorder(self.selection, self._queue_array, self._mark_backward)
        # step state
        self.current_step = 0
        self.busy = False  # the one flag every hook checks: this step is selected, or a step awaits completion
        self._plan = StepPlan(0)  # what the step in progress does (recorded, monitored, held in the ring)
        self._now = StepProgress()
        self._pending: Optional[PendingStep] = None
        self._pending_x: Optional[ModuleInput] = None
        self._optimizer_id: Optional[int] = None
        self._handles: list = []
        self._root: Optional[torch.nn.Module] = None
        self._writer: Optional[BackgroundWriter] = None
        self._warned: set[str] = set()
        self._source_checks = SourceChecks()  # the first recorded call of each source, checked
        self._skipped: list[dict] = []  # calls not stored, with why (the store's capture.skipped_calls)
        self.recorded_steps: list[int] = []
        self.steps_without_attention: list[int] = []  # selected steps that ran without a recordable attention call
        self._registered: set[int] = set()  # steps put in the store (as incomplete) when their first array was queued
        self.rank, self.world_size = 0, 1
        self._process_rank = process_rank  # (rank, world size) the launcher gave, else found at start()
        self.run_id = settings.run_id or _launcher_run_id()  # shared by a run's ranks: orders their store opening
        self.attention_module_names: list[str] = []
        self._modules_by_name: dict[str, torch.nn.Module] = {}
        self._monitor: Optional[StepMonitor] = StepMonitor(settings) if settings.monitor_every else None
        # attention written as torch ops: a mode on the stack for the root's forward passes of active steps
        self._chains = ChainScope(self._on_plain_call, self._on_chain_error)
        self._held_chain: Optional[HeldChain] = None
        self._held_alarm: dict[int, RingStep] = {}  # steps an alarm asked for, held until they end
        self._frames: list[HFFrame] = []  # Hugging Face attention functions running now (innermost last)
        self._frame_module: object = None  # the module of the Hugging Face call being recorded from its own arguments

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

    def _row_waiting(self) -> bool:
        return self._monitor is not None and self._monitor.row is not None

    # -- public API ----------------------------------------------------------------------
    def __enter__(self) -> CaptureSession:
        self.start()
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.stop(failed=exc_type is not None)

    def add_step_callback(self, fn: StepCallback) -> None:
        """Call fn(session, step, loss) after every step boundary (selected or not): the place for per-step
        statistics."""
        self._callbacks.append(fn)

    def step(self, loss: Loss = None) -> None:
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
        elif self._plan.record and self._now.recorded:  # called before optimizer.step(): the loss of the current step
            self._now.loss = loss
        if not row_waiting and self._plan.monitor and self._monitor is not None:
            self._monitor.reported_loss = loss

    def record(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, scale: Optional[float] = None,
               causal: bool = True, x: Optional[torch.Tensor] = None, layout: str = "BHTD",
               mask: Optional[torch.Tensor] = None, softmax: Optional[str] = None) -> None:
        """Record one attention call of custom attention code: q, k, v, o in `layout` (BHTD: (B, H, T, D);
        BTHD: (B, T, H, D)), shapes checked; mask SDPA-style (B or 1, H or 1, Tq, Tk); x (B, T, C) optional;
        softmax: "standard" or "stabilized" when the caller knows it."""
        if softmax is not None and softmax not in ("standard", "stabilized"):
            raise InvalidCaptureSetting("softmax", f"record(..., softmax={softmax!r}): write 'standard' or "
                                                   "'stabilized'")
        if self.busy:
            self._record_eager(q, k, v, o, scale, causal, x, check_layout(layout), mask, softmax)

    @torch.compiler.disable
    def _record_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, scale: Optional[float],
                      causal: bool, x: Optional[torch.Tensor], layout: str, mask: Optional[torch.Tensor],
                      softmax: Optional[str] = None) -> None:
        check_attention_shapes(q, k, v, o, layout, "fa_forensics.capture.record")
        chain_facts = self._flush_chain(described_by=(q, k))
        if x is not None:
            self._pending_x = ModuleInput("record", x)
        grad_sink: Optional[Callable[[GradHook], None]] = None
        if layout != "BHTD" and o.requires_grad:
            def sink(hook: GradHook, o: torch.Tensor = o) -> None:
                o.register_hook(lambda grad: hook(to_bhtd(grad, layout)))
            grad_sink = sink
        self.on_attention(to_bhtd(q, layout), to_bhtd(k, layout), to_bhtd(v, layout), to_bhtd(o, layout), scale=scale,
                          causal=causal, attn_mask=mask, dropout_p=0.0, source="record", grad_sink=grad_sink,
                          extra={**_chain_facts(chain_facts), "layout": layout,
                                 **({"softmax": softmax, "softmax_rule": "record(softmax=...)"} if softmax else {})})

    @torch.compiler.disable
    def _on_entry_point(self, ep: EntryPoint, args: tuple, kwargs: dict, out: Any) -> None:
        """A watched entry point returned on a busy step: read the call with its adapter and record it."""
        if ep.adapter is None:
            return  # an entry point patched with `wrap` reports no call
        self._chains.pause(1)
        try:
            facts = ep.adapter(args, kwargs, out)
        finally:
            self._chains.pause(-1)
        if facts is None:
            self._warn_once(f"unread:{ep.name}", f"fa-forensics capture: a call of {ep.name} did not pass tensors "
                                                 "for q, k, v and return one; it is not recorded (map them with "
                                                 "q=NAME,k=NAME,v=NAME,out=INDEX in --attention)")
            return
        self._record_facts(facts, ep.name)

    def _record_facts(self, facts: CallFacts, source: str) -> None:
        if facts.warning:
            self._warn_once(f"call:{source}:{facts.warning}", facts.warning)
        self.on_attention(facts.q, facts.k, facts.v, facts.o, scale=facts.scale, causal=facts.causal,
                          attn_mask=facts.mask, dropout_p=facts.dropout_p, source=source, grad_sink=facts.grad_sink,
                          extra=facts.attrs)

    @torch.compiler.disable
    def hf_attention_call(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A Hugging Face attention function called on a busy step (capture/hf_attention.py): the calls inside it
        are recorded as its; when none was seen, the call itself is read in HF's layouts."""
        frame = HFFrame(name, args[0] if args else kwargs.get("module"))
        self._frames.append(frame)
        try:
            out = fn(*args, **kwargs)
        finally:
            self._frames.pop()
        if frame.seen == 0 and self._entry_depth == 0:
            self._chains.pause(1)
            try:
                facts = hf_call_facts(name, args, kwargs, out)
            finally:
                self._chains.pause(-1)
            if facts is not None:
                self._frame_module = frame.module
                try:
                    self._record_facts(facts, f"transformers:{name}")
                finally:
                    self._frame_module = None
        return out

    def _on_plain_call(self, call: PlainCall) -> None:
        """An attention chain written in torch ops formed its output (capture/torch_ops.py). It is held until
        the next attention event: a `record()` of the same Q and K right after it describes the same call
        (code written before chains were followed reports its own attention), and then only that is recorded."""
        self._flush_chain()
        if self._entry_depth > 0:
            return  # inside a watched entry point: its own call is recorded when it returns
        frame_facts = self._in_frame({}) if self._frames else {}
        x = self._pending_x
        module = self._modules_by_name.get(x.name) if x is not None else None
        batch = int(x.tensor.shape[0]) if x is not None and x.tensor.dim() == 3 else None
        q, k, v, o, shape4, grad4 = to_heads(call, batch, module_heads(module))
        mask, causal = combine_mask(call, shape4)
        o_raw = call.o_raw
        grad_sink: Optional[Callable[[GradHook], None]] = None
        if o_raw.requires_grad:
            def sink(hook: GradHook, o_raw: torch.Tensor = o_raw) -> None:
                o_raw.register_hook(lambda grad: hook(grad4(grad)))
            grad_sink = sink
        extra = {**frame_facts, **call.extra, "layout": call.layout, "chain": " ".join(call.ops),
                 "score_dtype": _dtype_name(call.score_dtype), "softmax_dtype": _dtype_name(call.softmax_dtype),
                 "p_dtype": _dtype_name(call.p_dtype)}
        for name, value in (("q_scale", call.q_scale), ("k_scale", call.k_scale), ("softcap", call.softcap)):
            if value is not None:
                extra[name] = float(value)
        self._held_chain = HeldChain(x, (call.q, call.k), dict(
            q=q, k=k, v=v, o=o, scale=call.scale, causal=causal, attn_mask=mask, dropout_p=call.dropout_p,
            source="torch_ops", grad_sink=grad_sink, extra=extra))

    def _flush_chain(self, described_by: Optional[tuple] = None) -> Optional[dict]:
        """Record the held chain; or, when `described_by` (q, k of a record() call) are views of its Q and K,
        drop it and return its facts for that call."""
        held, self._held_chain = self._held_chain, None
        if held is None:
            return None
        if described_by is not None and all(_same_storage(a, b) for a, b in zip(described_by, held.qk)):
            return held.call["extra"]
        x, self._pending_x = self._pending_x, held.x
        self.on_attention(**held.call)
        self._pending_x = x
        return None

    def _in_frame(self, extra: Optional[dict]) -> dict:
        """Count a call made inside the innermost Hugging Face attention function and name that function."""
        frame = self._frames[-1]
        frame.seen += 1
        return {**(extra or {}), "hf_attention": frame.name}

    def _on_chain_error(self, exc: BaseException) -> None:
        self._warn_once("chain-error", "fa-forensics capture: following attention written in torch ops failed "
                                       f"({type(exc).__name__}: {exc}); such attention is not recorded in this forward "
                                       "pass. Training is not affected")

    def no_attention_message(self, step: int) -> str:
        """One line for a selected step that ran without an attention call: what is watched, how to add one."""
        unbound = ("" if self._root is not None else
                   " No model was bound, so attention written in torch ops was not followed: pass the model "
                   "(capture(model, ...)), or for the command name its attention modules with --attention-modules "
                   "REGEX.")
        return (f"fa-forensics capture: step {step} ran but no attention call was seen with gradients enabled. "
                f"Watched: {self.watched_text()}.{unbound} If the model's attention is a function or autograd "
                "Function of its own, name it with --attention MODULE:QUALNAME[,layout=BTHD] (e.g. "
                "attention:FlashAttentionFunction; attention=[...] in Python); if it is written inline in a "
                "forward with ops capture does not follow (docs: capture-custom-attention, attention written as "
                "torch ops), call fa_forensics.capture.record(q, k, v, o, layout=...) right after it")

    def _entry_point_busy(self) -> bool:
        return self.busy

    def watched_text(self) -> str:
        """The attention entry points this session watches, for messages ("a; b; c; and --attention X")."""
        names = [*WATCHED, *(f"--attention {t.to_text()}" for t in self.targets)]
        return "; ".join(names[:-1]) + f"; and {names[-1]}"

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
            dump_writer = DumpWriter(self.out, attrs, overwrite=self.settings.overwrite and self.rank == 0,
                                     rank=self.rank, world_size=self.world_size,
                                     allow_other_model=self.settings.allow_other_model, run_id=self.run_id,
                                     rank0_wait=None if ordered or self.world_size == 1 else RANK0_WAIT_SECONDS)
        except OSError as exc:
            raise InvalidCaptureSetting("out",
                                        f"cannot create capture store {self.out}: {exc.strerror or exc}; it must be a "
                                        "writable path") from exc
        finally:
            if ordered and self.rank == 0:
                dist.barrier()
        settings = self.settings
        self._writer = BackgroundWriter(dump_writer, max_queue=settings.max_queue,
                                        timeline_rows=settings.timeline_flush_rows,
                                        held_bytes=int(settings.max_held_mb * 2 ** 20), duty=settings.writer_duty)
        try:
            if self.model is not None:
                self.bind(self.model)
            if self.step_by == "optimizer":
                self._handles.append(register_optimizer_step_post_hook(self._on_optimizer_step))
            sdpa.install(self)
            self._patcher = EntryPointPatcher(self._entry_point_busy, self._on_entry_point, self._enter_entry_point)
            self._patcher.install(built_in_entry_points() + hf_entry_points() + [t.entry_point() for t in self.targets])
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
        self._chains.leave()
        self._held_chain = None
        self._remove_hooks()
        sdpa.uninstall(self, keep_patch=self.settings.keep_sdpa_patch)
        self._uninstall_entry_points()
        loss_tap.uninstall(self)
        _set_active(None)
        if self._writer is None:
            return
        try:
            self._flush_waiting()
            if self._monitor is not None:
                self._monitor.close()
                self._writer.put_run_attrs({"capture": {"monitor": self._monitor.store_attrs()}})
            self._plan = StepPlan(self.current_step)
            self.busy = False
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
            described = _identified(model)
            self._writer.set_model(described["model"])
            self._writer.put_run_attrs(described)
        found = find_attention_modules(model, self.pattern)
        self.attention_module_names = [name for name, _ in found]
        self._modules_by_name = dict(found)
        self._handles.append(model.register_forward_pre_hook(self._on_root_forward))
        self._handles.append(model.register_forward_hook(self._on_root_forward_end, always_call=True))
        for name, module in found:
            self._handles.append(module.register_forward_pre_hook(self._x_hook(name), with_kwargs=True))
        return len(found)

    # -- hooks (hot path first) ----------------------------------------------------------
    @torch.compiler.disable  # never traced: a read of `busy` in traced code would be a guard (`module.compile()`)
    def _on_root_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if self.busy:
            self._root_forward_eager()
            if self._plan.active:
                self._chains.enter(module)

    def _on_root_forward_end(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._chains.mode is not None:
            self._chains.leave()
            self._flush_chain()

    def _root_forward_eager(self) -> None:
        if not torch.is_grad_enabled():
            return
        self._flush_waiting()
        self._now.micro += 1
        self._now.layer = 0
        self._pending_x = None

    def _x_hook(self, name: str) -> Callable[[torch.nn.Module, tuple, dict], Optional[tuple[tuple, dict]]]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            if torch.compiler.is_compiling():  # every step: X passes through an opaque op that looks at `_active`
                from fa_forensics.capture.graph_ops import tap_input

                grad_enabled = torch.is_grad_enabled()
                return replace_module_input(args, kwargs, lambda x: tap_input(x, name, grad_enabled))
            if self._plan.active:
                self._take_x(name, module_input(args, kwargs))
            return None

        return hook

    @torch.compiler.disable
    def _take_x(self, name: str, x: Optional[torch.Tensor]) -> None:
        if torch.is_grad_enabled():
            self.take_input(name, x)

    def take_input_from_graph(self, name: str, x: torch.Tensor) -> None:
        """X handed over by a compiled graph's tap (it runs on every step): kept when the step needs its calls."""
        if self._plan.active:
            self.take_input(name, x)

    def take_input(self, name: str, x: Optional[torch.Tensor]) -> None:
        """X of the attention module `name`, kept for its attention call (called with gradients enabled)."""
        if self._held_chain is not None:
            self._flush_chain()
        self._pending_x = None if x is None else ModuleInput(name, x)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._optimizer_id is None:
            self._optimizer_id = id(optimizer)
        elif id(optimizer) != self._optimizer_id:
            return  # a second optimizer of the same run (e.g. Muon + AdamW): count steps once
        self._end_step(None)

    def on_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *,
                     scale: Optional[float], causal: bool, attn_mask: Optional[torch.Tensor], dropout_p: float,
                     source: str,
                     grad_sink: Optional[Callable] = None, grad_enabled: Optional[bool] = None,
                     autocast_dtype: Union[torch.dtype, None, str] = "ambient", extra: Optional[dict] = None) -> None:
        """Called by the SDPA patch and `record` on busy steps; decides whether this call is recorded or monitored.

        grad_sink: inside a compiled graph O carries no autograd history here; the dO hook is handed
        to grad_sink instead of being registered on O. grad_enabled, autocast_dtype: the grad mode and
        autocast dtype (None: autocast off) the call was traced in; by default the ones in effect now.
        """
        self._chains.pause(1)  # the recorder's and the monitor's own torch ops are not the model's
        try:
            self._on_attention(q, k, v, o, scale=scale, causal=causal, attn_mask=attn_mask, dropout_p=dropout_p,
                               source=source, grad_sink=grad_sink, grad_enabled=grad_enabled,
                               autocast_dtype=autocast_dtype, extra=extra)
        finally:
            self._chains.pause(-1)

    def _on_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, *,
                      scale: Optional[float], causal: bool, attn_mask: Optional[torch.Tensor], dropout_p: float,
                      source: str, grad_sink: Optional[Callable], grad_enabled: Optional[bool],
                      autocast_dtype: Union[torch.dtype, None, str], extra: Optional[dict]) -> None:
        if source != "torch_ops" and self._held_chain is not None:
            self._flush_chain()
        if self._entry_depth > 0:
            return  # inside a watched entry point: its own call is recorded when it returns
        if self._frames and source != "torch_ops":  # a chain was counted when it formed
            extra = self._in_frame(extra)
        if isinstance(autocast_dtype, str):  # "ambient": the one in effect now
            autocast_dtype = sdpa.autocast_dtype(q)
        self._flush_waiting()
        if not self._plan.active or not (torch.is_grad_enabled() if grad_enabled is None else grad_enabled):
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
        verdict = self._check_context(q, x, source, (extra or {}).get("layout", "BHTD"))
        if verdict is not None and verdict.skip:
            self._skip_call(source, layer, verdict.skip)
            return
        if verdict is not None and verdict.reading.swap is not None:
            q, k, v, o, attn_mask, grad_sink = relaid(verdict.reading, q, k, v, o, attn_mask, grad_sink,
                                                      mask_follows_q=source == "torch_ops")
            extra = {**(extra or {}), "layout": verdict.reading.layout}
        extra = {"source": source, "softmax": self.softmax.variant_for(source),
                 "softmax_rule": self.softmax.to_text() or "none", **(extra or {})}
        recording = (self._plan.record or self._plan.ring) and self.selection.wants_layer(layer)
        if recording:
            refused = self._source_checks.check(
                source, self._where(source), q, k, v, o, scale=scale, causal=causal, mask=attn_mask, extra=extra,
                dropout_p=dropout_p, kernel_dtype=(autocast_dtype if q.dtype == torch.float32 and autocast_dtype
                                                   is not None else q.dtype))
            if refused is not None:
                self._skip_call(source, layer, refused, said=refused)
                return
            extra.update(self._source_checks.attrs(source))
        if extra["softmax"] == "unknown":
            self._warn_once(f"softmax:{source}", self._softmax_unknown_message(source))
        call = AttentionCall(step=self.current_step, layer=layer, q=q, k=k, v=v, o=o, scale=scale, causal=causal,
                             mask=attn_mask,
                             dropout_p=dropout_p, autocast_dtype=autocast_dtype, source=source, x=x,
                             grad_sink=grad_sink, extra=extra)
        if self._plan.monitor and self._monitor is not None:
            name = self._module_name(call)
            self._monitor.observe(call, self.selection.batch, name, self._modules_by_name.get(name))
        if recording:
            if not self._plan.record and self._monitor is not None:  # held for the ring: the monitor keeps it
                self._monitor.ring_step_for(call.step)
            if self._recorder.record(call):
                self._now.recorded = True
            else:
                self._warn_once("dims",
                                f"fa-forensics capture: skipped an attention call with q of shape {tuple(q.shape)}; "
                                "only (B, H, T, D) is recorded")

    def _skip_call(self, source: str, layer: int, why: str, said: Optional[str] = None) -> None:
        """A call that is not stored (its layout is ambiguous, or its source was refused): said once per source
        and reason, and listed in the store's attributes (capture.skipped_calls), while training goes on."""
        key = f"skip:{source}:{why}"
        if key in self._warned:
            return
        self._warn_once(key, said or f"fa-forensics capture: {why}")
        self._skipped.append({"source": source, "step": int(self.current_step), "layer": int(layer), "why": why})
        if self._writer is not None:
            self._writer.put_run_attrs({"capture": {"skipped_calls": list(self._skipped)}})

    @staticmethod
    def _where(source: str) -> str:
        return {"record": "fa_forensics.capture.record", "torch_ops": "attention written in torch ops",
                "sdpa": "torch's scaled_dot_product_attention"}.get(source, source)

    @staticmethod
    def _softmax_unknown_message(source: str) -> str:
        where = "fa_forensics.capture.record" if source == "record" else source
        return (f"fa-forensics capture: which softmax {where} computes is recorded as unknown (the standard one, or "
                "the paper's stabilized one); say it with --softmax standard|stabilized|ENV=VALUE (e.g. STABLE=1: "
                "stabilized when that variable is set so at the call; softmax=... in Python, or "
                "record(..., softmax=...)), and replays of these layers know which to compute")

    def _check_context(self, q: torch.Tensor, x: Optional[ModuleInput], source: str,
                       layout: str) -> Optional[LayoutVerdict]:
        """The call's layout against X and the module's head count (layouts.check_call_context): the reading
        to store the call in, what to say, or why it is skipped. None when nothing could be checked."""
        if q.dim() != 4 or layout not in ("BHTD", "BTHD"):
            return None  # (B·H, T, D) chains are split with X's batch: nothing else to read them as
        module: object = self._modules_by_name.get(x.name) if x is not None else None
        if module is None:
            module = self._frames[-1].module if self._frames else self._frame_module
        heads = module_heads(module)
        if x is None and heads is None:
            return None
        B, H, T, D = q.shape
        named = source == "record" or source in self._target_names
        passed = tuple(to_bhtd(q, layout).shape)  # q as the call passed it
        if source == "torch_ops":
            readings = (Reading("BHTD", B, H, T, D), Reading("HBTD", H, B, T, D, swap=(0, 1)))
            advice = ""
        else:
            other = "BTHD" if layout == "BHTD" else "BHTD"
            readings = (Reading(layout, B, H, T, D), Reading(other, B, T, H, D, swap=(1, 2)))
            advice = (f"the model passes {other} tensors to {self._where(source)}, which takes {layout}: fix the call "
                      "in the model")
        x_tensor = x.tensor if x is not None else None
        x_name = x.name if x is not None else "the attention module"
        verdict = check_call_context(passed, readings, self._where(source), x_tensor, x_name, heads,
                                     fixed=not named and source != "torch_ops", advice=advice)
        if verdict.line and (named or (verdict.checked and source != "torch_ops")):
            self._warn_once(f"context:{source}", verdict.line)
        return verdict

    # -- recording -----------------------------------------------------------------------
    def _queue_array(self, step: int, layer: int, name: str, tensor: torch.Tensor, layer_attrs: dict) -> None:
        """Where the recorder's arrays go: the ring while the step is held there, host memory for a step an alarm
        asked for (handed to the writer whole when it ends), else the background writer."""
        host, ready = offload(tensor)
        ring_step = None if self._monitor is None else self._monitor.ring_step
        if ring_step is not None and ring_step.step == step:
            ring_step.arrays.append(RingArray(layer, name, host, ready, layer_attrs))
        elif step in self._held_alarm:  # written whole, or dropped whole, when the step ends
            self._held_alarm[step].arrays.append(RingArray(layer, name, host, ready, layer_attrs))
        else:
            if step not in self._registered:
                self._registered.add(step)
                self._open_writer().register_step(step)
            self._open_writer().put_array(step, layer, name, host, ready=ready, layer_attrs=layer_attrs)

    def _mark_backward(self, grad: Optional[torch.Tensor] = None) -> None:
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
        self._chains.leave()  # a forward pass whose end hook did not run (an exception caught inside the model)
        self._flush_chain()
        self._flush_waiting()
        if self._monitor is not None:
            tapped = self._monitor.take_tapped_loss()
        else:
            tapped, self._tapped_loss = self._tapped_loss, None
        if self._plan.record:
            if self._now.recorded:
                self._pending = PendingStep(ended, loss if loss is not None else self._now.loss, tapped)
                if self._pending.loss is not None or self.step_by == "manual":
                    self._flush_pending(None)
            else:
                self.steps_without_attention.append(ended)
                if self._now.calls and self._skipped:
                    self._warn_once("all-skipped", f"fa-forensics capture: step {ended} ran {self._now.calls} "
                                                   "attention call(s), none stored: each was skipped for the reason "
                                                   "said above; nothing recorded for it")
                elif self._now.calls:
                    self._warn_once("unselected", f"fa-forensics capture: step {ended} ran {self._now.calls} attention "
                                                  "call(s) but none was selected (check --layers and --micro-batch "
                                                  "against the model); nothing recorded for it")
                else:
                    self._warn_once("empty", self.no_attention_message(ended))
        if not self._plan.record:
            self._recorder.missing_do(ended)  # a step held for the ring only: nothing to say about it
        if self._monitor is not None:
            self._monitor.end_step(ended, loss, tapped)
        self.current_step = ended + 1
        self._now = StepProgress()
        self._begin_step(self.current_step)
        row = self._monitor.row if self._monitor is not None else None
        if row is not None:  # the monitored step's row waits for its loss
            self._update_busy()
            if row.given_loss is not None or self.step_by == "manual":
                self._flush_row(None)
        for fn in self._callbacks:
            fn(self, ended, loss)

    def _flush_pending(self, loss: Optional[float]) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if loss is None:
            loss = pending.loss
        if loss is None and pending.tapped is not None:
            loss = float(pending.tapped)
        attrs: dict[str, object] = {"rank": self.rank, "micro_batch": self.selection.micro_batch}
        if self._monitor is not None and pending.step in self._monitor.extra_steps:
            attrs["recorded_by"] = "alarm"
        held = self._held_alarm.pop(pending.step, None)
        if self._complete(pending.step, held, loss, **attrs):
            self._say_missing_do(pending.step)
        elif held is not None:  # only a held step can find no room in the writer
            self._say_dropped(held, "recorded after an alarm")
            self._recorder.missing_do(pending.step)
        self._update_busy()

    def _complete(self, step: int, held: Optional[RingStep], loss: Optional[float], **attrs: Any) -> bool:
        """Mark `step` complete in the store: its arrays were queued as they came, or, `held`, are handed to the
        writer whole now (False, nothing written, when the writer has no room for them)."""
        writer = self._open_writer()
        if held is None:
            writer.put_complete(step, loss=loss, **attrs)
        elif not writer.put_held_step(step, held.arrays, loss=loss, **attrs):
            return False
        bisect.insort(self.recorded_steps, step)
        return True

    def _say_dropped(self, held: RingStep, what: str) -> None:
        """A held step the writer had no room for (training never waits for an alarm's steps): its drop is written
        into the store (`capture.monitor.dropped_steps`), and said in one line per alarm episode."""
        writer = self._open_writer()
        episode = None
        if self._monitor is not None:
            episode = self._monitor.note_dropped(held.step, f"{what}: no room in the writer's held-step bound "
                                                            f"({writer.held_bytes / 2 ** 20:.0f} MB, max_held_mb)",
                                                 held.nbytes, writer)
            if episode is None:
                return  # this episode's drops are said already
        waiting = writer.held_waiting_bytes / 2 ** 20
        where = f"the alarm episode from step {episode}" if episode is not None else "this run"
        self._warn_once(f"dropped:{episode}",
                        f"fa-forensics capture: step {held.step} ({what}, {held.nbytes / 2 ** 20:.1f} MB) was dropped: "
                        f"{waiting:.0f} MB of held steps still wait for the disk and the bound is "
                        f"{writer.held_bytes / 2 ** 20:.0f} MB (max_held_mb); training goes on. This and any later "
                        f"drop of {where} are listed in the store (`info` and `verify` show them). To keep such "
                        "steps record fewer layers or heads or a smaller batch slice (--layers, --heads, --batch), "
                        "fewer steps after an alarm (--alarm-steps) or a smaller --ring")

    def _say_missing_do(self, step: int) -> None:
        """One line per reason (once per session and set of layers) for recorded layers of `step` without dO."""
        for reason, layers in self._recorder.missing_do(step).items():
            names = ", ".join(map(str, layers))
            self._warn_once(f"no-do:{reason}:{names}",
                            f"fa-forensics capture: no dO recorded for layer{'s' if len(layers) > 1 else ''} {names} "
                            f"of step {step} (and of later steps alike): {reason}; analyses of the backward pass "
                            "skip these layers (`info` lists them)")

    def _plan_step(self, step: int) -> None:
        """Decide what the step in progress does (when it begins, and again when an alarm asks for it); a step an
        alarm asked for that the selection did not is held in memory until it ends."""
        monitor = self._monitor
        selected = self.selection.wants_step(step)
        asked = monitor is not None and step in monitor.extra_steps
        monitored = monitor is not None and monitor.hot
        self._plan = StepPlan.decide(step, selected=selected, asked=asked, monitored=monitored,
                                     ring_kept=monitor is not None and monitor.ring is not None)
        if asked and not selected and step not in self._held_alarm:
            self._held_alarm[step] = RingStep(step)
        self._update_busy()

    def _update_busy(self) -> None:
        """The one flag every hook checks: the step's calls are needed, or an ended step waits for its loss."""
        self.busy = self._plan.active or self._pending is not None or self._row_waiting()

    def _begin_step(self, step: int) -> None:
        """Plan the step that starts now: record (selected or asked for by an alarm), monitor, ring."""
        if self._monitor is not None:
            self._monitor.begin_step(step)
        self._plan_step(step)

    # -- monitor ---------------------------------------------------------------------------
    def on_backward(self, tensors: Any, grad_tensors: Any) -> None:
        """Called by the loss tap on busy steps: add a scalar loss to the step's sum (no synchronization)."""
        if not self._plan.active:
            return
        value = loss_tap.scalar_loss(tensors, grad_tensors)
        if value is None:
            return
        if self._monitor is not None:
            self._monitor.add_tapped_loss(value)
        elif self._plan.record:
            self._tapped_loss = value if self._tapped_loss is None else self._tapped_loss + value

    def on_loss_logits(self, logits: torch.Tensor) -> None:
        """Called by the output-logit tap on busy steps: the monitor's output_lse of a monitored step."""
        if self._monitor is not None and self._plan.monitor:
            self._monitor.add_output_logits(logits)

    def _module_name(self, call: AttentionCall) -> str:
        """The attention module of a call: the one whose input X came with it, else by call order."""
        if call.x is not None:
            return call.x.name
        if call.layer < len(self.attention_module_names):
            return self.attention_module_names[call.layer]
        return f"attention call {call.layer}"

    def _flush_row(self, loss: Optional[float]) -> None:
        """Write the monitor's waiting timeline row; an alarm it raises may ask for the current step."""
        monitor = self._monitor
        if monitor is None:
            return  # no monitor, no row
        monitor.flush_row(loss, self._open_writer(), self._write_held, self._warn_once)
        if self.current_step in monitor.extra_steps and not self._plan.record:
            self._plan_step(self.current_step)
        self._update_busy()

    def _write_held(self, held: RingStep, alarm_step: int) -> bool:
        """Hand a step the ring held to the writer whole (unless it is recorded already, or there is no room for it:
        then it is dropped and said); True when queued."""
        if held.step in self.recorded_steps or not held.arrays:
            return False
        if not self._complete(held.step, held, held.loss, rank=self.rank, micro_batch=self.selection.micro_batch,
                              recorded_by="ring", alarm_step=int(alarm_step)):
            self._say_dropped(held, f"held by the ring for the alarm at step {alarm_step}")
            return False
        return True

    # -- helpers -------------------------------------------------------------------------
    def _open_writer(self) -> BackgroundWriter:
        """The store's writer, open from start() to stop()."""
        if self._writer is None:
            raise CaptureError("the capture session is not running: steps are recorded inside `with capture(...)`")
        return self._writer

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
            described = _identified(self.model)
            model_attrs = {**described["model"], **model_attrs}
            device = device or described["device"]
        capture_attrs = {**self.selection.to_attrs(), "attention_modules": self.pattern, "step_by": self.step_by,
                         "rank": self.rank, "world_size": self.world_size,
                         "attention": [t.to_text() for t in self.targets], "softmax": self.softmax.to_text() or "none",
                         **self.run_attrs.get("capture", {})}
        if self._monitor is not None:
            self._monitor.extra_attrs = {"timeline_flush_rows": self.settings.timeline_flush_rows}
            capture_attrs["monitor"] = self._monitor.store_attrs()
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


@dataclass
class HFFrame:
    """A Hugging Face attention function running: its registry name, its module, the calls seen inside."""

    name: str
    module: object  # the module the function was called with (its first argument), read for its head count
    seen: int = 0


@dataclass
class HeldChain:
    """An attention chain of torch ops waiting to be recorded (see `_on_plain_call`)."""

    x: Optional[ModuleInput]  # X when the chain formed
    qk: tuple  # its Q and K as the product got them
    call: dict  # the arguments of on_attention


def _identified(model: torch.nn.Module) -> dict:
    """The model's description for the store's attributes (capture/modules.py), its fingerprint included: what a
    later capture into the same store is checked against."""
    from fa_forensics.dump.identity import model_fingerprint

    described = describe_model(model)
    described["model"]["fingerprint"] = model_fingerprint(model)
    return described


def _same_storage(a: object, b: object) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _chain_facts(extra: Optional[dict]) -> dict:
    """What a chain knew of a call that record() then reported: its ops and dtypes."""
    keep = ("chain", "score_dtype", "softmax_dtype", "p_dtype", "q_scale", "k_scale", "softcap", "plain_recipe")
    return {k: v for k, v in (extra or {}).items() if k in keep}


def _dtype_name(dtype: Optional[torch.dtype]) -> str:
    return "unknown" if dtype is None else str(dtype).replace("torch.", "")


def _as_float(loss: Loss) -> Optional[float]:
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
