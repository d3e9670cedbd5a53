"""What a dump's metadata must be before anything is read or allocated from it.

Every `zarr.json` of a store is read by `read_metadata`: a regular file (never a FIFO or a device, never sparse), at
most MAX_METADATA_BYTES holding at most MAX_METADATA_VALUES values, valid JSON nested at most MAX_NESTING levels.
Then each kind of node is checked here against what fa-forensics writes, and each problem is one sentence:

- an array (`array_problems`): its shape (whole numbers from 1 to MAX_DIM, the right number of them), its
  regular chunk grid (chunk sizes from 1 up, one per dimension), its chunk-key encoding, its codecs (the
  `bytes` codec, then zstd and crc32c only, zstd first: the pipeline whose decoded size `guarded_store`
  bounds by the chunk's byte size) and whatever else zarr's own parser refuses;
- the attributes of the root, of a step and of a layer (`attribute_problems`): the type each key must have.

Nothing here reads chunk data; `integrity` walks the store and compares the metadata with the files present.
"""
from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fa_forensics.dump.safe_read import FileTooLarge, NotRegularFile, SparseFile, read_regular
from fa_forensics.errors import UserError

# No attention tensor has a dimension this long: a larger one is hostile metadata, refused before any work.
MAX_DIM = 2**31 - 1
# The largest zarr.json a dump has reason to hold (the bundled ones hold at most 10 kB).
MAX_METADATA_BYTES = 16 * 2**20
# The deepest nesting of a zarr.json a dump has reason to hold (codecs and attributes nest a few levels).
MAX_NESTING = 64
# The most values (numbers, texts, lists, objects) a zarr.json has reason to hold: a synth dump's ground truth
# holds about 40 per planted (step, layer, batch, head), the bundled ones at most 260. Counted from the commas
# before the text is parsed, so a file of millions of values costs one scan, never a parse and a check of each.
MAX_METADATA_VALUES = 2**20

# The stored (zarr) data type each `dtype` attribute needs: bf16 / fp8 travel as same-width ints.
STORED_TYPE = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float16",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "bool": "bool",
}
# Data types of the timeline's per-step series.
NUMERIC_TYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                 "float32", "float64")
READ_CODECS = ("bytes", "zstd", "crc32c")
ITEM_BYTES = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "int32": 4, "uint32": 4,
              "float32": 4, "int64": 8, "uint64": 8, "float64": 8}
# The most zstd can inflate: every block (at most 128 KiB of output) costs at least 4 bytes (3 of header, 1 of RLE).
MAX_RATIO = 128 * 1024 // 4  # what dump arrays may be encoded with (see the module docstring)


def read_metadata(node: Path) -> dict[str, Any]:
    """The parsed `zarr.json` of a group or array folder; ValueError saying why it cannot be read."""
    meta_path = Path(node) / "zarr.json"
    try:
        raw = read_regular(meta_path, MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise ValueError("zarr.json is missing") from None
    except NotRegularFile as exc:
        raise ValueError(f"zarr.json is {exc.kind}, not a file") from None
    except SparseFile as exc:
        raise ValueError(f"zarr.json is a sparse file (it claims {exc.size} bytes but holds {exc.allocated} on "
                         "disk)") from None
    except FileTooLarge as exc:
        raise ValueError(f"zarr.json holds {exc.size} bytes, more than the {exc.limit} a dump's metadata "
                         "may hold") from None
    except OSError as exc:
        raise ValueError(f"zarr.json cannot be read ({exc.strerror or type(exc).__name__})") from None
    values = raw.count(b",") + 1
    if values > MAX_METADATA_VALUES:
        raise ValueError(f"zarr.json holds about {values} values, more than the {MAX_METADATA_VALUES} a dump's "
                         "metadata has reason to hold; the metadata is hostile or corrupt")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("zarr.json is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"zarr.json is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ValueError(f"zarr.json nests deeper than {MAX_NESTING} levels") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and nesting(meta) > MAX_NESTING:  # fewer brackets: shallow
        raise ValueError(f"zarr.json nests deeper than {MAX_NESTING} levels")
    if not isinstance(meta, dict) or not isinstance(meta.get("attributes", {}), dict):
        raise ValueError("zarr.json is not a zarr v3 metadata object")
    if meta.get("zarr_format") != 3:
        raise ValueError(f"zarr.json has zarr_format {_short(meta.get('zarr_format'))}, not 3")
    return meta


def nesting(value: Any) -> int:
    """How many levels of lists and objects `value` nests (0 for a number or a string); iterative, so a deep
    value cannot exhaust the interpreter's stack."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth = max(depth, level)
        if depth > MAX_NESTING:
            return depth
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return depth


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


def describe_error(exc: BaseException) -> str:
    """'ZstdError: ...' in one short line (an error of fa-forensics's own words: its text alone)."""
    text = " ".join(str(exc).split())
    if len(text) > 160:
        text = text[:157] + "..."
    if isinstance(exc, UserError) or getattr(exc, "worded", False):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def array_problems(meta: dict[str, Any], dims: int | None, data_types: tuple[str, ...]) -> list[str]:
    """Why an array's metadata cannot be read safely ([] when it can): node type, data type, shape, chunk grid,
    key encoding, codecs, then zarr's own parser. `dims`: the number of dimensions it must have (None: any)."""
    if meta.get("node_type") != "array":
        return ["zarr.json does not describe an array"]
    problems = []
    stored = meta.get("data_type")
    if stored not in data_types:
        problems.append(f"data type {_short(stored)} is not one of {', '.join(data_types)}")
    shape = meta.get("shape")
    if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
        problems.append(f"shape {_short(shape)} is not a list of whole numbers")
        shape = None
    elif dims is not None and len(shape) != dims:
        problems.append(f"shape {_short(shape)} is not {dims}-D")
    elif any(s < 0 for s in shape):
        problems.append(f"shape {tuple(shape)} has a negative dimension")
    elif 0 in shape:
        problems.append(f"array is empty (shape {tuple(shape)})")
    elif any(s > MAX_DIM for s in shape):
        problems.append(f"shape {tuple(shape)} is absurd (a dimension above {MAX_DIM}); the metadata is hostile "
                        "or corrupt")
    problems += _grid_problems(meta.get("chunk_grid"), shape)
    problems += _key_encoding_problems(meta.get("chunk_key_encoding", {"name": "default"}))
    problems += codec_problems(meta.get("codecs"))
    if not problems:
        problems += _zarr_refuses(meta)
    return problems


def _grid_problems(grid: Any, shape: list[int] | None) -> list[str]:
    try:
        if grid["name"] != "regular":
            return [f"chunk grid {_short(grid['name'])} is not the regular grid fa-forensics writes"]
        chunks = grid["configuration"]["chunk_shape"]
    except (KeyError, TypeError):
        return [f"chunk grid {_short(grid)} names no chunk shape"]
    if not isinstance(chunks, list) or not all(_is_int(c) for c in chunks):
        return [f"chunk shape {_short(chunks)} is not a list of whole numbers"]
    if shape is not None and len(chunks) != len(shape):
        return [f"chunk shape {tuple(chunks)} has {len(chunks)} dimensions, the shape {len(shape)}"]
    if any(c < 1 for c in chunks):
        return [f"chunk shape {tuple(chunks)} has a dimension below 1"]
    if any(c > MAX_DIM for c in chunks):
        return [f"chunk shape {tuple(chunks)} is absurd (a dimension above {MAX_DIM})"]
    return []


def _key_encoding_problems(encoding: Any) -> list[str]:
    if not isinstance(encoding, dict) or encoding.get("name") != "default":
        return [f"chunk key encoding {_short(encoding)} is not zarr's default one, which fa-forensics writes"]
    configuration = encoding.get("configuration") or {}
    separator = configuration.get("separator", "/") if isinstance(configuration, dict) else None
    if separator not in ("/", "."):
        return [f"chunk key separator {_short(separator)} is not '/' or '.'"]
    return []


def codec_problems(codecs: Any) -> list[str]:
    """Why a codec list is not one fa-forensics reads: `bytes`, then zstd (first, at most once) and crc32c."""
    if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
        return [f"codecs {_short(codecs)} is not a list of codecs"]
    names = [c.get("name") for c in codecs]
    for name in names:
        if name not in READ_CODECS:
            known = _zarr_knows_codec(name)
            what = "is not one fa-forensics reads" if known else "is unknown"
            return [f"codec {_short(name)} {what} (dumps use {', '.join(READ_CODECS)}: the only codecs whose "
                    "decoded size is bounded by the chunk's)"]
    if names[0] != "bytes" or "bytes" in names[1:] or names.count("zstd") > 1 or (
            "zstd" in names and names[1] != "zstd"):
        return [f"codecs {names} are not in the order fa-forensics reads (bytes, then zstd, then crc32c)"]
    return []


def _zarr_knows_codec(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    try:
        from zarr.registry import get_codec_class

        get_codec_class(name)
    except Exception:  # zarr raises KeyError, or its own error, for a name it has no codec for
        return False
    return True


def _zarr_refuses(meta: dict[str, Any]) -> list[str]:
    """zarr's own verdict on array metadata that passed the checks above (codec settings, fill value, ...)."""
    # Arrays of a dump share their encoding; only it is left for zarr to judge (shape and grid are checked above)
    fields = {k: v for k, v in meta.items() if k not in ("attributes", "shape")}
    fields["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [1] * len(meta["shape"])}}
    fields["shape"] = [1] * len(meta["shape"])
    return list(_zarr_verdict(json.dumps(fields, sort_keys=True)))


@functools.lru_cache(maxsize=256)
def _zarr_verdict(fields: str) -> tuple[str, ...]:
    from zarr.core.metadata.v3 import ArrayV3Metadata

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ArrayV3Metadata.from_dict(json.loads(fields))
    except Exception as exc:  # whatever zarr raises for metadata it cannot use
        return (f"zarr.json is not valid zarr array metadata ({describe_error(exc)})",)
    return ()


def chunk_bytes(meta: dict[str, Any]) -> int:
    """The byte size of one decoded chunk of an array whose metadata passed `array_problems`."""
    return math.prod(meta["chunk_grid"]["configuration"]["chunk_shape"]) * ITEM_BYTES[meta["data_type"]]


def chunk_grid(meta: dict[str, Any]) -> tuple[list[int], str] | None:
    """(chunks per dimension, key separator) of a regular-grid array whose metadata passed `array_problems`."""
    try:
        shape = [int(s) for s in meta["shape"]]
        chunk_shape = [int(c) for c in meta["chunk_grid"]["configuration"]["chunk_shape"]]
        encoding = meta.get("chunk_key_encoding", {"name": "default"})
        if encoding.get("name") != "default":
            return None
        sep = (encoding.get("configuration") or {}).get("separator", "/")
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if len(shape) != len(chunk_shape) or any(c < 1 for c in chunk_shape):
        return None
    return [-(-s // c) for s, c in zip(shape, chunk_shape)], str(sep)


# -- attributes ---------------------------------------------------------------------------------------------------

Check = tuple[Callable[[Any], bool], str]


def _count(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _flag(v: Any) -> bool:
    return isinstance(v, bool)


def _obj(v: Any) -> bool:
    return isinstance(v, dict)


def _counts(v: Any) -> bool:
    return isinstance(v, list) and all(_count(x) for x in v)


def _distinct_counts(v: Any) -> bool:
    return _counts(v) and len(set(v)) == len(v)


def _finite_positive(v: Any) -> bool:
    return _number(v) and math.isfinite(v) and v > 0


def _probability(v: Any) -> bool:
    return _number(v) and 0 <= v <= 1


def _ground_truth(v: Any) -> bool:
    if not isinstance(v, dict):
        return False
    layout = v.get("ties_layout", {})
    return isinstance(layout, dict) and all(isinstance(x, dict) and _count(x.get("n_tied_rows")) for x in
                                            layout.values())


ROOT_ATTRS: dict[str, Check] = {
    "format_version": (_count, "is not a format number"),
    "tool_version": (_text, "is not text"),
    "torch_version": (_text, "is not text"),
    "device": (_text, "is not text"),
    "amp_dtype": (_text, "is not text"),
    "world_size": (lambda v: _is_int(v) and v >= 1, "is not a count of ranks"),
    "model": (_obj, "is not an object"),
    "capture": (_obj, "is not an object"),
    "ground_truth": (_ground_truth, "is not synth's ground truth (an object whose ties_layout counts tied rows)"),
}
STEP_ATTRS: dict[str, Check] = {
    "step": (_count, "is not a step number"),
    "complete": (_flag, "is not true/false"),
    "loss": (_number, "is not a number"),
    "rank": (_count, "is not a rank"),
    "micro_batch": (_count, "is not a count"),
    "layers": (_counts, "is not a list of layer numbers"),
}
LAYER_ATTRS: dict[str, Check] = {
    "module": (_text, "is not text"),
    "n_heads": (_count, "is not a count"),
    "head_dim": (_count, "is not a count"),
    "scale": (_number, "is not a number"),
    "causal": (_flag, "is not true/false"),
    "dtype": (_text, "is not text"),
    "heads": (_distinct_counts, "is not a list of distinct head numbers"),
    "arrays": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "is not a list of array names"),
    "dropout_p": (_probability, "is not a probability"),
    "mask": (lambda v: v in ("bool", "additive"), "is not 'bool' or 'additive'"),
    "autocast": (_flag, "is not true/false"),
    "input_dtype": (_text, "is not text"),
}


def attribute_problems(attrs: dict[str, Any], checks: dict[str, Check], what: str) -> list[str]:
    """'<what> attribute KEY=VALUE <is not ...>' for each attribute of a wrong type (None is always allowed)."""
    return [f"{what} attribute {key}={_short(attrs[key])} {reason}"
            for key, (ok, reason) in checks.items() if attrs.get(key) is not None and not ok(attrs[key])]


def layer_attribute_problems(attrs: dict[str, Any]) -> list[str]:
    """The layer attributes' types, and the values a replay relies on (a positive finite scale, known arrays)."""
    from fa_forensics.dump.schema import ARRAY_NAMES

    problems = attribute_problems(attrs, LAYER_ATTRS, "layer")
    scale = attrs.get("scale")
    if _number(scale) and not _finite_positive(scale):
        problems.append(f"layer attribute scale={scale!r} is not a positive finite softmax scale")
    arrays = attrs.get("arrays")
    if isinstance(arrays, list) and all(isinstance(a, str) for a in arrays) and not all(a in ARRAY_NAMES
                                                                                      for a in arrays):
        problems.append(f"layer attribute arrays={_short(arrays)} names unknown arrays")
    return problems
