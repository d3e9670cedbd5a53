"""Convert between safetensors files and dump stores.

Tensor names are `step{S}.layer{L}.{q,k,v,o,do,x,mask}` (q, k, v, o, do: (B, H, T, D); x: (B, T, C);
mask: SDPA's attn_mask, 4-D and broadcastable to (B, H, Tq, Tk), bool with True = may attend, or an
additive float bias; present only for layers captured with one).
File metadata `causal` ("true" / "false") and `scale` (a float as text) apply to every layer;
they default to causal and 1/sqrt(D), and the dump records that it assumed them (`capture.assumed`).
`layer{L}.heads` ("1,3") keeps the model's head numbers of a partial-head capture (absent: heads 0..H-1).
Dtypes are kept, so export∘import is the identity on tensors.

The run's facts come from the file or from the importer's options, never from the machine that imports:
metadata `device` ("cuda", "cuda:0", "cpu"), `kernel` (the kernel or entry point: "sdpa", "sdpa-cudnn",
"flash_attn", a function's name), `autocast_dtype` ("bfloat16", "float16", "none": autocast off) and
`softmax` ("standard", "stabilized"), each for every layer or as `layer{L}.<fact>` for one; a fact neither
says is recorded as unknown. Export writes back the facts the dump records.
"""
from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch

from fa_forensics.dump.safe_files import atomic_write, refuse_link
from fa_forensics.dump.safe_read import StrPath, allocated_bytes, is_sparse
from fa_forensics.dump.staging import staged_store
from fa_forensics.dump.reader import Dump, open_dump
from fa_forensics.dump.schema import ARRAY_NAMES, HEAD_TENSORS, MASK, dtype_name, supported_dtype_names
from fa_forensics.dump.writer import DumpWriter, _existing_format
from fa_forensics.errors import DumpError, InvalidSetting, TargetExists

_Parsed = TypeVar("_Parsed")

NAME_RE = re.compile(r"^step(\d+)\.layer(\d+)\.(" + "|".join(ARRAY_NAMES) + r")$")
NAME_PATTERN = "step{S}.layer{L}.{q,k,v,o,do,x,mask}"


@dataclass(frozen=True)
class ConvertResult:
    """What an import or export moved."""

    source: str
    destination: str
    steps: list[int]
    layers: list[int]
    n_tensors: int
    causal: bool
    scale: float | None  # None: 1/sqrt(D) per layer
    facts: dict = field(default_factory=dict)  # fact -> value for every layer ("unknown": not recorded)
    assumed: list[str] = field(default_factory=list)  # settings the file did not give: causal, scale


FACTS = ("device", "kernel", "autocast_dtype", "softmax")  # the run's facts an import records
_DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]*(:\d+)?$")
_AUTOCAST = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
             "none": "none", "off": "none"}
_SOFTMAX = ("standard", "stabilized")
UNKNOWN = "unknown"


def check_fact(name: str, value: str, where: str) -> str:
    """A fact's text as recorded (lower-cased; "unknown" for unknown), or DumpError naming `where` and what is
    accepted."""
    text = str(value).strip()
    low = text.lower()
    if low in ("", UNKNOWN):
        return UNKNOWN
    if name == "device" and _DEVICE_RE.match(low):
        return low
    if name == "autocast_dtype" and low in _AUTOCAST:
        return _AUTOCAST[low]
    if name == "softmax" and low in _SOFTMAX:
        return low
    if name == "kernel" and text.isprintable() and len(text) <= 200:
        return text
    accepted = {"device": "a device such as cuda, cuda:0 or cpu", "autocast_dtype": "bfloat16, float16 or none",
                "softmax": "standard or stabilized", "kernel": "one printable line (sdpa, sdpa-cudnn, flash_attn, "
                "a function's name)"}[name]
    raise DumpError(f"{where}: {name}={text!r} is not {accepted} (or unknown); fix it")


def _facts_of(metadata: dict[str, str], options: dict[str, Any], layers: Iterable[int],
              src: Path) -> dict[int, dict[str, str]]:
    """layer -> {fact: value} from the file's metadata (`<fact>`, `layer{L}.<fact>`) and the importer's options
    (which apply to every layer); an option that disagrees with the file is an error, never a choice."""
    out = {}
    for layer in layers:
        facts = {}
        for name in FACTS:
            given = metadata.get(f"layer{layer}.{name}", metadata.get(name))
            said = None if given is None else check_fact(name, given, f"{src}: metadata")
            option = options.get(name)
            if option is not None:
                wanted = check_fact(name, option, f"--{name.replace('_', '-')}")
                if said not in (None, UNKNOWN) and wanted not in (UNKNOWN, said):
                    raise DumpError(f"--{name.replace('_', '-')} {option!r} disagrees with the file's metadata "
                                    f"{name}={given!r}; drop one of them")
                said = wanted if wanted != UNKNOWN else said
            facts[name] = said or UNKNOWN
        out[layer] = facts
    return out


def _parse_causal(text: str | None, where: str) -> bool:
    if text is None:
        return True
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise DumpError(f"{where} causal={text!r} must be \"true\" or \"false\"")
    return value == "true"


def _parse_heads(text: str, layer: int, head: torch.Tensor | None, src: Path) -> list[int]:
    """Metadata `layer{L}.heads` ("1,3"): the model's head numbers of a partial-head capture."""
    try:
        numbers = [int(h) for h in text.split(",")]
    except ValueError:
        raise DumpError(f"{src}: metadata layer{layer}.heads={text!r} must be comma-separated head numbers, e.g. "
                        "\"1,3\"") from None
    if any(h < 0 for h in numbers) or len(set(numbers)) != len(numbers):
        raise DumpError(f"{src}: metadata layer{layer}.heads={text!r} must name distinct head numbers >= 0, e.g. "
                        "\"1,3\"")
    if head is not None and len(numbers) != head.shape[1]:
        raise DumpError(f"{src}: metadata layer{layer}.heads={text!r} names {len(numbers)} heads but the tensors hold "
                        f"{head.shape[1]}")
    return numbers


def _parse_scale(text: str | None, where: str) -> float | None:
    if text is None:
        return None
    try:
        scale = float(text)
    except ValueError:
        raise DumpError(f"{where} scale={text!r} is not a number; "
                        "write it as a float in text, e.g. \"0.125\"") from None
    if not math.isfinite(scale) or scale <= 0:
        raise DumpError(f"{where} scale={text!r} must be a positive finite float")
    return scale


MAX_STEP = 10**9 - 1  # step_{S:09d}
MAX_LAYER = 999  # layer_{L:03d}


def _check_shapes(tensors: dict[str, torch.Tensor], step: int, layer: int, src: Path) -> None:
    """One layer's tensors must fit together: q, k, v, o, do (B, H, T, D) as attention needs them, x (B, T, C)."""
    def shape(t: str) -> tuple[int, ...]:
        return tuple(tensors[t].shape)

    def bad(t: str, why: str) -> NoReturn:
        raise DumpError(f"{src}: step{step}.layer{layer}.{t} has shape {shape(t)}, {why}; fix or drop the tensor")

    heads = [t for t in HEAD_TENSORS if t in tensors]
    if heads:
        B, H, T, D = shape(heads[0])
        ref = heads[0]
        for t in heads[1:]:
            if shape(t) != (B, H, T, D):
                bad(t, f"but {ref} has {(B, H, T, D)} (q, k, v, o, do share (B, H, T, D))")
    if "x" in tensors and heads:
        b, t_, c = shape("x")
        if (b, t_) != (B, T):
            bad("x", f"but {ref} has B={B}, T={T} (x is (B, T, C))")
    if MASK in tensors and heads:
        b, h, tq, tk = shape(MASK)
        if b not in (1, B) or h not in (1, H) or (tq, tk) != (T, T):
            bad(MASK, f"but {ref} has B={B}, H={H}, T={T} (a mask is (B or 1, H or 1, T, T))")


def _setting(name: str, option: Any, metadata: dict[str, str], parse: Callable[[str | None, str], _Parsed],
             src: Path) -> _Parsed | None:
    """causal / scale from the importer's option or the file's metadata (an option that disagrees is an error)."""
    said = parse(metadata.get(name), f"{src}: metadata") if name in metadata else None
    if option is None:
        return said
    wanted = parse(str(option), "option")
    if said is not None and said != wanted:
        raise DumpError(f"--{name} {option} disagrees with the file's metadata {name}={metadata[name]!r}; drop one of "
                        "them")
    return wanted


def import_safetensors(src: StrPath, dst: StrPath, *, overwrite: bool = False,
                       facts: dict[str, Any] | None = None) -> ConvertResult:
    """Read FILE.safetensors into a new dump store at `dst` (written aside, then moved in place). `facts`: the
    importer's options (device, kernel, autocast_dtype, softmax, causal, scale), for every layer; None or absent:
    what the file's metadata says, else unknown (causal and scale: their defaults, recorded as assumed)."""
    options = dict(facts or {})
    from safetensors import SafetensorError, safe_open

    src, dst = Path(src), Path(dst)
    refuse_link(dst, "to")
    if not src.is_file():
        raise DumpError(f"no safetensors file at {src}; give the path of an existing .safetensors file")
    if is_sparse(os.stat(src)):
        raise DumpError(f"{src} is a sparse file: it claims {os.stat(src).st_size} bytes but holds "
                        f"{allocated_bytes(os.stat(src))} on disk; give a whole .safetensors file")
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        if not overwrite:
            raise TargetExists(dst, "to")
        if not dst.is_dir() or _existing_format(dst) is None:
            raise TargetExists(dst, "to", foreign=True)
    try:
        with safe_open(str(src), framework="pt") as f:
            metadata = f.metadata() or {}
            names = list(f.keys())
            parsed = {n: m.groups() for n in names if (m := NAME_RE.match(n))}
            bad = [n for n in names if n not in parsed]
            if bad:
                raise DumpError(f"{src}: tensor name {bad[0]!r} does not match {NAME_PATTERN} (e.g. step100.layer1.q); "
                                "rename the tensors")
            if not names:
                raise DumpError(f"{src} holds no tensors; expected names like {NAME_PATTERN}")
            causal = _setting("causal", options.get("causal"), metadata, _parse_causal, src)
            scale = _setting("scale", options.get("scale"), metadata, _parse_scale, src)
            assumed = [name for name, value in (("causal", causal), ("scale", scale)) if value is None]
            causal = True if causal is None else causal
            by_step: dict[int, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
            first_name: dict[tuple[int, int, str], str] = {}
            for n, (s, l, t) in parsed.items():
                key = (int(s), int(l), t)
                if key in first_name:
                    raise DumpError(f"{src}: tensors {first_name[key]!r} and {n!r} both name step {key[0]} layer "
                                    f"{key[1]} {t}; keep one of them")
                first_name[key] = n
                if key[0] > MAX_STEP or key[1] > MAX_LAYER:
                    raise DumpError(f"{src}: {n} is beyond what a dump holds (steps 0..{MAX_STEP}, layers "
                                    f"0..{MAX_LAYER}); renumber the tensors")
                tensor = f.get_tensor(n)
                want = 4 if t in HEAD_TENSORS or t == MASK else 3
                if tensor.dim() != want:
                    layout = "B, T, C" if want == 3 else ("B or 1, H or 1, Tq, Tk" if t == MASK else "B, H, T, D")
                    raise DumpError(f"{src}: {n} has shape {tuple(tensor.shape)}, expected {want} dims ({layout})")
                if (tensor.dtype == torch.bool) != (t == MASK) and not (t == MASK and tensor.is_floating_point()):
                    raise DumpError(f"{src}: {n} has dtype {tensor.dtype}; only a mask may be bool, and a mask is bool "
                                    "or float")
                if dtype_name(tensor.dtype) not in supported_dtype_names():
                    raise DumpError(f"{src}: {n} has dtype {tensor.dtype}; supported: "
                                    f"{', '.join(supported_dtype_names())}")
                if 0 in tensor.shape:
                    raise DumpError(f"{src}: {n} is empty (shape {tuple(tensor.shape)}); drop it or export it again")
                by_step[int(s)][int(l)][t] = tensor
    except SafetensorError as exc:
        raise DumpError(f"{src} is not a readable safetensors file ({exc}); check the file") from None
    except OSError as exc:
        raise DumpError(f"{src} cannot be read ({exc.strerror or exc}); check the file") from None
    heads_by_layer: dict[int, list[int]] = {}
    for s in by_step:
        for l, tensors in by_step[s].items():
            _check_shapes(tensors, s, l, src)
            head = next((tensors[t] for t in HEAD_TENSORS if t in tensors), None)
            if f"layer{l}.heads" in metadata:
                heads_by_layer[l] = _parse_heads(metadata[f"layer{l}.heads"], l, head, src)

    needed = sum(t.numel() * t.element_size()
                 for s in by_step for tensors in by_step[s].values() for t in tensors.values())
    layers = sorted({l for s in by_step for l in by_step[s]})
    layer_facts = _facts_of(metadata, options, layers, src)
    uniform = {name: values.pop() for name in FACTS
               if len(values := {f[name] for f in layer_facts.values()}) == 1}
    devices = {f["device"] for f in layer_facts.values()}
    run_attrs = {"device": devices.pop() if len(devices) == 1 else UNKNOWN, "model": {},
                 "capture": {"source": "safetensors", "file": src.name, "assumed": assumed}}
    with staged_store(dst, "to", needed, overwrite=overwrite) as tmp:  # built aside, renamed into place once whole
        with DumpWriter(tmp, run_attrs) as writer:
            _write_steps(writer, by_step, causal, scale, heads_by_layer, layer_facts)
    return ConvertResult(str(src), str(dst), sorted(by_step), layers, len(names), causal, scale,
                         {name: uniform.get(name, "per layer") for name in FACTS}, assumed)


def _fact_attrs(facts: dict[str, str]) -> dict[str, str | bool]:
    """The layer attributes that record an import's facts (unknown ones are not written)."""
    attrs: dict[str, str | bool] = {}
    if facts["device"] != UNKNOWN:
        attrs["device_type"] = facts["device"].split(":")[0]
    if facts["kernel"] != UNKNOWN:
        attrs["source"] = facts["kernel"]  # the entry point, as a capture records it
    if facts["softmax"] != UNKNOWN:
        attrs["softmax"] = facts["softmax"]
    if facts["autocast_dtype"] != UNKNOWN:
        attrs["autocast"] = facts["autocast_dtype"] != "none"
        attrs["autocast_dtype"] = facts["autocast_dtype"]
    return attrs


def _write_steps(writer: DumpWriter, by_step: Mapping[int, Mapping[int, Mapping[str, torch.Tensor]]], causal: bool,
                 scale: float | None, heads_by_layer: dict[int, list[int]],
                 layer_facts: dict[int, dict[str, str]]) -> None:
    for s in sorted(by_step):
        for l in sorted(by_step[s]):
            tensors = by_step[s][l]
            head = next((tensors[t] for t in HEAD_TENSORS if t in tensors), None)
            attrs: dict[str, Any] = {"causal": causal, **_fact_attrs(layer_facts[l])}
            if MASK in tensors:
                attrs["mask"] = "bool" if tensors[MASK].dtype == torch.bool else "additive"
            if l in heads_by_layer:
                attrs["heads"] = heads_by_layer[l]
            if head is not None:
                attrs.update(n_heads=head.shape[1], head_dim=head.shape[3], dtype=dtype_name(head.dtype))
                attrs["scale"] = scale if scale is not None else 1.0 / math.sqrt(head.shape[3])
            for t in ARRAY_NAMES:
                if t in tensors:
                    writer.write_array(s, l, t, tensors[t], layer_attrs=attrs)
        writer.complete_step(s)


def export_safetensors(dump_path: StrPath, dst: StrPath, *, steps: int | Sequence[int] | None = None,
                       layers: int | Sequence[int] | None = None, overwrite: bool = False,
                       rank: int | None = None) -> ConvertResult:
    """Write the complete steps of a dump (or a selection) to one safetensors file, dtypes kept."""
    from safetensors.torch import save

    dst = Path(dst)
    refuse_link(dst, "to")
    if dst.exists() and not overwrite:
        raise TargetExists(dst, "to")
    if dst.is_dir():
        raise InvalidSetting("to", f"{dst} is a folder; give a file path ending in .safetensors")
    dump = open_dump(dump_path, rank=rank)
    triples = dump.select(steps=steps, layers=layers)
    tensors: dict[str, torch.Tensor] = {}
    settings = set()
    head_numbers: dict[int, list[int]] = {}
    facts_by_layer: dict[int, set[tuple[tuple[str, str], ...]]] = defaultdict(set)
    for s, l, _heads in triples:
        facts_by_layer[l].add(tuple(_recorded_facts(dump, s, l).items()))
        info = dump.layer_info(s, l)
        settings.add((info.causal, info.scale, info.head_dim))
        stored = dump.heads(s, l)
        if stored != list(range(len(stored))):  # a partial-head capture: keep the model's head numbers
            head_numbers[l] = stored
        for t in info.arrays:
            tensors[f"step{s}.layer{l}.{t}"] = dump.read(s, l, t).contiguous()
    causal = {c for c, _, _ in settings}
    if len(causal) > 1:
        raise DumpError(f"layers of {dump.path} disagree on causal, but a safetensors file has one; export the layers "
                        "one at a time")
    default_scale = all(math.isclose(sc, 1.0 / math.sqrt(d), rel_tol=1e-7) for _, sc, d in settings if d)
    scales = {sc for _, sc, _ in settings}
    if not default_scale and len(scales) > 1:
        raise DumpError(f"layers of {dump.path} disagree on scale, but a safetensors file has one; export the layers "
                        "one at a time")
    causal_value = causal.pop() if causal else True
    metadata = {"causal": "true" if causal_value else "false"}
    scale = None if default_scale else scales.pop()
    if scale is not None:
        metadata["scale"] = repr(float(scale))
    for l, numbers in head_numbers.items():
        metadata[f"layer{l}.heads"] = ",".join(str(h) for h in numbers)
    metadata.update(_facts_metadata(dump, facts_by_layer))
    try:
        data = save(tensors, metadata=metadata)
    except MemoryError:
        raise DumpError(f"the selection of {dump.path} is too large to export in memory; export fewer steps or layers "
                        f"(--step, --layer)") from None
    atomic_write(dst, data, "to", exclusive=not overwrite)
    return ConvertResult(str(dump.path), str(dst), sorted({s for s, _, _ in triples}), sorted({l for _, l,
                                                                                               _ in triples}),
                         len(tensors), causal_value, scale)



def _recorded_facts(dump: Dump, step: int, layer: int) -> dict[str, str]:
    """The run's facts a layer-step records (what `import` reads back), "unknown" where it records none."""
    run = dict(dump.attrs or {})
    try:
        attrs = dict(dump._layer(step, layer).attrs)
    except Exception:  # a stand-in without zarr groups
        attrs = {}

    def text(value: Any) -> str:
        return value.strip() if isinstance(value, str) and value.strip() else UNKNOWN

    autocast = text(attrs.get("autocast_dtype"))
    if autocast == UNKNOWN and attrs.get("autocast") is False:
        autocast = "none"
    raw = {"device": text(attrs.get("device_type")) if "device_type" in attrs else text(run.get("device")),
           "kernel": text(attrs.get("kernel")) if "kernel" in attrs else text(attrs.get("source")),
           "autocast_dtype": autocast, "softmax": text(attrs.get("softmax"))}
    out = {}
    for name, value in raw.items():
        try:
            out[name] = check_fact(name, value, "")
        except DumpError:  # what the dump says is no fact an import could read back: not written
            out[name] = UNKNOWN
    return out


def _facts_metadata(dump: Dump, facts_by_layer: dict[int, set[tuple[tuple[str, str], ...]]]) -> dict[str, str]:
    """The metadata that records the exported layers' facts: once for the file where every layer agrees, per layer
    (`layer{L}.<fact>`) where they differ; DumpError where one layer's steps disagree (a file has one per layer)."""
    per_layer = {}
    for layer, seen in facts_by_layer.items():
        if len(seen) > 1:
            raise DumpError(f"the steps of layer {layer} of {dump.path} record different facts (device, kernel, "
                            "autocast, softmax), but a safetensors file has one per layer; export the steps one at a "
                            "time")
        per_layer[layer] = dict(next(iter(seen)))
    metadata = {}
    for name in FACTS:
        values = {f[name] for f in per_layer.values()}
        if values == {UNKNOWN}:
            continue
        if len(values) == 1:
            metadata[name] = values.pop()
        else:
            metadata.update({f"layer{layer}.{name}": f[name] for layer, f in per_layer.items() if f[name] != UNKNOWN})
    return metadata
