"""The statistics policy holds on null dumps (no mechanism: one maximum per row, V signs at random): no analysis's
verdict or exit code raises more false alarms than α = 0.01 allows.

The dumps are fixed (seeds 0..23, two shapes), so the test is deterministic. At a true rate of 1 % a family of 24
gives 0 or 1 alarm with probability 0.98; at the rate the uncorrected fix-check had (20 %), with probability
0.03: a count of at most one per analysis tells the two apart. isolate and rank1-sim quote delta-bias's Σδ items
(`analyses.quantities`), so on a part of the family the test checks that their claims are delta-bias's, and
pcast's. benchmarks/false_alarms.py measures the rates on a large family, with their confidence intervals.
"""
import pytest

from fa_forensics.analyses.calibration import alarms, make_null

SEEDS = range(24)
CHEAP = ("delta-bias", "pv-trace", "bitdiff", "fix-check")
WHOLE = ("isolate", "rank1-sim", "pcast")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("null")
    return [make_null(root / f"null{seed}.zarr", seed) for seed in SEEDS]


@pytest.mark.slow
def test_no_analysis_raises_more_false_alarms_than_alpha_allows(family):
    runs = [alarms(path, CHEAP) for path in family]
    for name in (*CHEAP, "fix-check exit 1", "report"):
        count = sum(r[name] for r in runs)
        assert count <= 1, f"{name}: {count} false alarms in {len(runs)} null dumps"


@pytest.mark.slow
def test_isolate_rank1_and_pcast_claim_nothing_where_delta_bias_claims_nothing(family):
    for path in family[:4]:
        r = alarms(path, ("delta-bias", *WHOLE))
        assert r["isolate"] == r["rank1-sim"] == r["delta-bias"], (path, r)
        assert not r["pcast"], path  # plain heads without sinks: no probability mass lost to the FP8 cast
