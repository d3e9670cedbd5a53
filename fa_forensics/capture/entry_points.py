"""Watching attention entry points other than SDPA: patching a named callable when its module loads.

An entry point is a callable in an importable module (`MODULE:QUALNAME`): a function, or a
`torch.autograd.Function` subclass (its `apply` is what models call). `EntryPointPatcher` replaces
it with a wrapper that calls the original and, on busy steps only, hands the call to the session:
a module already imported is patched at once, any other when it is first imported (a finder on
sys.meta_path runs the patch right after the module's code, before any `from MODULE import NAME`
binds it). `uninstall` puts every original back.

What a wrapper reads from a call is an adapter's business (capture/adapters.py): a function
(args, kwargs, output) -> `CallFacts` (Q, K, V, O as (B, H, T, D) views, scale, causal, mask, ...).
The generic adapter here binds the call to the callable's signature: Q, K, V are its first three
parameters, `causal`/`is_causal`, `scale`/`softmax_scale`/`sm_scale`, `mask`/`attn_mask` and
`dropout_p` are read by name, O is the output (or its first element).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Optional

import torch

from fa_forensics.capture.layouts import check_attention_shapes, check_layout, o_grad_sink, to_bhtd
from fa_forensics.capture.selection import InvalidCaptureSetting


@dataclass
class CallFacts:
    """One attention call as the store wants it: q, k, v, o (B, H, T, D), the rest as SDPA names it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    scale: Optional[float]
    causal: bool
    mask: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    grad_sink: Optional[Callable] = None
    attrs: dict = field(default_factory=dict)  # extra layer attributes (layout, source, score_mod, ...)
    warning: Optional[str] = None  # what of the call cannot be replayed (one line)


Adapter = Callable[[tuple, dict, Any], Optional[CallFacts]]


@dataclass(frozen=True)
class EntryPoint:
    """A callable to watch: `module:qualname`, the adapter that reads its calls, a label for messages.

    `wrap`, when given, builds the replacement from the original instead (it reports nothing itself:
    e.g. a lookup that returns watched functions); `adapter` is then unused."""

    module: str
    qualname: str
    adapter: Optional[Adapter]
    label: str = ""
    wrap: Optional[Callable[[Callable], Callable]] = None

    @property
    def name(self) -> str:
        return self.label or f"{self.module}:{self.qualname}"


# -- the generic adapter ------------------------------------------------------------------------
_CAUSAL = ("causal", "is_causal")
_SCALE = ("scale", "softmax_scale", "sm_scale")
_MASK = ("mask", "attn_mask", "attention_mask")
_DROPOUT = ("dropout_p", "dropout")


@dataclass(frozen=True)
class TargetSpec:
    """`--attention MODULE:QUALNAME[,layout=BHTD|BTHD][,causal=true|false][,scale=X]`, parsed."""

    module: str
    qualname: str
    layout: str = "BHTD"
    causal: Optional[bool] = None  # None: from the call's `causal`/`is_causal` argument, else True
    scale: Optional[float] = None  # None: from the call's scale argument, else 1/sqrt(head_dim)

    @classmethod
    def parse(cls, text: str) -> TargetSpec:
        head, *options = [p.strip() for p in str(text).split(",")]
        module, sep, qualname = head.partition(":")
        if not sep or not module or not qualname or not all(p.isidentifier() for p in qualname.split(".")):
            raise InvalidCaptureSetting("attention", f"{text!r} does not name a callable; write MODULE:QUALNAME, "
                                                     "e.g. attention:FlashAttentionFunction or "
                                                     "mypkg.attn:attention_fn,layout=BTHD")
        values: dict[str, Any] = {}
        for option in options:
            key, eq, value = option.partition("=")
            key = key.strip().lower()
            if not eq or key not in ("layout", "causal", "scale"):
                raise InvalidCaptureSetting("attention", f"{option!r} in {text!r} is not an option; use "
                                                         "layout=BHTD|BTHD, causal=true|false or scale=NUMBER")
            if key == "layout":
                values["layout"] = check_layout(value)
            elif key == "causal":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise InvalidCaptureSetting("attention", f"causal={value!r} in {text!r}: write causal=true "
                                                             "or causal=false")
                values["causal"] = value.lower() in ("true", "1")
            else:
                try:
                    values["scale"] = float(value)
                except ValueError:
                    values["scale"] = math.nan
                if not (math.isfinite(values["scale"]) and values["scale"] > 0):
                    raise InvalidCaptureSetting("attention", f"scale={value!r} in {text!r} must be a positive number")
        return cls(module.strip(), qualname.strip(), **values)

    def to_text(self) -> str:
        parts = [f"{self.module}:{self.qualname}", f"layout={self.layout}"]
        if self.causal is not None:
            parts.append(f"causal={str(self.causal).lower()}")
        if self.scale is not None:
            parts.append(f"scale={self.scale!r}")
        return ",".join(parts)

    def entry_point(self) -> EntryPoint:
        return EntryPoint(self.module, self.qualname, functools.partial(_generic_adapter, self), self.to_text())


def _first(bound: dict, names: tuple[str, ...]):
    for name in names:
        if name in bound:
            return bound[name]
    return None


def _generic_adapter(spec: TargetSpec, params: list[str], args: tuple, kwargs: dict, out) -> Optional[CallFacts]:
    """CallFacts of one call of a `--attention` target (params: the callable's parameter names)."""
    bound = dict(zip(params, args))
    bound.update(kwargs)
    tensors = [bound.get(p) for p in params[:3]]
    o = out[0] if isinstance(out, (tuple, list)) and out else out
    if not all(isinstance(t, torch.Tensor) for t in (*tensors, o)):
        return None
    q, k, v = tensors
    where = spec.to_text()
    check_attention_shapes(q, k, v, o, spec.layout, where)
    causal = spec.causal if spec.causal is not None else _first(bound, _CAUSAL)
    scale = spec.scale if spec.scale is not None else _first(bound, _SCALE)
    mask = _first(bound, _MASK)
    dropout = _first(bound, _DROPOUT)
    warning = None
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        shape = f" of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else ""
        warning = (f"fa-forensics capture: {where}: the call's mask ({type(mask).__name__}{shape}) is not a 4-D "
                   "SDPA-style mask and is not recorded; replays of these layers ignore it")
        mask = None
    convert = functools.partial(to_bhtd, layout=spec.layout)
    return CallFacts(convert(q), convert(k), convert(v), convert(o),
                     scale=float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None,
                     causal=bool(causal) if isinstance(causal, bool) else True, mask=mask,
                     dropout_p=float(dropout) if isinstance(dropout, float) else 0.0,
                     grad_sink=o_grad_sink(o, convert) if spec.layout != "BHTD" else None,
                     attrs={"layout": spec.layout}, warning=warning)


def parameter_names(target) -> list[str]:
    """Parameter names of a function, or of an autograd Function's forward without `ctx`."""
    if isinstance(target, type) and issubclass(target, torch.autograd.Function):
        params = list(inspect.signature(target.forward).parameters)
        uses_ctx = getattr(target, "setup_context", None) is getattr(torch.autograd.Function, "setup_context", None)
        return params[1:] if uses_ctx else params
    try:
        return list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return []


# -- patching ------------------------------------------------------------------------------------
Report = Callable[[EntryPoint, tuple, dict, Any], None]  # called on busy steps only
_active: Optional[EntryPointPatcher] = None  # where every wrapper reports (also one bound by an earlier session)


class EntryPointPatcher:
    """Patches entry points (now, or when their module is imported) and restores them."""

    def __init__(self, is_busy: Callable[[], bool], report: Report,
                 enter: Callable[[int], None] = lambda delta: None) -> None:
        self._is_busy = is_busy
        self._report = report
        self._enter = enter  # told +1 / -1 around a busy call (attention calls inside it are its own)
        self._restore: list[Callable[[], None]] = []
        self._finder: Optional[_PostImportFinder] = None
        self.patched: list[str] = []  # names of the entry points patched so far

    def install(self, entry_points: list[EntryPoint]) -> None:
        global _active
        _active = self
        waiting: dict[str, list[EntryPoint]] = {}
        for ep in entry_points:
            module = sys.modules.get(ep.module)
            if module is not None:
                self._patch(module, ep)
            else:
                waiting.setdefault(ep.module, []).append(ep)
        if waiting:
            self._finder = _PostImportFinder(waiting, self._patch)
            sys.meta_path.insert(0, self._finder)

    def uninstall(self) -> None:
        global _active
        if _active is self:
            _active = None
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()

    def check_resolved(self, entry_points: list[EntryPoint]) -> list[str]:
        """Names of the given entry points whose module loaded but whose callable was not found."""
        return [ep.name for ep in entry_points if ep.module in sys.modules and ep.name not in self.patched]

    def _patch(self, module, ep: EntryPoint) -> None:
        *path, leaf = ep.qualname.split(".")
        owner = module
        for part in path:
            owner = getattr(owner, part, None)
            if owner is None:
                return
        target = getattr(owner, leaf, None)
        if target is None:
            return
        if getattr(target, "_fa_forensics_entry_point", None) is not None:
            return  # patched already (e.g. re-exported by a package)
        if ep.wrap is not None:
            self._replace(owner, leaf, target, ep.wrap(target), ep.name)
            return
        params = parameter_names(target)
        adapter = ep.adapter
        if isinstance(adapter, functools.partial) and adapter.func is _generic_adapter:
            adapter = functools.partial(adapter, params)
        bound_ep = EntryPoint(ep.module, ep.qualname, adapter, ep.name)
        if isinstance(target, type) and issubclass(target, torch.autograd.Function):
            self._patch_function_class(target, bound_ep)
        elif callable(target):
            self._replace(owner, leaf, target, self._wrap(target, bound_ep), ep.name)
            return
        else:
            return
        self.patched.append(ep.name)

    def _replace(self, owner, leaf: str, target, replacement, name: str) -> None:
        """Put `replacement` at owner.leaf; restored on uninstall (a class attribute it inherited is deleted again)."""
        inherited = isinstance(owner, type) and leaf not in vars(owner)
        replacement._fa_forensics_entry_point = name
        setattr(owner, leaf, replacement)
        self._restore.append((lambda: delattr(owner, leaf)) if inherited else (lambda: setattr(owner, leaf, target)))
        self.patched.append(name)

    def _patch_function_class(self, cls: type, ep: EntryPoint) -> None:
        had_own = "apply" in cls.__dict__
        own = cls.__dict__.get("apply")
        wrapper = self._wrap(cls.apply, ep)
        wrapper._fa_forensics_entry_point = ep.name
        cls.apply = staticmethod(wrapper)

        def restore() -> None:
            if had_own:
                cls.apply = own
            else:
                del cls.apply

        self._restore.append(restore)

    @staticmethod
    def _wrap(original: Callable, ep: EntryPoint) -> Callable:
        """The wrapper reports to the active patcher, so a wrapper that user code bound during an earlier
        session (`from flash_attn import flash_attn_func`) reports to the current one."""

        @functools.wraps(original)
        def watched(*args, **kwargs):
            patcher = _active
            if patcher is None or not patcher._is_busy():
                return original(*args, **kwargs)
            if torch.compiler.is_compiling():  # no state is mutated in traced code
                out = original(*args, **kwargs)
            else:
                patcher._enter(1)
                try:
                    out = original(*args, **kwargs)
                finally:
                    patcher._enter(-1)
            patcher._report(ep, args, kwargs, out)
            return out

        return watched


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs `patch(module, entry_point)` right after a waited-for module's code ran."""

    def __init__(self, waiting: dict[str, list[EntryPoint]], patch: Callable) -> None:
        self.waiting = waiting
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self.waiting.pop(fullname), self.patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, entry_points: list[EntryPoint], patch: Callable) -> None:
        self._loader = loader
        self._entry_points = entry_points
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for ep in self._entry_points:
            self._patch(module, ep)

    def __getattr__(self, name):
        return getattr(self._loader, name)
