"""The dump store (format v1, zarr v3): `DumpWriter` writes it, `open_dump` reads it lazily.

See schema.py for the layout; safetensors.py converts to and from safetensors files. The names below are
imported on first use, so that a light module of the package (terminal_text, debris) is imported alone.
"""
from typing import TYPE_CHECKING

from fa_forensics import lazy_exports

if TYPE_CHECKING:  # the same names, for readers of the source (type checkers, the API docs)
    from fa_forensics.dump.reader import Dump, IncompleteStepWarning, open_dump
    from fa_forensics.dump.schema import FORMAT_VERSION, TENSOR_NAMES, LayerInfo
    from fa_forensics.dump.writer import DumpWriter

_EXPORTS = {
    "Dump": "fa_forensics.dump.reader",
    "IncompleteStepWarning": "fa_forensics.dump.reader",
    "open_dump": "fa_forensics.dump.reader",
    "FORMAT_VERSION": "fa_forensics.dump.schema",
    "TENSOR_NAMES": "fa_forensics.dump.schema",
    "LayerInfo": "fa_forensics.dump.schema",
    "DumpWriter": "fa_forensics.dump.writer",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["Dump", "DumpWriter", "FORMAT_VERSION", "IncompleteStepWarning", "LayerInfo", "TENSOR_NAMES", "open_dump"]
