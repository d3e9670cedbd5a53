"""Files judged by what they hold: sparse files, chunk files longer than any encoding of their chunk, metadata of
more values than a dump has reason to hold."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from numcodecs.zstd import Zstd

from fa_forensics.dump.integrity import max_chunk_file
from fa_forensics.dump.metadata_checks import MAX_METADATA_VALUES, read_metadata
from fa_forensics.dump.safe_read import SparseFile, is_sparse, read_regular


def _sparse(path: Path, held: bytes, apparent: int) -> Path:
    path.write_bytes(held)
    os.truncate(path, apparent)
    return path


def test_a_sparse_file_is_refused_before_it_is_read(tmp_path):
    path = _sparse(tmp_path / "c.0.0.0.0", os.urandom(4096), 2**30)
    assert is_sparse(os.stat(path))
    with pytest.raises(SparseFile, match=r"claims 1073741824 bytes but holds \d+ on disk"):
        read_regular(path)


def test_dense_files_and_small_holes_are_read(tmp_path):
    dense = tmp_path / "dense"
    dense.write_bytes(os.urandom(3 * 2**20))
    assert not is_sparse(os.stat(dense)) and len(read_regular(dense)) == 3 * 2**20
    small_hole = _sparse(tmp_path / "small", b"x" * 100, 512 * 1024)  # a hole under the slack
    assert not is_sparse(os.stat(small_hole)) and len(read_regular(small_hole)) == 512 * 1024


@pytest.mark.parametrize("nbytes", [1, 256, 4096, 128 * 1024, 128 * 1024 + 1, 2**21])
def test_no_zstd_encoding_of_a_chunk_is_longer_than_the_bound(nbytes):
    """Incompressible bytes (the worst case), with the checksum the writer asks for: within max_chunk_file."""
    data = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    for level in (0, 1, 3, 19):
        encoded = Zstd(level=level, checksum=True).encode(data)
        assert len(encoded) + 4 <= max_chunk_file(nbytes), (nbytes, level, len(encoded))  # + crc32c
    assert max_chunk_file(nbytes) < nbytes + nbytes // 128 + 1200


def test_metadata_of_too_many_values_is_refused_before_parsing(tmp_path):
    node = tmp_path / "node"
    node.mkdir()
    zeros = ",".join(["0"] * (MAX_METADATA_VALUES + 1))
    (node / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {"x": [' + zeros + "]}}")
    with pytest.raises(ValueError, match="values, more than the 1048576"):
        read_metadata(node)
    (node / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {"x": [0, 0]}}')
    assert read_metadata(node)["attributes"]["x"] == [0, 0]


def test_sparse_metadata_is_damage_of_its_file(tmp_path):
    node = tmp_path / "node"
    node.mkdir()
    _sparse(node / "zarr.json", b'{"zarr_format": 3, "node_type": "group"}', 15 * 2**20)
    with pytest.raises(ValueError, match="zarr.json is a sparse file"):
        read_metadata(node)
