"""Nothing kept is believed: a match read from the cache or from a dump's attributes is re-checked against the
stored bits before it is used.

`answer` turns a kept entry into the LayerMatch a fresh search would give (every field checked; the best is
named again from the candidates, never read), `recheck` replays the named best on the layer's row sample (the
one the search screens on, a function of its shape: an entry cannot name another) and compares
what it reproduces with what the entry says (the exact count of the sample's equal elements where the entry
kept it, the share it claims otherwise; every candidate where the best is short of 100 %, so that an entry
cannot hide a better recipe). `check_stored_match` runs both on every `replay_match` a dump carries: what
`verify` reports.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from fa_forensics.dump.integrity import Damage
from fa_forensics.enums import Backend
from fa_forensics.errors import DumpError
from fa_forensics.fidelity import match_cache
from fa_forensics.fidelity.candidates import layer_candidates, pick_best
from fa_forensics.fidelity.layer_match import (
    Candidate, CandidateRecipe, LayerMatch, MalformedEntry, candidates_from, extras_from,
)
from fa_forensics.fidelity.run_facts import RunFacts, facts_at
from fa_forensics.fidelity.sample import compare, replay_rows, row_sample, sampled, stored_o
from fa_forensics.layers.selection import LayerSelection, LayerTensors, load

CLAIM_Z = 6.0  # a share claimed for every element may differ from the sample's by this many standard errors


def answer(entry, step: int, layer: int, recipes: Sequence[CandidateRecipe], facts: RunFacts, *,
           in_dump: bool) -> tuple[Optional[LayerMatch], list[CandidateRecipe]]:
    """(the LayerMatch a kept entry holds for `recipes`, the recipes it lacks): `recipes` are the candidates now
    admitted, in order; the best is named by `pick_best` over the candidates measured on every element. An in-dump
    match, made over an older recipe list, answers where one of its candidates reproduces 100 %; the admitted
    recipes before that one it did not try are returned for the caller to search (None where it cannot answer).
    MalformedEntry for fields that are not what `layer_match.to_entry` writes."""
    heads, tried = candidates_from(entry, full_only=in_dump)
    extras = {} if in_dump else extras_from(entry)
    names = [(r.preset, r.accumulation) for r in recipes]
    missing: list[CandidateRecipe] = []
    if in_dump:
        by_name = {c.name: c for c in tried}
        first = next((i for i, n in enumerate(names) if n in by_name and by_name[n].o_bits_equal == 1.0), None)
        if first is None:
            return None, []
        tried = [by_name[n] for n in names[:first + 1] if n in by_name]
        missing = [r for r, n in zip(recipes, names[:first]) if n not in by_name]
    elif any(c.name not in names for c in tried):
        raise MalformedEntry("it names recipes the search does not try")
    measured = [c for c in tried if not c.sampled]
    if not measured:
        raise MalformedEntry("no candidate was measured on every element")
    lm = LayerMatch(step, layer, heads, pick_best(measured, facts), tried, **{"n_admitted": len(recipes), **extras})
    return lm, missing


def _agrees(c: Candidate, got, n_all: int) -> bool:
    """What the sample replay `got` gives agrees with what candidate `c` claims: the sample's count where the
    entry kept it, the element count, and the claimed share (exactly where it was measured on the sample or
    where the sample is every element; every sampled element where it claims every element; within CLAIM_Z
    standard errors of the per-row shares otherwise)."""
    if c.sample_equal is not None and c.sample_equal != got.equal:
        return False
    if c.n_elements != (got.n if c.sampled else n_all):
        return False
    if c.sampled or got.n == n_all:
        return c.o_bits_equal == got.share
    if c.o_bits_equal == 1.0:
        return got.share == 1.0
    rows = got.equal_per_row.double() * (got.equal_per_row.numel() / got.n)  # each row's share
    se = float(rows.std()) / math.sqrt(rows.numel()) if rows.numel() > 1 else 0.0
    return abs(got.share - c.o_bits_equal) <= CLAIM_Z * se + 2.0 / rows.numel()


def recheck(t: LayerTensors, lm: LayerMatch, backend: Backend = Backend.EMULATE) -> Optional[str]:
    """None when the kept match agrees with the stored bits of `t`; else what it claims that they contradict."""
    sample = row_sample(t.q.shape[2])
    if lm.sample_rows and lm.sample_rows != sample.to_list():
        return f"it names the row sample {lm.sample_rows}, not the layer's {sample.to_list()}"
    o = stored_o(t)
    stored = sampled(o, sample)
    checks = [lm.best] + ([c for c in lm.candidates if c.name != lm.best.name] if lm.best.o_bits_equal < 1.0 else [])
    for c in checks:
        got = compare(replay_rows(t, CandidateRecipe(c.preset, c.accumulation).config(), sample, backend), stored)
        if not _agrees(c, got, o.numel()):
            claim = "100 %" if c.o_bits_equal == 1.0 else f"{100 * c.o_bits_equal:.2f} %"
            return (f"it says {c.preset} / {c.accumulation} reproduces {claim} of the stored O, but it reproduces "
                    f"{100 * got.share:.2f} % of a sample of {got.n} elements")
    return None


def check_stored_match(dump, steps: Optional[Sequence[int]] = None) -> list[Damage]:
    """Every `replay_match` attribute of the dump's complete steps (or of `steps`) that is malformed, does not fit the
    stored bytes, or says what the stored bits contradict (re-checked on a row sample), as one Damage each."""
    problems = []
    for step in dump.steps if steps is None else steps:
        for layer in dump.layers(step):
            kept = match_cache.in_dump_attrs(dump, step, layer)
            if not kept:
                continue
            try:
                t = load(dump, LayerSelection(step, layer, dump.heads(step, layer)))
            except DumpError:  # damage: reported as such by `verify`
                continue
            for accumulation, entry in kept.items():
                name = match_cache.in_dump_name(accumulation)
                facts = facts_at(dump, step, layer)
                why = _problem(t, entry, accumulation, facts, layer_candidates(t, facts, accumulation).recipes)
                if why is not None:
                    problems.append(Damage(step, layer, None, f"attribute {name}: {why}"))
    return problems


def _problem(t: LayerTensors, entry, accumulation: Optional[str], facts: RunFacts,
             recipes: Sequence[CandidateRecipe]) -> Optional[str]:
    if t.o is None:
        return "the layer stores no O to match"
    if not match_cache.in_dump_fits(entry, t, accumulation):
        return "its fingerprint does not fit the stored arrays (they changed, or it was written for others); " \
               "match ignores it"
    try:
        lm, _ = answer(entry, t.step, t.layer, recipes, facts, in_dump=True)
    except MalformedEntry as exc:
        return f"malformed ({exc})"
    if lm is None:
        return None
    why = recheck(t, lm)
    return None if why is None else f"{why}; match ignores it"
