"""What `match` finds for one layer-step, as data: the candidates tried, the one named, what the recorded facts
excluded, and the form it is kept in (the match cache's entries, read back with every field checked).

A `Candidate` is measured either on every element of the layer-step (`sampled` False) or on its row sample
only (`sampled` True: screened out, `fidelity.sample`); `sample_equal` counts the sample's elements it
reproduces in both cases, which is what a re-check of a kept result replays and compares.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from fa_forensics.enums import Accumulation
from fa_forensics.replay.config import PRESETS, ReplayConfig


@dataclass(frozen=True)
class CandidateRecipe:
    """One candidate: a preset (with its own tiling) under an accumulation model."""

    preset: str
    accumulation: str

    def config(self) -> ReplayConfig:
        return ReplayConfig.preset(self.preset).with_(accumulation=Accumulation(self.accumulation))


@dataclass(frozen=True)
class Candidate:
    """How well one recipe reproduces the stored O of one layer-step."""

    preset: str
    accumulation: str
    o_bits_equal: float  # share of the compared elements reproduced bit for bit, in [0, 1]
    max_abs_err: float  # max |O_replay − O_stored| over the compared finite elements (in fp64)
    n_elements: int  # elements compared: every element, or the row sample's when `sampled`
    sampled: bool = False  # measured on the row sample only
    sample_equal: Optional[int] = None  # elements of the row sample reproduced (None: not measured on it)
    max_ulp: Optional[int] = None  # max |stored − replayed| in ulps of its row's largest |stored| (sample.row_ulps)

    @property
    def name(self) -> tuple[str, str]:
        return self.preset, self.accumulation


@dataclass(frozen=True)
class ExcludedWinner:
    """A recipe the recorded facts excluded that reproduces more of the stored O than the best one allowed."""

    preset: str
    accumulation: str
    o_bits_equal: float  # of every element
    facts: list[str]  # the facts that excluded it ("device cpu")
    # McNemar's exact test on the elements one of the two reproduces and the other does not: the one-sided p that
    # the excluded recipe reproduces more by chance (None: not measured)
    p_value: Optional[float] = None
    discordant: Optional[tuple[int, int]] = None  # (elements only it reproduces, elements only the best does)


@dataclass(frozen=True)
class LayerMatch:
    step: int
    layer: int
    heads: list[int]
    best: Candidate
    candidates: list[Candidate]  # in the order tried
    n_admitted: int = 0  # the recipes the recorded facts admit (what the search may try)
    relaxed: tuple[str, ...] = ()  # recorded facts no recipe models together with the others, set aside
    excluded_winner: Optional[ExcludedWinner] = None
    unverifiable: Optional[str] = None  # why the stored O cannot be compared (the layout does not fit)
    sample_rows: list = field(default_factory=list)  # the row sample's blocks ([[r0, r1], ...])


def to_entry(lm: LayerMatch) -> dict:
    """The match as the cache keeps it (JSON); the best is not kept, it is named again when read."""
    return {"heads": lm.heads, "candidates": [asdict(c) for c in lm.candidates], "n_admitted": lm.n_admitted,
            "relaxed": list(lm.relaxed), "sample_rows": lm.sample_rows, "unverifiable": lm.unverifiable,
            "excluded_winner": None if lm.excluded_winner is None else asdict(lm.excluded_winner)}


class MalformedEntry(ValueError):
    """A kept match whose fields are not what `to_entry` writes; the message names the field."""


def _int(value, what: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise MalformedEntry(f"{what} is {value!r}, not an integer >= {low}")
    return value


def _share(value, what: str) -> float:
    if type(value) not in (int, float) or not 0.0 <= value <= 1.0:  # NaN fails the comparison too
        raise MalformedEntry(f"{what} is {value!r}, not a share in [0, 1]")
    return float(value)


def _preset(value, what: str) -> str:
    if not isinstance(value, str) or value.partition("@")[0] not in PRESETS:
        raise MalformedEntry(f"{what} is {value!r}, not a replay preset")
    try:
        ReplayConfig.preset(value)
    except Exception:  # a tile suffix that names no tiling field
        raise MalformedEntry(f"{what} is {value!r}, not a replay preset") from None
    return value


def _accumulation(value, what: str) -> str:
    if not isinstance(value, str) or value not in {a.value for a in Accumulation}:
        raise MalformedEntry(f"{what} is {value!r}, not an accumulation model")
    return value


def candidate_from(c, where: str, *, full_only: bool = False) -> Candidate:
    """A Candidate from a kept dict, every field checked (MalformedEntry naming the first bad one)."""
    if not isinstance(c, dict):
        raise MalformedEntry(f"{where} is not an object")
    err = c.get("max_abs_err")
    if err is not None and (type(err) not in (int, float) or not (math.isnan(err) or err >= 0)):
        raise MalformedEntry(f"{where}.max_abs_err is {err!r}, not a number >= 0")
    sampled = c.get("sampled", False)
    if type(sampled) is not bool or (full_only and sampled):
        raise MalformedEntry(f"{where}.sampled is {sampled!r}")
    sample_equal = c.get("sample_equal")
    max_ulp = c.get("max_ulp")
    if max_ulp is None and c.get("o_bits_equal") == 1.0:
        max_ulp = 0  # every bit equal: no difference (the in-dump format keeps no max_ulp)
    return Candidate(
        preset=_preset(c.get("preset"), f"{where}.preset"),
        accumulation=_accumulation(c.get("accumulation"), f"{where}.accumulation"),
        o_bits_equal=_share(c.get("o_bits_equal"), f"{where}.o_bits_equal"),
        max_abs_err=math.nan if err is None else float(err),
        n_elements=_int(c.get("n_elements"), f"{where}.n_elements", 1),
        sampled=sampled,
        sample_equal=None if sample_equal is None else _int(sample_equal, f"{where}.sample_equal"),
        max_ulp=None if max_ulp is None else _int(max_ulp, f"{where}.max_ulp"),
    )


def candidates_from(entry, *, full_only: bool = False) -> tuple[list[int], list[Candidate]]:
    """(heads, candidates) of a kept entry, every field checked (MalformedEntry)."""
    if not isinstance(entry, dict):
        raise MalformedEntry("the entry is not an object")
    heads = entry.get("heads")
    if not isinstance(heads, list) or not all(type(h) is int and h >= 0 for h in heads):
        raise MalformedEntry(f"heads is {heads!r}, not a list of head numbers")
    listed = entry.get("candidates")
    if not isinstance(listed, list) or not listed:
        raise MalformedEntry("candidates is not a non-empty list")
    return heads, [candidate_from(c, f"candidates[{i}]", full_only=full_only) for i, c in enumerate(listed)]


def extras_from(entry: dict) -> dict:
    """The LayerMatch fields of a kept entry beyond its candidates, checked (MalformedEntry)."""
    relaxed = entry.get("relaxed", [])
    if not isinstance(relaxed, list) or not all(isinstance(r, str) for r in relaxed):
        raise MalformedEntry(f"relaxed is {relaxed!r}")
    unverifiable = entry.get("unverifiable")
    if unverifiable is not None and not isinstance(unverifiable, str):
        raise MalformedEntry(f"unverifiable is {unverifiable!r}")
    rows = entry.get("sample_rows", [])
    if not isinstance(rows, list) or not all(isinstance(b, list) and len(b) == 2 and all(type(x) is int for x in b)
                                             for b in rows):
        raise MalformedEntry(f"sample_rows is {rows!r}")
    winner = entry.get("excluded_winner")
    if winner is not None:
        if not isinstance(winner, dict) or not isinstance(winner.get("facts"), list) or \
                not all(isinstance(f, str) for f in winner["facts"]):
            raise MalformedEntry(f"excluded_winner is {winner!r}")
        p_value = winner.get("p_value")
        if p_value is not None:
            p_value = _share(p_value, "excluded_winner.p_value")
        discordant = winner.get("discordant")
        if discordant is not None:
            if not isinstance(discordant, list) or len(discordant) != 2:
                raise MalformedEntry(f"excluded_winner.discordant is {discordant!r}")
            discordant = (_int(discordant[0], "excluded_winner.discordant[0]"),
                          _int(discordant[1], "excluded_winner.discordant[1]"))
        winner = ExcludedWinner(_preset(winner.get("preset"), "excluded_winner.preset"),
                                _accumulation(winner.get("accumulation"), "excluded_winner.accumulation"),
                                _share(winner.get("o_bits_equal"), "excluded_winner.o_bits_equal"),
                                list(winner["facts"]), p_value, discordant)
    return {"n_admitted": _int(entry.get("n_admitted", 0), "n_admitted"), "relaxed": tuple(relaxed),
            "unverifiable": unverifiable, "sample_rows": rows, "excluded_winner": winner}
