"""Hostile kept matches: a dump whose stored O was overwritten outside any row sample, or one bit of it flipped,
with its `replay_match` fingerprinted again (the fingerprint has no secret), and match cache entries edited by
someone without the user's key. `match`, `--preset auto` and `verify` show what the stored bits say, never the
kept claim."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.commands.progress import INTERVAL_ENV
from fa_forensics.dump import open_dump
from fa_forensics.fidelity import match_cache
from fa_forensics.fidelity.auto import resolve
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.fidelity.stored_match import check_stored_match
from fa_forensics.layers.selection import LayerSelection, load, select

pytestmark = pytest.mark.slow  # replays planted.zarr's layer-steps in full

PLANTED = Path(__file__).resolve().parents[2] / "sample_dumps" / "planted.zarr"


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={INTERVAL_ENV: "0"})


def _hostile_copy(tmp_path: Path, step: int, spoil) -> tuple[Path, float]:
    """A copy of planted.zarr whose step's stored O is spoiled by `spoil(o)` (in place, a numpy array of the bf16
    bits, stored as uint16) and whose `replay_match` is fingerprinted again to fit; with the share of stored O elements
    the spoiled bits leave equal to the originals (what bf16, the recipe that wrote O, reproduces now)."""
    copy = shutil.copytree(PLANTED, tmp_path / "hostile.zarr")
    group = zarr.open_group(str(copy), mode="r+")[f"step_{step:09d}/layer_000"]
    o = group["o"]
    original = np.asarray(o[...])  # bf16 bits, stored as uint16
    bits = original.copy()
    spoil(bits)
    o[...] = bits
    dump = open_dump(copy)
    t = load(dump, LayerSelection(step, 0, dump.heads(step, 0)))
    kept = dict(group.attrs[match_cache.IN_DUMP_ATTR])
    group.attrs[match_cache.IN_DUMP_ATTR] = {**kept, "fingerprint": match_cache.in_dump_fingerprint(t, None)}
    return copy, float((bits == original).mean())


def _zero_rows(r0: int, r1: int):
    def spoil(bits):
        bits[:, :, r0:r1, :] = 0
    return spoil


def _flip(b: int, h: int, row: int, col: int, bit: int):
    def spoil(bits):
        bits[b, h, row, col] ^= np.uint16(1 << bit)
    return spoil


@pytest.mark.parametrize("step, spoil", [
    pytest.param(0, _zero_rows(0, 224), id="rows outside the last 32 zeroed"),
    pytest.param(0, _zero_rows(0, 128), id="the first half zeroed"),
    pytest.param(1, _zero_rows(40, 41), id="one row in the middle zeroed, another step"),
    pytest.param(2, _flip(1, 3, 7, 11, 0), id="one bit flipped, another step"),
    pytest.param(0, _flip(0, 2, 200, 63, 5), id="one bit flipped, another head"),
])
def test_a_spoiled_o_with_its_match_fingerprinted_again_is_never_shown_as_reproduced(tmp_path, monkeypatch,
                                                                                     step, spoil):
    monkeypatch.setenv(match_cache.ENV_DIR, str(tmp_path / "cache"))
    copy, truth = _hostile_copy(tmp_path, step, spoil)
    assert truth < 1.0

    (problem,) = check_stored_match(open_dump(copy))
    assert (problem.step, problem.layer) == (step, 0)
    said = re.search(r"it says bf16 / ieee reproduces 100 % of the stored O, but it reproduces ([0-9.]+) % "
                     r"\((\d+) of (\d+) elements, every one re-checked\)", problem.what)
    assert said, problem.what
    assert int(said[2]) / int(said[3]) == pytest.approx(truth, abs=2e-3)  # bf16 wrote O: only the spoiled differ

    res = _cli("verify", copy)
    assert res.exit_code == 1 and "replay_match" in res.output and "Traceback" not in res.output

    dump = open_dump(copy)
    with pytest.warns(match_cache.MatchCacheWarning, match="contradicted by the stored bits"):
        choice = resolve(dump, select(dump, step=step), Recipe()).choice_at(step, 0)
    assert choice.o_bits_equal < 1.0

    res = _cli("match", copy, "--step", step, "--match-cache", "off")
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert "reproduced 100 %" not in res.output
    assert "is contradicted by the stored bits" in res.output


def test_the_bundled_dumps_kept_matches_pass_the_full_recheck():
    assert check_stored_match(open_dump(PLANTED)) == []


def _entry(tmp_path: Path) -> tuple[Path, dict]:
    (path,) = (tmp_path / "cache" / "match").glob("*.json")
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("field, value", [
    ("unverifiable", "q, k, v and o read as (B, T, H, D) are reproduced instead"),
    ("n_admitted", 999999),
    ("relaxed", ["window"]),
    ("excluded_winner", {"preset": "bf16-hw", "accumulation": "ieee", "o_bits_equal": 1.0, "facts": ["device cpu"]}),
])
def test_a_steering_field_edited_in_the_cache_steers_nothing(tmp_path, make_dump, monkeypatch, field, value):
    monkeypatch.setenv(match_cache.ENV_DIR, str(tmp_path / "cache"))
    path = make_dump(steps=(0,), seq=96, head_dim=16)  # O written by bf16
    fresh = _cli("match", path)
    assert fresh.exit_code == 0
    entry_path, entry = _entry(tmp_path)
    entry_path.write_text(json.dumps({**entry, field: value}))
    dump = open_dump(path)
    with pytest.warns(match_cache.MatchCacheWarning, match="not sealed with this user's key"):
        choice = resolve(dump, select(dump, step=0), Recipe()).choice_at(0, 0)
    assert (choice.preset, choice.o_bits_equal) == ("bf16", 1.0)
    entry_path.write_text(json.dumps({**entry, field: value}))
    res = _cli("match", path)
    assert res.exit_code == 0 and "not sealed with this user's key" in res.output
    shown = [line for line in res.output.splitlines() if "match cache" not in line]
    assert shown == fresh.output.splitlines()  # what the search shows, nothing of the edit
