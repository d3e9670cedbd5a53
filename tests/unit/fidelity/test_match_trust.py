"""Nothing kept is believed: match cache entries and in-dump `replay_match` attributes that are malformed (NaN,
wrong types), edited (any field), not sealed with the user's key, in a file or folder the ownership rule refuses,
or contradicted by a replay of every element are warnings, never errors, and never what `match`, `--preset auto`
or `verify` show."""
from __future__ import annotations

import json
import math
import os
import shutil
import stat
import threading
import warnings
from pathlib import Path

import pytest
import zarr
from typer.testing import CliRunner

import fa_forensics.fidelity.match as match_mod
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.fidelity import cache_auth, match_cache
from fa_forensics.fidelity.auto import resolve
from fa_forensics.fidelity.match import best_recipe, to_entry
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.fidelity.stored_match import check_stored_match
from fa_forensics.layers.selection import select

PLANTED = Path(__file__).resolve().parents[3] / "sample_dumps" / "planted.zarr"
runner = CliRunner()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv(match_cache.ENV_DIR, str(root))
    return root / "match"


def _entry(cache: Path) -> tuple[Path, dict]:
    (path,) = cache.glob("*.json")
    return path, json.loads(path.read_text())


def _tamper(path: Path, entry: dict, edit) -> None:
    """`entry` edited and sealed again with the user's key (what only a holder of the key can do): the checks
    behind the seal."""
    edit(entry)
    key = cache_auth.load_key(path.parent.parent, create=False)
    path.write_text(json.dumps(cache_auth.seal(entry, key)))


def _bf16(c: dict) -> bool:
    return (c["preset"], c["accumulation"]) == ("bf16", "ieee")


def _swap_claims(entry: dict) -> None:
    """bf16-hw said to reproduce every element (as if replayed whole), bf16 half of them."""
    n = next(c["n_elements"] for c in entry["candidates"] if _bf16(c))
    for c in entry["candidates"]:
        if (c["preset"], c["accumulation"]) == ("bf16-hw", "ieee"):
            c.update(o_bits_equal=1.0, sampled=False, n_elements=n)
        elif _bf16(c):
            c.update(o_bits_equal=0.5)


def _one_element_less(entry: dict) -> None:
    for c in entry["candidates"]:
        if _bf16(c):
            c["o_bits_equal"] = (c["n_elements"] - 1) / c["n_elements"]


def _bf16_twice(entry: dict) -> None:
    entry["candidates"].append(dict(next(c for c in entry["candidates"] if _bf16(c))))


@pytest.mark.parametrize("edit, said", [
    pytest.param(lambda e: e["candidates"][-1].update(o_bits_equal=math.nan), "o_bits_equal is nan, not a share",
                 id="a NaN share"),
    pytest.param(lambda e: e["candidates"][-1].update(o_bits_equal="1.0"), r"o_bits_equal is '1\.0', not a",
                 id="a share as text"),
    pytest.param(lambda e: e["candidates"][0].update(n_elements="many"), "n_elements is 'many'",
                 id="an element count as text"),
    pytest.param(lambda e: e.update(candidates={"a": 1}), "candidates is not a non-empty list", id="no list"),
    pytest.param(lambda e: e.update(heads="all"), "heads is 'all'", id="heads as text"),
    pytest.param(lambda e: e["candidates"][-1].update(preset="fp32"), "names recipes the search does not try",
                 id="a recipe the search does not try"),
    pytest.param(_swap_claims, "contradicted by the stored bits", id="edited shares"),
    pytest.param(_one_element_less, r"contradicted by the stored bits \(it says bf16 / ieee reproduces 99\.9",
                 id="a share one element short"),
    pytest.param(_bf16_twice, "names bf16 / ieee twice", id="a candidate twice"),
    pytest.param(lambda e: e.update(candidates=e["candidates"][:1] * 3000), r"lists 3000 recipes, more than the 16 it",
                 id="3000 copies of a candidate"),
    pytest.param(lambda e: e.update(candidates=e["candidates"] * 40), r"lists \d+ recipes, more than the 16 it may",
                 id="40 times the candidates"),
    pytest.param(lambda e: e.update(heads=[0]), r"names the heads \[0\], not the layer-step's \[0, 1\]",
                 id="heads of another selection"),
    pytest.param(lambda e: e.update(sample_rows=[[0, 32]]), r"names the row sample \[\[0, 32\]\], not the layer's",
                 id="rows every recipe reproduces named as the sample"),
])
def test_a_tampered_cache_entry_is_a_warning_and_the_stored_bits_decide(make_dump, cache, counted, edit, said):
    path = make_dump(steps=(0,), seq=96, head_dim=16)  # its O is the bf16 reading's
    first = best_recipe(open_dump(path), 0, 0)
    assert (first.best.preset, first.best.o_bits_equal) == ("bf16", 1.0) and len(counted) == 1
    _tamper(*_entry(cache), edit)
    with pytest.warns(match_cache.MatchCacheWarning, match=said):
        again = best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2  # set aside and matched again, never an error
    assert (again.best.preset, again.best.accumulation, again.best.o_bits_equal) == ("bf16", "ieee", 1.0)
    res = runner.invoke(app, ["match", str(path)])  # the command too: one warning line, the right verdict
    assert res.exit_code == 0 and "unexpected" not in res.output
    assert "stored O reproduced 100 % in every selected layer-step (1) by bf16 / ieee" in res.output


def test_an_untouched_entry_is_rechecked_and_used(make_dump, cache, counted, monkeypatch):
    path = make_dump(steps=(0,), seq=96, head_dim=16)
    best_recipe(open_dump(path), 0, 0)
    checked = []
    real = match_mod.rechecked
    monkeypatch.setattr(match_mod, "rechecked", lambda *a, **k: checked.append(1) or real(*a, **k))
    assert best_recipe(open_dump(path), 0, 0).best.preset == "bf16"
    assert len(counted) == 1 and checked == [1]


def _runner_up(entry: dict) -> dict:
    return next(c for c in entry["candidates"] if not _bf16(c))


@pytest.mark.parametrize("edit", [
    pytest.param(lambda e: e.update(excluded_winner={"preset": "bf16-hw", "accumulation": "ieee",
                                                     "o_bits_equal": 1.0, "facts": ["device cpu"]}),
                 id="an excluded winner"),
    pytest.param(lambda e: _runner_up(e).update(max_abs_err=0.0), id="a runner-up's largest difference"),
    pytest.param(lambda e: _runner_up(e).update(o_bits_equal=0.999), id="a runner-up's share"),
    pytest.param(lambda e: e.update(relaxed=["window", "softcap"]), id="facts set aside"),
    pytest.param(lambda e: e.update(n_admitted=999999), id="the recipes admitted"),
    pytest.param(lambda e: e.update(unverifiable="the layout does not fit"), id="unverifiable"),
    pytest.param(lambda e: e.pop(cache_auth.MAC_FIELD), id="no seal"),
])
def test_an_entry_edited_without_the_key_is_ignored_and_matched_again(make_dump, cache, counted, edit):
    path = make_dump(steps=(0,), seq=96, head_dim=16)
    first = best_recipe(open_dump(path), 0, 0)
    entry_path, entry = _entry(cache)
    edit(entry)
    entry_path.write_text(json.dumps(entry))  # the seal left as it was
    with pytest.warns(match_cache.MatchCacheWarning, match="is not sealed with this user's key"):
        again = best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2
    assert to_entry(again) == to_entry(first)  # every field the search's, none the edit's


def test_the_recipes_admitted_are_the_searchs_even_in_a_sealed_entry(make_dump, cache, counted):
    path = make_dump(steps=(0,), seq=96, head_dim=16)
    first = best_recipe(open_dump(path), 0, 0)
    _tamper(*_entry(cache), lambda e: e.update(n_admitted=999999))
    again = best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 1 and again.n_admitted == first.n_admitted < 999999


def test_the_key_is_made_private_and_entries_are_sealed(make_dump, cache):
    best_recipe(open_dump(make_dump(steps=(0,), seq=96, head_dim=16)), 0, 0)
    key = cache.parent / cache_auth.KEY_NAME
    st = key.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == cache_auth.KEY_BYTES and st.st_nlink == 1
    _, entry = _entry(cache)
    assert cache_auth.unseal(entry, key.read_bytes())
    assert not cache_auth.unseal({**entry, "n_admitted": entry["n_admitted"] + 1}, key.read_bytes())


def test_a_key_another_process_is_making_is_waited_for_and_shared(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    key = folder / cache_auth.KEY_NAME
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # made, not yet written: as a racing process
    writer = threading.Timer(0.2, lambda: (os.write(fd, b"k" * cache_auth.KEY_BYTES), os.close(fd)))
    writer.start()
    assert cache_auth.load_key(folder, create=True) == b"k" * cache_auth.KEY_BYTES  # theirs, not a second key
    writer.join()


def _other_user(p: Path) -> None:
    os.chown(p, 12345, 12345, follow_symlinks=False)


def _hard_linked(p: Path) -> None:
    os.link(p, p.parent.parent / "elsewhere.json")


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")


@pytest.mark.parametrize("spoil, said", [
    pytest.param(_other_user, r"owned by another user \(uid 12345\)", id="another user's", marks=needs_root),
    pytest.param(lambda p: p.chmod(0o620), r"writable by its group \(mode 620\)", id="group-writable"),
    pytest.param(lambda p: p.chmod(0o646), r"writable by others \(mode 646\)", id="writable by others"),
    pytest.param(_hard_linked, "has 2 hard links", id="a second hard link"),
    pytest.param(lambda p: (p.unlink(), os.mkfifo(p)), r"is a FIFO \(named pipe\), not a regular file",
                 id="a FIFO"),
])
def test_an_entry_file_the_ownership_rule_refuses_is_not_read(make_dump, cache, counted, spoil, said):
    path = make_dump(steps=(0,), seq=96, head_dim=16)
    best_recipe(open_dump(path), 0, 0)
    entry_path, _ = _entry(cache)
    spoil(entry_path)
    with pytest.warns(match_cache.MatchCacheWarning, match=said):
        best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2
    best_recipe(open_dump(path), 0, 0)  # the refused entry was replaced by the user's own
    assert len(counted) == 2
    assert entry_path.lstat().st_nlink == 1 and entry_path.lstat().st_uid == os.getuid()


@pytest.mark.parametrize("spoil, said", [
    pytest.param(lambda k: k.chmod(0o640), r"readable by others \(mode 640, not 600\)", id="readable by its group"),
    pytest.param(lambda k: k.chmod(0o622), r"writable by others", id="writable by others"),
    pytest.param(_other_user, r"owned by another user \(uid 12345\)", id="another user's", marks=needs_root),
    pytest.param(lambda k: os.link(k, k.parent.parent / "key-copy"), "has 2 hard links", id="a second hard link"),
    pytest.param(lambda k: (k.rename(k.with_suffix(".real")), k.symlink_to(k.with_suffix(".real"))),
                 "is a symbolic link", id="a link"),
    pytest.param(lambda k: k.write_bytes(b"short"), "holds 5 bytes, not a key of 32", id="not a key"),
])
def test_a_key_the_ownership_rule_refuses_seals_nothing(make_dump, cache, counted, spoil, said):
    path = make_dump(steps=(0,), seq=96, head_dim=16)
    best_recipe(open_dump(path), 0, 0)
    key = cache.parent / cache_auth.KEY_NAME
    spoil(key)
    with pytest.warns(match_cache.MatchCacheWarning, match=said):
        best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2  # no entry believed


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_cache_folder_others_can_write_is_refused(make_dump, cache, counted, mode):
    path = make_dump(steps=(0,), seq=96, head_dim=16)
    best_recipe(open_dump(path), 0, 0)
    entry, kept = _entry(cache)
    _tamper(entry, kept, lambda e: None)
    cache.chmod(mode)
    with pytest.warns(match_cache.MatchCacheWarning, match=r"is writable by (others|its group).*refused"):
        best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2  # not read
    before = sorted(p.name for p in cache.iterdir())
    with pytest.warns(match_cache.MatchCacheWarning, match="refused"):
        best_recipe(open_dump(make_dump(steps=(0,), seq=96, head_dim=16, seed=9)), 0, 0)
    assert sorted(p.name for p in cache.iterdir()) == before  # nor written


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_folder_owned_by_another_user_is_refused(make_dump, cache, counted):
    path = make_dump(steps=(0,), seq=96, head_dim=16)
    best_recipe(open_dump(path), 0, 0)
    os.chown(cache, 4242, 4242)
    with pytest.warns(match_cache.MatchCacheWarning, match=r"owned by another user \(uid 4242\)"):
        best_recipe(open_dump(path), 0, 0)
    assert len(counted) == 2


@needs_root
@pytest.mark.parametrize("inside", [False, True], ids=["the cache folder", "a folder above it"])
def test_a_folder_of_another_user_is_never_written_into(make_dump, tmp_path, monkeypatch, counted, inside):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    monkeypatch.setenv(match_cache.ENV_DIR, str(theirs / "cache" if inside else theirs))
    with pytest.warns(match_cache.MatchCacheWarning, match=r"owned by another user \(uid 12345\)"):
        lm = best_recipe(open_dump(make_dump(steps=(0,), seq=96, head_dim=16)), 0, 0)
    assert lm.best.preset == "bf16" and list(theirs.iterdir()) == []  # nothing made in it, no match/, no key


@pytest.mark.parametrize("target_mode, owner, said", [
    pytest.param(0o700, None, None, id="the user's own 0700 folder"),
    pytest.param(0o770, None, r"writable by its group \(mode 770\)", id="a group-writable folder"),
    pytest.param(0o700, 12345, r"owned by another user \(uid 12345\)", id="another user's folder", marks=needs_root),
])
def test_a_linked_cache_folder_is_judged_by_its_target(make_dump, tmp_path, monkeypatch, counted, target_mode, owner,
                                                       said):
    real = tmp_path / "real"
    real.mkdir()
    real.chmod(target_mode)
    if owner is not None:
        os.chown(real, owner, owner)
    link = tmp_path / "cache-link"
    link.symlink_to(real)
    monkeypatch.setenv(match_cache.ENV_DIR, str(link))
    path = make_dump(steps=(0,), seq=96, head_dim=16)
    for _ in range(2):
        if said is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error", match_cache.MatchCacheWarning)
                best_recipe(open_dump(path), 0, 0)
        else:
            with pytest.warns(match_cache.MatchCacheWarning, match=said):
                best_recipe(open_dump(path), 0, 0)
    if said is None:
        assert len(counted) == 1 and len(list((real / "match").glob("*.json"))) == 1  # kept, then read back
    else:
        assert len(counted) == 2 and list(real.iterdir()) == []


def _crafted_planted(tmp_path: Path) -> Path:
    """A copy of planted.zarr whose step 0 layer 0 carries a crafted `replay_match`: it fits the stored bytes, but
    says bf16-hw reproduces every element and bf16 (the recipe that made O) half of them."""
    copy = shutil.copytree(PLANTED, tmp_path / "planted.zarr")
    group = zarr.open_group(str(copy), mode="r+")["step_000000000/layer_000"]
    kept = dict(group.attrs[match_cache.IN_DUMP_ATTR])
    for c in kept["candidates"]:
        if c["preset"] == "bf16-hw" and c["accumulation"] == "ieee":
            c["o_bits_equal"] = 1.0
        elif _bf16(c):
            c["o_bits_equal"] = 0.5
    group.attrs[match_cache.IN_DUMP_ATTR] = kept
    return copy


def test_a_crafted_in_dump_match_is_caught_by_match_auto_and_verify(tmp_path, cache):
    crafted = _crafted_planted(tmp_path)
    dump = open_dump(crafted)
    with pytest.warns(match_cache.MatchCacheWarning, match="attribute replay_match for step 0 layer 0 is contradicted"):
        recipe = resolve(dump, select(dump, step=0), Recipe())
    assert recipe.choice_at(0, 0).preset == "bf16" and recipe.choice_at(0, 0).o_bits_equal == 1.0

    (problem,) = check_stored_match(open_dump(crafted))
    assert (problem.step, problem.layer) == (0, 0)
    assert problem.what.startswith("attribute replay_match: it says bf16-hw / ieee reproduces 100 % of the stored O, "
                                   "but it reproduces ")
    res = runner.invoke(app, ["verify", str(crafted)])
    assert res.exit_code == 1 and "replay_match" in res.output
    assert check_stored_match(open_dump(PLANTED)) == []  # the bundled dump's own match agrees with its bits

    group = zarr.open_group(str(crafted), mode="r+")["step_000000000/layer_000"]
    group.attrs[match_cache.IN_DUMP_ATTR] = {**dict(group.attrs[match_cache.IN_DUMP_ATTR]), "candidates": "all"}
    (problem,) = check_stored_match(open_dump(crafted))
    assert problem.what.startswith("attribute replay_match: malformed (candidates is not a non-empty list")
