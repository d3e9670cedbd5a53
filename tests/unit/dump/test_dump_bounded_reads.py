"""Reads bounded by what is on disk: zstd frames decoded into the chunk's bytes and never past them, special files
refused without blocking, metadata refused before it drives an allocation, every problem of a step named."""
from __future__ import annotations

import json
import os
import threading
import tracemalloc
import warnings
from pathlib import Path

import numcodecs.zstd
import numpy as np
import pytest

from fa_forensics.dump import open_dump
from fa_forensics.dump.guarded_store import ChunkSizeError, MAX_RATIO, bounded_decode, frame_content_size
from fa_forensics.dump.integrity import check_step
from fa_forensics.dump.metadata_checks import MAX_NESTING, nesting, read_metadata
from fa_forensics.dump.safe_read import NotRegularFile, read_regular
from fa_forensics.dump.verify import verify
from tests.helpers.hostile import char_device, claiming_frame, rle_bomb

LAYER = Path("step_000000001") / "layer_000"


@pytest.mark.parametrize("n", [0, 1, 255, 256, 300, 65791, 70000, 5_000_000])
def test_frame_content_size_reads_every_size_field_zstd_writes(n):
    """numcodecs writes 1-, 2-, 4- or 8-byte size fields by size (the 2-byte one offset by 256)."""
    assert frame_content_size(numcodecs.zstd.compress(bytes(n))) == n


def test_a_streamed_frame_declares_no_size_and_decodes_exactly():
    assert frame_content_size(rle_bomb(2**17)) is None
    assert bytes(bounded_decode(np.frombuffer(rle_bomb(2**17), np.uint8), 2**17)) == b"\x3f" * 2**17


def test_a_bomb_costs_the_chunks_bytes_and_never_more():
    """2 GiB of RLE blocks into a 2 KiB chunk: refused at the chunk's end, peak memory unchanged."""
    bomb = np.frombuffer(rle_bomb(2**31), np.uint8)  # 64 KiB on disk
    tracemalloc.start()  # numpy's buffers and Python's bytes are traced
    try:
        with pytest.raises(ChunkSizeError, match="inflates past the chunk's 2048 bytes"):
            bounded_decode(bomb, 2048)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # bytes: far below the 2 GiB it would inflate to


@pytest.mark.parametrize("claimed, words", [(10**12, "claims 1000000000000 bytes where the chunk holds 2048"),
                                            (1024, "claims 1024 bytes where the chunk holds 2048")])
def test_a_frame_claiming_another_size_is_refused_before_allocation(claimed, words):
    with pytest.raises(ChunkSizeError, match=words):
        bounded_decode(np.frombuffer(claiming_frame(claimed), np.uint8), 2048)


def test_a_chunk_no_zstd_data_that_short_can_fill_is_refused_before_allocation():
    with pytest.raises(ChunkSizeError, match=f"inflates at most {MAX_RATIO}-fold"):
        bounded_decode(np.frombuffer(claiming_frame(2**40), np.uint8), 2**40)


def test_two_frames_that_together_overfill_the_chunk_are_refused():
    two = numcodecs.zstd.compress(bytes(2048)) + numcodecs.zstd.compress(bytes(2048))
    with pytest.raises((ChunkSizeError, ValueError, RuntimeError)):
        bounded_decode(np.frombuffer(two, np.uint8), 2048)


def test_special_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = []
    reader = threading.Thread(target=lambda: done.append(pytest.raises(NotRegularFile, read_regular, fifo)))
    reader.start()
    reader.join(timeout=10)
    assert done, "reading a FIFO blocked"
    assert "a FIFO (named pipe)" in str(done[0].value)
    if char_device(tmp_path / "zero", 1, 5):  # /dev/zero's numbers: reading it would never end
        with pytest.raises(NotRegularFile, match="a character device"):
            read_regular(tmp_path / "zero")
    with pytest.raises(NotRegularFile, match="a folder"):
        read_regular(tmp_path)


def test_metadata_nested_deeper_than_any_dump_is_worded_not_a_recursion_error(tmp_path):
    for depth in (MAX_NESTING + 1, 100_000):
        (tmp_path / "zarr.json").write_text('{"attributes": {"x": ' + "[" * depth + "]" * depth + "}}")
        with pytest.raises(ValueError, match=f"nests deeper than {MAX_NESTING} levels"):
            read_metadata(tmp_path)
    assert nesting({"a": [1, {"b": []}]}) == 4 and nesting(7) == 0


def _edit(path: Path, fn) -> None:
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def test_check_step_names_every_problem_of_a_step_with_its_file(make_dump):
    """A step whose own zarr.json is broken, one array with a negative shape, another missing a chunk: all three,
    each with the file it is in."""
    path = make_dump(steps=(0, 1))
    (path / "step_000000001" / "zarr.json").write_text("{")
    _edit(path / LAYER / "q" / "zarr.json", lambda m: m["shape"].__setitem__(2, -16))
    (path / LAYER / "v" / "c.0.1.0.0").unlink()
    problems = check_step(path / "step_000000001", 1, path)
    assert [d.file for d in problems] == ["step_000000001/zarr.json", "step_000000001/layer_000/q/zarr.json",
                                          "step_000000001/layer_000/v/c.0.1.0.0"]
    assert problems[0].what.startswith("zarr.json is not valid JSON")
    assert problems[1].what == "shape (1, 2, -16, 8) has a negative dimension"
    assert problems[2].what == "1 chunk missing (c.0.1.0.0)"


def test_a_check_that_fails_is_damage_of_its_step_never_an_exception(make_dump, monkeypatch):
    import fa_forensics.dump.integrity as integrity

    path = make_dump(steps=(0, 1))

    def broken(*_a, **_k):
        raise ZeroDivisionError("a check met metadata no writer makes")

    monkeypatch.setattr(integrity, "_check_layer", broken)
    [damage] = check_step(path / "step_000000001", 1, path)
    assert damage.what.startswith("cannot be checked (ZeroDivisionError")


def test_verify_reports_a_missing_and_a_corrupt_chunk_of_one_step(make_dump):
    path = make_dump(steps=(0, 1))
    (path / LAYER / "v" / "c.0.0.0.0").unlink()
    chunk = path / LAYER / "q" / "c.0.1.0.0"
    chunk.write_bytes(chunk.read_bytes()[:10])
    report = verify(path)
    assert report.steps == [0] and report.damaged_steps == [1]
    assert sorted((d.array, d.file) for d in report.problems) == [
        ("q", "step_000000001/layer_000/q/c.0.1.0.0"), ("v", "step_000000001/layer_000/v/c.0.0.0.0")]


def test_a_heads_list_longer_than_the_heads_stored_is_damage(make_dump):
    path = make_dump(steps=(0, 1))
    _edit(path / LAYER / "zarr.json", lambda m: m["attributes"].update(heads=list(range(100_000))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = open_dump(path)
    assert dump.steps == [0]
    assert "layer attribute heads lists 100000 heads but the arrays hold 2" in str(dump.damage[1][0])


def test_a_timeline_claiming_rows_it_does_not_hold_is_damage_and_the_steps_still_read(make_dump):
    from fa_forensics.dump import DumpWriter
    from fa_forensics.errors import DumpError

    path = make_dump(steps=(0,))
    with DumpWriter(path, {"model": {"name": "test"}}) as writer:
        for step in range(3):
            writer.append_timeline(step, loss=1.0 + step)
    assert open_dump(path).timeline["loss"].tolist() == [1.0, 2.0, 3.0]
    _edit(path / "timeline" / "step" / "zarr.json", lambda m: m["shape"].__setitem__(0, 300_000_000))
    dump = open_dump(path)
    with pytest.raises(DumpError, match=r"damaged: .*timeline/step: 1171874 chunks missing"):
        dump.timeline  # noqa: B018
    with pytest.warns(UserWarning, match="the timeline cannot be read"):
        summary = dump.summary()
    assert summary["steps"] == [0] and summary["timeline"] is None


def test_a_chunk_shape_no_file_present_could_hold_is_damage_before_any_read(make_dump):
    """Shape (1, 2, 2^30, 8) in chunks of one head, with the two chunk files of a few hundred bytes each: 16 GiB a
    chunk that no zstd data that short can reach, so nothing is allocated for it."""
    path = make_dump(steps=(0, 1))

    def huge(meta):
        meta["shape"] = [1, 2, 2**30, 8]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [1, 1, 2**30, 8]

    _edit(path / LAYER / "q" / "zarr.json", huge)
    [damage] = check_step(path / "step_000000001", 1, path)
    assert damage.what.startswith("2 chunk files too short to hold the chunk's 17179869184 bytes"), damage


def test_counts_in_the_metadata_are_checked_against_the_arrays(make_dump):
    """head_dim other than the arrays' width, and a step listing 10^5 layers it lacks: a bounded list of damage."""
    path = make_dump(steps=(0, 1))
    _edit(path / LAYER / "zarr.json", lambda m: m["attributes"].update(head_dim=4096))
    _edit(path / "step_000000001" / "zarr.json", lambda m: m["attributes"].update(layers=list(range(100_000))))
    problems = [d.what for d in check_step(path / "step_000000001", 1, path)]
    assert "layer attribute head_dim=4096 but the arrays hold 8 values per head" in problems
    assert "99996 more layer folders are missing though the step lists them" in problems and len(problems) == 5
