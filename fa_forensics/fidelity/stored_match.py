"""Nothing kept is believed: a match read from the cache or from a dump's attributes is re-checked against the
stored bits before it is used or shown.

`answer` turns a kept entry into the LayerMatch a fresh search would give: every field checked, at most one
candidate per recipe (MAX_KEPT_CANDIDATES in all), the best named again from the candidates, the count of
admitted recipes taken from the search, not the entry. `rechecked` replays the named best on every element of
the layer-step (one replay) and compares what the entry claims for it (the share of every element, the element
count, the heads): one flipped bit of the stored O, or rows of it overwritten, contradict a claim of 100 %. The
best's other numbers shown (the largest difference in value and in ulps, the count on the row sample) are the
replay's, never the entry's.

What else an entry says (the runner-ups' shares, an excluded recipe that reproduces more, the facts set aside,
why the layout does not fit) is believed only from the match cache, whose entries carry an HMAC under the
user's key (`fidelity.cache_auth`). A dump's `replay_match` has no key: only the recipe it names as reproducing
every element is taken from it (and re-checked); the admitted recipes before that one are screened again
(`match._with_missing`). `check_stored_match` runs both on every `replay_match` a dump carries: what `verify`
reports.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
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
from fa_forensics.fidelity.sample import compare, row_sample, sampled, stored_o
from fa_forensics.layers.selection import LayerSelection, LayerTensors, load, replay_layer

MAX_KEPT_CANDIDATES = 256  # a kept entry listing more is refused before any is read (the catalogue holds fewer)


def _bounded(entry, limit: int) -> None:
    """MalformedEntry when `entry` lists more candidates than `limit` (the recipes it may name) or MAX_KEPT_CANDIDATES,
    checked before any candidate is read."""
    listed = entry.get("candidates") if isinstance(entry, dict) else None
    if isinstance(listed, list) and len(listed) > min(limit, MAX_KEPT_CANDIDATES):
        raise MalformedEntry(f"candidates lists {len(listed)} recipes, more than the "
                             f"{min(limit, MAX_KEPT_CANDIDATES)} it may name")


def _unique(tried: Sequence[Candidate]) -> None:
    seen = set()
    for c in tried:
        if c.name in seen:
            raise MalformedEntry(f"candidates names {c.preset} / {c.accumulation} twice")
        seen.add(c.name)


def answer(entry, step: int, layer: int, recipes: Sequence[CandidateRecipe], facts: RunFacts, *,
           in_dump: bool) -> tuple[Optional[LayerMatch], list[CandidateRecipe]]:
    """(the LayerMatch a kept entry holds for `recipes`, the recipes it lacks): `recipes` are the candidates now
    admitted, in order; the best is named by `pick_best` over the candidates measured on every element. An in-dump
    match (no key vouches for it) answers only where it names a recipe reproducing 100 %: that one alone is taken,
    and the admitted recipes before it are returned for the caller to screen (None where it cannot answer).
    MalformedEntry for fields that are not what `layer_match.to_entry` writes, more candidates than recipes, or a
    recipe named twice."""
    _bounded(entry, len(match_cache.IN_DUMP_RECIPES) if in_dump else len(recipes))
    heads, tried = candidates_from(entry, full_only=in_dump)
    _unique(tried)
    extras = {} if in_dump else extras_from(entry)
    names = [(r.preset, r.accumulation) for r in recipes]
    missing: list[CandidateRecipe] = []
    if in_dump:
        by_name = {c.name: c for c in tried}
        first = next((i for i, n in enumerate(names) if n in by_name and by_name[n].o_bits_equal == 1.0), None)
        if first is None:
            return None, []
        tried = [by_name[names[first]]]
        missing = list(recipes[:first])
    elif any(c.name not in names for c in tried):
        raise MalformedEntry("it names recipes the search does not try")
    measured = [c for c in tried if not c.sampled]
    if not measured:
        raise MalformedEntry("no candidate was measured on every element")
    lm = LayerMatch(step, layer, heads, pick_best(measured, facts), tried, **{**extras, "n_admitted": len(recipes)})
    return lm, missing


def _contradiction(c: Candidate, got) -> Optional[str]:
    """What candidate `c` claims that the replay of every element (`got`) contradicts, or None."""
    claim = "100 %" if c.o_bits_equal == 1.0 else f"{100 * c.o_bits_equal:.4f} %"
    recipe = f"{c.preset} / {c.accumulation}"
    if c.n_elements != got.n:
        return f"it says {recipe} was compared on {c.n_elements} elements, but the layer-step holds {got.n}"
    if c.o_bits_equal != got.share:
        return (f"it says {recipe} reproduces {claim} of the stored O, but it reproduces {100 * got.share:.4f} % "
                f"({got.equal} of {got.n} elements, every one re-checked)")
    return None


def rechecked(t: LayerTensors, lm: LayerMatch,
              backend: Backend = Backend.EMULATE) -> tuple[LayerMatch, Optional[str]]:
    """(the kept match with its best's numbers as one replay of every element of `t` measures them, None) when
    the share and element count it claims for the best agree with that replay; else (`lm`, what it claims that
    the stored bits contradict)."""
    if list(lm.heads) != list(t.heads):
        return lm, f"it names the heads {lm.heads}, not the layer-step's {list(t.heads)}"
    sample = row_sample(t.q.shape[2])
    if lm.sample_rows and lm.sample_rows != sample.to_list():
        return lm, f"it names the row sample {lm.sample_rows}, not the layer's {sample.to_list()}"
    o = stored_o(t)
    best = lm.best
    replayed = replay_layer(t, CandidateRecipe(best.preset, best.accumulation).config(), backward=False,
                            backend=Backend(backend)).o
    got = compare(replayed, o)
    sample_equal = got.equal if sample.whole else compare(sampled(replayed, sample), sampled(o, sample)).equal
    why = _contradiction(best, got)
    if why is not None:
        return lm, why
    measured = replace(best, max_abs_err=got.max_abs_err, max_ulp=got.max_ulp, sample_equal=sample_equal)
    candidates = [measured if c.name == best.name else c for c in lm.candidates]
    return replace(lm, best=measured, candidates=candidates), None


def recheck(t: LayerTensors, lm: LayerMatch, backend: Backend = Backend.EMULATE) -> Optional[str]:
    """None when the kept match's best agrees with every element of the stored bits of `t`; else what it claims
    that they contradict (`rechecked`)."""
    return rechecked(t, lm, backend)[1]


def check_stored_match(dump, steps: Optional[Sequence[int]] = None) -> list[Damage]:
    """Every `replay_match` attribute of the dump's complete steps (or of `steps`) that is malformed, does not fit the
    stored bytes, or says what the stored bits contradict (its best re-checked on every element), as one Damage
    each."""
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
