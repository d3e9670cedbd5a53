"""The cached match behind `--preset auto`: kept beside the dump (never in it), recomputed when the dump changes."""
from __future__ import annotations

import json
import os

import pytest
import zarr

from fa_forensics.fidelity import match_cache
from fa_forensics.fidelity.match import best_recipe
from fa_forensics.dump import open_dump


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(match_cache.ENV_DIR, str(root))
    return root / "match"


def _snapshot(path):
    """(relative path, bytes, mode) of every file and folder of a store."""
    out = []
    for p in sorted([path, *path.rglob("*")]):
        st = os.lstat(p)
        out.append((str(p.relative_to(path.parent)), p.read_bytes() if p.is_file() else b"", st.st_mode))
    return out


def test_best_recipe_is_cached_beside_the_dump_and_a_changed_o_invalidates_it(make_dump, cache, counted):
    path = make_dump(steps=(0,), seq=32, head_dim=16)
    before = _snapshot(path)
    first = best_recipe(open_dump(path), 0, 0)
    assert first.best.o_bits_equal == 1.0 and first.best.preset == "bf16" and len(counted) == 1  # o = the bf16 replay
    assert _snapshot(path) == before  # nothing in the dump changed
    (entry,) = cache.glob("*.json")
    kept = json.loads(entry.read_text())["candidates"]
    assert (kept[-1]["preset"], kept[-1]["o_bits_equal"], kept[-1]["sampled"]) == ("bf16", 1.0, False)
    again = best_recipe(open_dump(path), 0, 0)
    assert again == first and len(counted) == 1  # read from the cache

    o = zarr.open_group(str(path), mode="r+")["step_000000000/layer_000/o"]
    bits = o[...]
    bits[0, 0, 5, 3] ^= 1  # one stored O element one ulp off: the dump changed
    o[...] = bits
    changed = best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2 and changed.best.o_bits_equal < 1.0


def test_cache_off_keeps_nothing(make_dump, tmp_path, monkeypatch, counted):
    monkeypatch.setenv(match_cache.ENV_DIR, "off")
    path = make_dump(steps=(0,), seq=16)
    best_recipe(open_dump(path), 0, 0)
    best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2 and match_cache.cache_dir() is None


def test_a_planted_link_at_the_cache_file_is_neither_followed_nor_replaced(make_dump, cache, tmp_path, counted):
    path = make_dump(steps=(0,), seq=16)
    best_recipe(open_dump(path), 0, 0)
    (entry,) = cache.glob("*.json")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    entry.unlink()
    entry.symlink_to(victim)
    with pytest.warns(match_cache.MatchCacheWarning, match="symbolic link"):
        best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2  # the link was not read as a result
    assert victim.read_text() == "precious" and entry.is_symlink()  # not written through, not replaced


def test_a_cache_directory_that_is_a_link_is_judged_by_its_target(make_dump, cache, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o777)  # a shared folder: refused whatever the link's own mode
    cache.parent.mkdir(parents=True)
    cache.symlink_to(elsewhere)
    with pytest.warns(match_cache.MatchCacheWarning, match=r"writable by others \(mode 777\)"):
        best_recipe(open_dump(make_dump(steps=(0,), seq=16)), 0, 0)
    assert list(elsewhere.iterdir()) == []
