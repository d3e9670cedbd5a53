"""Which layers the plain-ops recipes (eager-reexec, eager) are candidates for, and when `match` names a recipe a
recorded fact excluded: only for a lead beyond noise (McNemar's exact test on the elements one reproduces and
the other does not)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fa_forensics.fidelity.candidates import admit, candidate_recipes
from fa_forensics.fidelity.layer_match import Candidate, ExcludedWinner, LayerMatch, extras_from, to_entry
from fa_forensics.fidelity.run_facts import RunFacts
from fa_forensics.fidelity.search import mcnemar_p

CPU_BF16 = RunFacts("bf16", True, "cpu", 0.0, "standard", "torch_ops")


def _admitted(facts: RunFacts) -> tuple[list[str], dict]:
    adm = admit(candidate_recipes(16, 24, "bfloat16", facts.on_gpu), facts)
    return [r.preset for r in adm.recipes], {r.preset: why for r, why in adm.excluded}


def test_plain_recipes_come_first_for_a_layer_with_recorded_ops():
    names, _ = _admitted(replace(CPU_BF16, plain_ops=True))
    assert names[:2] == ["eager-reexec", "eager"] and "bf16-autocast-cpu" in names


def test_plain_recipes_are_excluded_where_no_op_sequence_was_recorded():
    names, excluded = _admitted(replace(CPU_BF16, plain_ops=False))
    assert "eager-reexec" not in names and excluded["eager"] == ["no recorded op sequence"]
    unknown, why = _admitted(CPU_BF16)  # an import: the sequence is not known, so not replayed
    assert "eager" not in unknown and why["eager-reexec"] == ["no recorded op sequence"]


def test_a_soft_cap_admits_only_the_recipes_that_apply_it():
    names, excluded = _admitted(replace(CPU_BF16, plain_ops=True, softcap=True))
    assert names == ["eager-reexec", "eager"] and "soft-cap" in excluded["bf16-autocast-cpu"]


def test_a_cuda_capture_is_not_reexecuted_on_this_cpu():
    names, excluded = _admitted(replace(CPU_BF16, device="cuda", plain_ops=True))
    assert names[0] == "eager" and excluded["eager-reexec"] == ["device cuda"]


@pytest.mark.parametrize("only_a, only_b, beyond", [(0, 0, False), (5, 3, False), (40, 20, True), (2, 0, False),
                                                    (12, 0, True)])
def test_mcnemar_separates_a_lead_from_noise(only_a, only_b, beyond):
    assert (mcnemar_p(only_a, only_b) < 0.01) is beyond


def test_the_excluded_winners_test_is_kept_in_the_cache_entry():
    best = Candidate("bf16", "ieee", 0.5, 0.01, 100)
    winner = ExcludedWinner("fp16", "ieee", 0.7, ["precision bf16"], 1.2e-5, (30, 10))
    entry = to_entry(LayerMatch(0, 0, [0], best, [best], excluded_winner=winner))
    back = extras_from(json.loads(json.dumps(entry)))["excluded_winner"]
    assert back == winner
