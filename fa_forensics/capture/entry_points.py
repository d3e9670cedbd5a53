"""Watching attention entry points other than SDPA: patching a named callable when its module loads.

An entry point is a callable in an importable module (`MODULE:QUALNAME`): a function, or a
`torch.autograd.Function` subclass (its `apply` is what models call). `EntryPointPatcher` replaces
it with a wrapper that calls the original and, on busy steps only, hands the call to the session:
a module already imported is patched at once, any other when it is first imported (a finder on
sys.meta_path runs the patch right after the module's code, before any `from MODULE import NAME`
binds it). `uninstall` puts every original back.

What a wrapper reads from a call is an adapter's business (capture/adapters.py for the libraries,
capture/targets.py for `--attention` targets): a function (args, kwargs, output) -> `CallFacts`
(Q, K, V, O as (B, H, T, D) views, scale, causal, mask, ...). An adapter with a `with_parameters`
method is given the callable's parameter names when it is patched.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional

import torch


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


def parameter_names(target: Callable[..., Any]) -> list[str]:
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

    def _patch(self, module: ModuleType, ep: EntryPoint) -> None:
        *path, leaf = ep.qualname.split(".")
        owner: Any = module
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
        adapter = ep.adapter
        # an adapter that reads calls by the callable's signature
        if adapter is not None and hasattr(adapter, "with_parameters"):
            adapter = adapter.with_parameters(parameter_names(target))
        bound_ep = EntryPoint(ep.module, ep.qualname, adapter, ep.name)
        if isinstance(target, type) and issubclass(target, torch.autograd.Function):
            self._patch_function_class(target, bound_ep)
        elif callable(target):
            self._replace(owner, leaf, target, self._wrap(target, bound_ep), ep.name)
            return
        else:
            return
        self.patched.append(ep.name)

    def _replace(self, owner: object, leaf: str, target: object, replacement: Callable[..., Any], name: str) -> None:
        """Put `replacement` at owner.leaf; restored on uninstall (a class attribute it inherited is deleted again)."""
        inherited = isinstance(owner, type) and leaf not in vars(owner)
        replacement._fa_forensics_entry_point = name  # type: ignore[attr-defined]  # a mark on the function object, read with getattr
        setattr(owner, leaf, replacement)
        self._restore.append((lambda: delattr(owner, leaf)) if inherited else (lambda: setattr(owner, leaf, target)))
        self.patched.append(name)

    def _patch_function_class(self, cls: type[torch.autograd.Function], ep: EntryPoint) -> None:
        had_own = "apply" in cls.__dict__
        own = cls.__dict__.get("apply")
        wrapper = self._wrap(cls.apply, ep)
        wrapper._fa_forensics_entry_point = ep.name  # type: ignore[attr-defined]  # a mark on the function object, read with getattr
        cls.apply = staticmethod(wrapper)  # type: ignore[method-assign]  # the patch: models call cls.apply

        def restore() -> None:
            if had_own:
                cls.apply = own  # type: ignore[method-assign, assignment]  # the class's own apply, put back
            else:
                del cls.apply

        self._restore.append(restore)

    @staticmethod
    def _wrap(original: Callable, ep: EntryPoint) -> Callable:
        """The wrapper reports to the active patcher, so a wrapper that user code bound during an earlier
        session (`from flash_attn import flash_attn_func`) reports to the current one."""

        @functools.wraps(original)
        def watched(*args: Any, **kwargs: Any) -> Any:
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

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[ModuleSpec]:
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
    def __init__(self, loader: importlib.abc.Loader, entry_points: list[EntryPoint], patch: Callable) -> None:
        self._loader = loader
        self._entry_points = entry_points
        self._patch = patch

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for ep in self._entry_points:
            self._patch(module, ep)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
