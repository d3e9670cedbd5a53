"""The statistics policy holds on null dumps, and the false-alarm benchmark counts the claims the report makes.

The null dumps are fixed (seeds 0..23, two shapes: one maximum per row, V signs at random), so the tests are
deterministic. At a true rate of 1 % a family of 24 gives 0 or 1 alarm with probability 0.98; at a rate of 20 %,
with probability 0.03: a count of at most one per claim tells the two apart. isolate and rank1-sim quote
delta-bias's Σδ items (`analyses.quantities`), so on a part of the family the test checks that their claims are
delta-bias's, and pcast's. The card is counted from the report's own diagnosis: on a planted dump it names biased
rounding at the planted head and is counted; on the null dump of the same shape it is not.
benchmarks/false_alarms.py measures the rates on large families, with their confidence intervals.
"""
import pytest

from fa_forensics.analyses.calibration import TIED_NULL_SHAPES, make_null
from fa_forensics.report.calibration import (ANY, CARD, CARD_CANNOT_TELL, DELTA_CLAIM, FIX_EXIT_1, O_CLAIM, alarms,
                                             claims, run_sections)

SEEDS = range(24)
CHEAP = ("delta-bias", "pv-trace", "bitdiff", "fix-check")
WHOLE = ("isolate", "rank1-sim", "pcast")
# the smallest shape of the tied family: a planted head with three tie groups beside a previous-token head
SMALL = ({"seq": 64, "heads": 2, "head_dim": 32, "batch": 4, "steps": 3, "ties": 2, "planted_heads": (0,),
          "previous_token_heads": (1,), "tie_groups": 4},)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("null")
    return [make_null(root / f"null{seed}.zarr", seed) for seed in SEEDS]


@pytest.mark.slow
def test_no_claim_is_made_more_often_than_alpha_allows(family):
    runs = [alarms(path, CHEAP) for path in family]
    for name in (*CHEAP, FIX_EXIT_1, O_CLAIM, DELTA_CLAIM, CARD, ANY):
        count = sum(r[name] for r in runs)
        assert count <= 1, f"{name}: {count} false alarms in {len(runs)} null dumps"


@pytest.mark.slow
def test_isolate_rank1_and_pcast_claim_nothing_where_delta_bias_claims_nothing(family):
    for path in family[:4]:
        r = alarms(path, ("delta-bias", *WHOLE))
        assert r["isolate"] == r["delta-bias"], (path, r)
        assert r["rank1-sim"] <= r["delta-bias"], (path, r)  # "compounds" only of a Σδ claim
        assert not r["pcast"], path  # plain heads without sinks: no probability mass lost to the FP8 cast


@pytest.mark.slow
def test_the_card_is_counted_from_the_reports_diagnosis(tmp_path):
    """On a planted dump the report's diagnosis names biased rounding at the planted head, and the benchmark counts
    the card; on the null dump of the same shape (V signs at random) it names nothing and is not counted."""
    from fa_forensics.dump import open_dump
    from fa_forensics.report.verdict import build_verdict

    seen = {}
    for family, v_skew in (("planted", 1.0), ("null", 0.5)):
        dump = open_dump(make_null(tmp_path / f"{family}.zarr", 0, SMALL, v_skew=v_skew))
        sections = run_sections(dump, ("bitdiff", "delta-bias"))
        verdict = build_verdict(sections)
        seen[family] = (claims(sections, dump.ground_truth), verdict)
    planted, verdict = seen["planted"]
    assert verdict.cause == "biased-rounding" and planted[CARD] and planted[ANY]
    assert f"head {SMALL[0]['planted_heads'][0]}" in verdict.lead
    assert planted[O_CLAIM] == planted["bitdiff"] and planted[DELTA_CLAIM] == planted["delta-bias"]
    null, verdict = seen["null"]
    assert verdict.cause == "none" and not null[CARD] and not null[ANY] and not null[CARD_CANNOT_TELL]


def test_tied_family_has_the_structure_it_promises():
    """T from 64 to 2048, tie groups of random sign, previous-token heads, sinks, several planted heads and batch
    rows; the previous-token heads wide enough (D ≥ 32) for their key before to hold the row maximum."""
    from fa_forensics.analyses.calibration import null_spec

    specs = [null_spec(seed, TIED_NULL_SHAPES) for seed in range(len(TIED_NULL_SHAPES))]
    assert {s.seq for s in specs} >= {64, 2048}
    assert all(s.v_skew == 0.5 and s.ties >= 2 for s in specs)
    assert any(s.previous_token_heads for s in specs) and any(s.sink_strength for s in specs)
    assert any(len(s.planted_heads) > 1 for s in specs) and any(s.batch > 1 for s in specs)
    assert all(s.head_dim >= 32 for s in specs if s.previous_token_heads)
