"""The dump store (format v1, zarr v3): `DumpWriter` writes it, `open_dump` reads it lazily.

See schema.py for the layout; safetensors.py converts to and from safetensors files.
"""
from fa_forensics.dump.reader import Dump, IncompleteStepWarning, open_dump
from fa_forensics.dump.schema import FORMAT_VERSION, TENSOR_NAMES, LayerInfo
from fa_forensics.dump.writer import DumpWriter

__all__ = ["Dump", "DumpWriter", "FORMAT_VERSION", "IncompleteStepWarning", "LayerInfo", "TENSOR_NAMES", "open_dump"]
