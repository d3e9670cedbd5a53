"""bitdiff tensor mode on the planted sample dump: the planted feature tops the bias map."""
import json
from pathlib import Path

import pytest

from fa_forensics.analyses.bitdiff import compute as bitdiff
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.layers.selection import select
from fa_forensics.commands.bitdiff_tensor import run_tensor_mode

ROOT = Path(__file__).resolve().parents[2]
PLANTED = ROOT / "sample_dumps" / "planted.zarr"
DEMO = ROOT / "sample_dumps" / "demo.zarr"


def test_planted_feature_is_the_most_biased(tmp_path):
    """Over the three planted steps the planted feature is the one biased cell, over all rows and over the tied rows,
    counted in units (rows sharing their dominant key set in a (step, batch row)); one step alone holds too few
    units for a significant claim, yet the claim already points at the planted cell."""
    from fa_forensics.dump import open_dump

    dump = open_dump(PLANTED)
    truth = dump.ground_truth
    head = truth["planted_heads"][0]
    r = bitdiff.run(dump, select(dump, head=head), Recipe("bf16"), Recipe("fp32"))
    assert {(c.layer, c.head, c.feature) for c in r.biased_features} == {(0, head, truth["planted_feature"])}
    top = next(c for c in r.biased_features if c.subset == "all rows")
    assert (top.n, top.n_units) == (1536, 126) and top.tied is not None and top.tied.significant
    assert top.mean == pytest.approx(-0.0013576288086672623, rel=1e-9)
    assert top.se == pytest.approx(0.00022671033338159132, rel=1e-9)
    assert top.t_p_value == pytest.approx(7.164091189512263e-07, rel=1e-6)  # t over the units' effective number
    one = bitdiff.run(dump, select(dump, step=1, head=head), Recipe("bf16"), Recipe("fp32"))
    claim = bitdiff.payload(one)["bias"]
    assert (claim.layer, claim.head, claim.feature, claim.sign) == (0, head, truth["planted_feature"], -1)
    # one step: 2 batch rows × 8 tie groups hold the planted bias, too few units for a claim (the tied rows rank
    # first, their 16 units read against their own few degrees of freedom)
    assert not claim.found and claim.subset == "tied rows" and claim.n_units == 16 and claim.n_rows == 450
    assert one.n_elements == 32768 and one.mismatch_rate == 10450 / 32768
    assert one.ulp_hist["counts"] == [78, 11, 16, 34, 53, 89, 215, 4693, 22318, 4760, 235, 85, 40, 29, 14, 12, 86]
    d = bitdiff.payload(one)
    assert {"mismatch_rate", "ulp_hist", "mean_signed_error", "biased_features"} <= set(d)


def test_dump_vs_bf16_replay_and_cli_outputs(tmp_path):
    out = tmp_path / "bd.json"
    run_tensor_mode(PLANTED, "dump", "bf16", 1, None, 0, "ieee", "emulate", tmp_path, out, False)
    d = json.loads(out.read_text())
    assert (d["a"], d["b"], d["format"], d["steps"]) == ("dump", "bf16", "bf16", [1])
    assert sorted(p.name for p in tmp_path.glob("bitdiff_*.png")) == ["bitdiff_biasmap_dump_vs_bf16.png",
                                                                      "bitdiff_ulp_dump_vs_bf16.png"]
    # the stored O was produced by the same BF16 recipe the emulator replays: every bit equal
    assert d["n_elements"] == 32768 and d["mismatch_rate"] == 0.0
    hist = dict(zip(d["ulp_hist"]["bins"], d["ulp_hist"]["counts"]))
    assert hist == {**dict.fromkeys(hist, 0), "0": 32768}
    # the family of step 1 head 0: its 64 O cells and its one Σδ item, over all rows and tied rows, and fix-check's
    # 6 variants' tests
    assert d["largest"] == [] and not d["bias"]["found"] and d["bias"]["n_tests"] == 136
    assert d["replay_fidelity"]["o_bits_equal"] == 1.0 and d["warnings"] == []
    assert d["verdict"] == ("0.0% of elements differ in bf16 bits; 0 significantly biased features; no feature is "
                            "significantly biased (Holm over 136 tests (1 Σδ (step, layer, head) item and 64 O "
                            "(layer, head, feature) cells, each over all rows and tied rows, 6 fix-check variant "
                            "tests))")


def test_unknown_preset_is_a_one_line_error():
    import typer

    with pytest.raises(typer.Exit) as exc:
        run_tensor_mode(PLANTED, "nope", "fp32", 1, None, 0, "ieee", "emulate", None, None, False)
    assert exc.value.exit_code == 2
