"""The search of `match` for one layer-step: screen the candidates on a row sample, replay every element only
for those that may win, name the best.

In candidate order, each recipe replays the sampled rows (`fidelity.sample`). One that reproduces every
sampled element is confirmed on every element; the first confirmed at 100 % ends the search, as a search that
replayed every candidate on every element would have stopped there (a recipe short of 100 % on the sample is
short of it on the whole). Where none reaches 100 %, the contenders are confirmed: per accumulation model, the
candidate leading on the sample and every one whose per-row shortfall against it is within CONTENDER_Z
standard errors (rows as the units of a paired comparison); `candidates.pick_best` names the best of the
confirmed ones. A layer of a few row blocks, `try_all` and a backend other than the emulator replay every
candidate on every element.

Where the best allowed recipe is short of 100 %, the recipes the recorded facts excluded are screened too;
one that reproduces more is confirmed and named in `LayerMatch.excluded_winner` with the facts that excluded
it. Where the best is far short (below LAYOUT_CHECK_BELOW), the stored arrays are read the other way
round ((B, T, H, D) for (B, H, T, D)); a reading that is reproduced instead means the layout does not fit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

import torch

from fa_forensics.enums import Backend
from fa_forensics.fidelity.candidates import exclusions, pick_best
from fa_forensics.fidelity.layer_match import Candidate, CandidateRecipe, ExcludedWinner, LayerMatch
from fa_forensics.fidelity.plain_facts import config_at
from fa_forensics.fidelity.run_facts import UNKNOWN, RunFacts
from fa_forensics.fidelity.sample import RowSample, compare, equal_bits, replay_rows, row_sample, sampled, stored_o
from fa_forensics.layers.selection import LayerTensors, replay_layer

CONTENDER_Z = 5.0  # a candidate within this many standard errors of the sample's leader is replayed whole
LAYOUT_CHECK_BELOW = 0.5  # below this share the other layout is tried
EXCLUDED_CONFIRMED = 3  # at most this many excluded recipes are replayed whole, the most promising first
# an excluded recipe is named only where McNemar's test puts its lead beyond this p, or where it reproduces every
# element (the best allowed does not)
BEYOND_NOISE_P = 0.01


class _Screen:
    """The sampled rows of one layer-step and what each candidate did on them."""

    def __init__(self, t: LayerTensors, sample: RowSample, backend: Backend):
        self.t, self.sample, self.backend = t, sample, backend
        self.o = stored_o(t)
        self.stored = sampled(self.o, sample)
        self.per_row: dict[tuple[str, str], torch.Tensor] = {}

    def screen(self, recipe: CandidateRecipe) -> Candidate:
        c = compare(replay_rows(self.t, config_at(recipe, self.t), self.sample, self.backend), self.stored)
        self.per_row[(recipe.preset, recipe.accumulation)] = c.equal_per_row
        return Candidate(recipe.preset, recipe.accumulation, c.share, c.max_abs_err, c.n, sampled=not self.sample.whole,
                         sample_equal=c.equal, max_ulp=c.max_ulp)

    def confirm(self, screened: Candidate) -> Candidate:
        """The candidate replayed on every element (itself when the sample is every element)."""
        if not screened.sampled:
            return screened
        recipe = CandidateRecipe(screened.preset, screened.accumulation)
        c = compare(replay_layer(self.t, config_at(recipe, self.t), backward=False, backend=Backend(self.backend)).o,
                    self.o)
        return Candidate(recipe.preset, recipe.accumulation, c.share, c.max_abs_err, c.n, sampled=False,
                         sample_equal=screened.sample_equal, max_ulp=c.max_ulp)

    def within_reach(self, leader: Candidate, other: Candidate) -> bool:
        """`other` may reproduce as much as `leader` on the whole: its per-row shortfall on the sample is within
        CONTENDER_Z standard errors of zero (or it has none)."""
        d = (self.per_row[leader.name] - self.per_row[other.name]).double()
        mean = float(d.mean())
        se = float(d.std()) / math.sqrt(d.numel()) if d.numel() > 1 else 0.0
        return mean <= 0 or mean <= CONTENDER_Z * se


def match_layer(t: LayerTensors, recipes: Sequence[CandidateRecipe], *, try_all: bool = False,
                backend: Backend = Backend.EMULATE, facts: RunFacts = UNKNOWN,
                excluded: Sequence[CandidateRecipe] = (), relaxed: tuple[str, ...] = ()) -> LayerMatch:
    """Search `recipes` (the candidates the recorded facts admit, in order) for the one that reproduces the stored
    O of `t`; `excluded`: the recipes the facts ruled out (checked when no candidate reproduces every element)."""
    stored_o(t)  # a layer-step without O cannot be matched: DumpError
    backend = Backend(backend)
    exhaustive = try_all or backend is not Backend.EMULATE
    sample = RowSample(t.q.shape[2], ((0, t.q.shape[2]),)) if exhaustive else row_sample(t.q.shape[2])
    screen = _Screen(t, sample, backend)
    tried: list[Candidate] = []
    for recipe in recipes:
        c = screen.screen(recipe)
        if c.o_bits_equal == 1.0:
            c = screen.confirm(c)
        tried.append(c)
        if c.o_bits_equal == 1.0 and not c.sampled and not try_all:
            break
    if not any(c.o_bits_equal == 1.0 and not c.sampled for c in tried):
        tried = _confirm_contenders(screen, tried)
    best = pick_best([c for c in tried if not c.sampled], facts)
    lm = LayerMatch(t.step, t.layer, list(t.heads), best, tried, n_admitted=len(recipes), relaxed=relaxed,
                    sample_rows=sample.to_list())
    if backend is not Backend.EMULATE:  # the checks below replay recipes other backends may not run
        return lm
    if best.o_bits_equal < 1.0 and not try_all and excluded:
        lm = replace(lm, excluded_winner=_excluded_winner(screen, best, excluded, facts))
    if best.o_bits_equal < LAYOUT_CHECK_BELOW:
        lm = replace(lm, unverifiable=layout_misfit(t, recipes, best, backend))
    return lm


def screen_only(t: LayerTensors, recipes: Sequence[CandidateRecipe],
                backend: Backend = Backend.EMULATE) -> list[Candidate]:
    """`recipes` screened on the layer's row sample, those that reproduce every sampled element confirmed on every
    element: what completes a kept match with recipes it did not try."""
    screen = _Screen(t, row_sample(t.q.shape[2]), backend)
    out = []
    for recipe in recipes:
        c = screen.screen(recipe)
        out.append(screen.confirm(c) if c.o_bits_equal == 1.0 else c)
    return out


def _confirm_contenders(screen: _Screen, tried: list[Candidate]) -> list[Candidate]:
    """`tried` with every contender of each accumulation model replayed on every element."""
    out = list(tried)
    for acc in {c.accumulation for c in tried}:
        group = [c for c in tried if c.accumulation == acc]
        leader = max(group, key=lambda c: (c.sample_equal, -tried.index(c)))
        for c in group:
            if c.sampled and screen.within_reach(leader, c):
                out[tried.index(c)] = screen.confirm(c)
    return out


def _excluded_winner(screen: _Screen, best: Candidate, excluded: Sequence[CandidateRecipe],
                     facts: RunFacts) -> Optional[ExcludedWinner]:
    """The excluded recipe that reproduces the most of the stored O, where that is more than `best` does: those
    within reach of `best` on the sample are confirmed, the most promising first (EXCLUDED_CONFIRMED of them)."""
    screened = [screen.screen(r) for r in excluded]
    reach = sorted((c for c in screened if screen.within_reach(best, c)), key=lambda c: -(c.sample_equal or 0))
    for c in reach[:EXCLUDED_CONFIRMED]:
        whole = screen.confirm(c)
        if whole.o_bits_equal > best.o_bits_equal:
            only_it, only_best = discordant(screen, whole, best)
            p = mcnemar_p(only_it, only_best)
            if p < BEYOND_NOISE_P or whole.o_bits_equal == 1.0:  # every bit reproduced: exact, not a tally
                return ExcludedWinner(whole.preset, whole.accumulation, whole.o_bits_equal,
                                      exclusions(whole.preset, facts), p, (only_it, only_best))
    return None


def discordant(screen: _Screen, a: Candidate, b: Candidate) -> tuple[int, int]:
    """(stored-O elements a reproduces and b does not, elements b reproduces and a does not), every element."""
    def equal(c: Candidate) -> torch.Tensor:
        config = config_at(CandidateRecipe(c.preset, c.accumulation), screen.t)
        return equal_bits(replay_layer(screen.t, config, backward=False, backend=Backend(screen.backend)).o, screen.o)

    ea, eb = equal(a), equal(b)
    return int((ea & ~eb).sum()), int((eb & ~ea).sum())


def mcnemar_p(only_a: int, only_b: int) -> float:
    """McNemar's exact one-sided p that a reproduces `only_a` elements b does not, against `only_b` the other way,
    by chance (each discordant element equally likely either way): P(X ≥ only_a), X ~ Binomial(n, 1/2)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(only_a, n, 0.5, alternative="greater").pvalue)


def layout_misfit(t: LayerTensors, recipes: Sequence[CandidateRecipe], best: Candidate,
                  backend: Backend = Backend.EMULATE) -> Optional[str]:
    """Why the stored layout does not fit, when q, k, v, o read as (B, T, H, D) are reproduced (at least half of
    a row sample, and twice what the stored reading gets) by one of `recipes`; None otherwise (or when the arrays
    cannot be read the other way: a mask, or keys of another length)."""
    if t.mask is not None or t.o is None or not (t.q.shape == t.k.shape == t.v.shape == t.o.shape) or t.q.shape[1] < 2:
        return None
    swapped = replace(t, q=t.q.transpose(1, 2), k=t.k.transpose(1, 2), v=t.v.transpose(1, 2), o=t.o.transpose(1, 2),
                      heads=list(range(t.q.shape[2])), launch=None)
    screen = _Screen(swapped, row_sample(swapped.q.shape[2]), backend)
    found = max((screen.screen(r) for r in recipes), key=lambda c: c.o_bits_equal)
    if found.o_bits_equal < max(LAYOUT_CHECK_BELOW, 2 * best.o_bits_equal):
        return None
    B, H, T, D = t.q.shape
    return (f"the stored arrays do not fit their layout: stored as (B, H, T, D) = {(B, H, T, D)} they are reproduced "
            f"{100 * best.o_bits_equal:.2f} % at best, read as (B, T, H, D) {100 * found.o_bits_equal:.2f} % of a "
            f"sample of rows by {found.preset} / {found.accumulation}; capture again naming the layout the attention "
            "code uses (layout=BTHD)")
