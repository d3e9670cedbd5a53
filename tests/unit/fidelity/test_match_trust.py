"""Nothing kept is believed: match cache entries and in-dump `replay_match` attributes that are malformed (NaN,
wrong types), edited (a share, a recipe, a sample count) or left in a folder others can write are warnings, never
errors, and never what `match`, `--preset auto` or `verify` show."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import zarr
from typer.testing import CliRunner

import fa_forensics.fidelity.match as match_mod
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.fidelity import match_cache
from fa_forensics.fidelity.auto import resolve
from fa_forensics.fidelity.match import best_recipe
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
    edit(entry)
    path.write_text(json.dumps(entry))


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


def _one_less_in_the_sample(entry: dict) -> None:
    for c in entry["candidates"]:
        if _bf16(c):
            c["sample_equal"] -= 1


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
    pytest.param(_one_less_in_the_sample, "contradicted by the stored bits", id="an edited sample count"),
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
    real = match_mod.recheck
    monkeypatch.setattr(match_mod, "recheck", lambda *a, **k: checked.append(1) or real(*a, **k))
    assert best_recipe(open_dump(path), 0, 0).best.preset == "bf16"
    assert len(counted) == 1 and checked == [1]


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
