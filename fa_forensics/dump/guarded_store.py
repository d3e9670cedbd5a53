"""The zarr store and codec every dump is read through: bounded by what is on disk.

- `RegularFileStore`: zarr's LocalStore whose reads go through `safe_read.read_regular`, so a metadata file or
  chunk that is a FIFO, a device or a socket is refused without blocking instead of hanging or reading forever.
- `BoundedZstdCodec`: zarr's zstd codec whose decoding never produces more than the chunk's byte size (shape of
  a chunk times its item size). A zstd frame header carries the content size it claims: a claim other than the
  chunk's byte size is damage, refused before anything is allocated; a frame without one is decoded into a
  buffer of exactly the chunk's byte size, and zstd stops with an error at its end. A 128 KiB chunk of RLE
  blocks that would inflate to gigabytes costs the chunk's bytes, never more.
- `bounded(array)`: the same zarr array with its zstd codec replaced by the bounded one. Only the arrays the
  reader opens get it (no process-wide change to zarr's codec registry); `integrity.check_array` has checked
  beforehand that zstd sits directly on the `bytes` codec, where the chunk's byte size is exactly its output.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zarr
from numcodecs.zstd import decompress
from zarr.codecs import ZstdCodec
from zarr.core.array import AsyncArray
from zarr.core.metadata.v3 import ArrayV3Metadata
from zarr.storage import LocalStore

from fa_forensics.dump.metadata_checks import MAX_RATIO
from fa_forensics.dump.safe_read import read_regular

if TYPE_CHECKING:
    from zarr.abc.store import ByteRequest
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, BufferPrototype

_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = 0x184D2A50  # the 16 values 0x184D2A50..5F mark skippable frames


class ChunkSizeError(ValueError):
    """A compressed chunk that decodes (or claims to decode) to a size other than the chunk's byte size."""

    worded = True  # its message is a sentence for the user (integrity.describe_error shows it alone)


def frame_content_size(data: bytes | memoryview | np.ndarray) -> int | None:
    """The content size the first zstd frame of `data` declares in its header (RFC 8878, 3.1.1.1), or None when
    it declares none (a streamed frame) or `data` is not a zstd frame (the decoder then says what is wrong)."""
    octets = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
    buf = memoryview(octets.data)
    pos = 0
    while len(buf) - pos >= 8 and int.from_bytes(buf[pos:pos + 4], "little") & ~0xF == _SKIPPABLE_MAGIC:
        pos += 8 + int.from_bytes(buf[pos + 4:pos + 8], "little")
    if len(buf) - pos < 5 or int.from_bytes(buf[pos:pos + 4], "little") != _ZSTD_MAGIC:
        return None
    descriptor = buf[pos + 4]
    fcs_flag, single_segment, did_flag = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 3
    fcs_bytes = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if fcs_bytes == 0:
        return None
    start = pos + 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[did_flag]
    if len(buf) < start + fcs_bytes:
        return None
    value = int.from_bytes(buf[start:start + fcs_bytes], "little")
    return value + 256 if fcs_bytes == 2 else value


def chunk_nbytes(chunk_spec: ArraySpec) -> int | None:
    """The byte size of one decoded chunk (shape times item size), None for a variable-size data type."""
    try:
        itemsize = chunk_spec.dtype.to_native_dtype().itemsize
    except (AttributeError, TypeError):
        return None
    if not itemsize:
        return None
    return math.prod(chunk_spec.shape) * itemsize


def bounded_decode(data: np.ndarray, expected: int) -> np.ndarray:
    """Decode the zstd bytes of one chunk into exactly `expected` bytes; ChunkSizeError when they hold another
    size (a claim in a frame header, or a chunk size no zstd data that short can reach, is refused before any
    allocation)."""
    if expected > MAX_RATIO * len(data):
        raise ChunkSizeError(f"its {len(data)} bytes cannot inflate to the chunk's {expected} bytes (zstd inflates "
                             f"at most {MAX_RATIO}-fold)")
    claimed = frame_content_size(data)
    if claimed is not None and claimed != expected:
        bomb = " (a decompression bomb, or damage)" if claimed > expected else ""
        raise ChunkSizeError(f"its zstd frame claims {claimed} bytes where the chunk holds {expected}{bomb}")
    out = np.empty(expected, dtype=np.uint8)
    try:
        decompress(data, out)  # zstd stops at the end of `out`: never more than the chunk's bytes
    except (RuntimeError, ValueError) as exc:
        text = str(exc)
        if "too small" in text:
            raise ChunkSizeError(f"it inflates past the chunk's {expected} bytes (a decompression bomb, or "
                                 "damage)") from None
        if "expected to decompress" in text:
            raise ChunkSizeError(f"it inflates to fewer than the chunk's {expected} bytes") from None
        raise
    return out


class BoundedZstdCodec(ZstdCodec):
    """zarr's zstd codec, decoding into the chunk's byte size and never past it (see the module docstring)."""

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        expected = chunk_nbytes(chunk_spec)
        if expected is None:  # variable-size items: no byte size to bound by (dump arrays never have them)
            return super()._decode_sync(chunk_bytes, chunk_spec)
        out = bounded_decode(chunk_bytes.as_numpy_array(), expected)
        return chunk_spec.prototype.buffer.from_bytes(out.data)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)


def bounded(array: zarr.Array) -> zarr.Array:
    """`array` reading through BoundedZstdCodec (the same store, metadata and values)."""
    meta = array.metadata
    if not isinstance(meta, ArrayV3Metadata):
        return array
    codecs = tuple(BoundedZstdCodec(level=c.level, checksum=c.checksum) if type(c) is ZstdCodec else c
                   for c in meta.codecs)
    if codecs == meta.codecs:
        return array
    swapped = dataclasses.replace(meta, codecs=codecs)
    return zarr.Array(AsyncArray(metadata=swapped, store_path=array.store_path, config=array.async_array.config))


def _get_regular(path: Path, prototype: BufferPrototype, byte_range: ByteRequest | None) -> Buffer:
    data = read_regular(path)
    if byte_range is not None:
        data = _byte_range(data, byte_range)
    return prototype.buffer.from_bytes(data)


def _byte_range(data: bytes, byte_range: ByteRequest) -> bytes:
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    if isinstance(byte_range, RangeByteRequest):
        return data[byte_range.start:byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return data[byte_range.offset:]
    if isinstance(byte_range, SuffixByteRequest):
        return data[max(0, len(data) - byte_range.suffix):]
    raise TypeError(f"unexpected byte range {byte_range!r}")


class RegularFileStore(LocalStore):
    """zarr's LocalStore reading regular files only, without blocking (see the module docstring)."""

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if prototype is None:
            from zarr.core.buffer import default_buffer_prototype

            prototype = default_buffer_prototype()
        if not self._is_open:
            await self._open()
        try:
            return await asyncio.to_thread(_get_regular, self.root / key, prototype, byte_range)
        except (FileNotFoundError, NotADirectoryError):
            return None

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]
