"""bitdiff tensor mode on the planted sample dump: the planted feature tops the bias map."""
import json
from pathlib import Path

import pytest

from fa_forensics.analyses import bitdiff
from fa_forensics.analyses.recipe import Recipe
from fa_forensics.analyses.selection import select
from fa_forensics.commands.bitdiff_tensor import run_tensor_mode

ROOT = Path(__file__).resolve().parents[2]
PLANTED = ROOT / "sample_dumps" / "planted.zarr"
DEMO = ROOT / "sample_dumps" / "demo.zarr"


def test_planted_feature_is_the_most_biased(tmp_path):
    from fa_forensics.dump import open_dump

    dump = open_dump(PLANTED)
    truth = dump.ground_truth
    head = truth["planted_heads"][0]
    r = bitdiff.run(dump, select(dump, step=1, head=head), Recipe("bf16"), Recipe("fp32"))
    top = r.biased_features[0]
    assert (top.head, top.feature) == (head, truth["planted_feature"])
    assert top.mean < 0 and top.p_value < 1e-6
    assert 0 < r.mismatch_rate < 1 and sum(r.ulp_hist["counts"]) == r.n_elements
    d = bitdiff.payload(r)
    assert {"mismatch_rate", "ulp_hist", "mean_signed_error", "biased_features"} <= set(d)


def test_dump_vs_bf16_replay_and_cli_outputs(tmp_path):
    out = tmp_path / "bd.json"
    run_tensor_mode(PLANTED, "dump", "bf16", 1, None, 0, "ieee", "emulate", tmp_path, out, False)
    d = json.loads(out.read_text())
    assert d["format"] == "bf16" and d["a"] == "dump"
    assert len(list(tmp_path.glob("bitdiff_*.png"))) == 2
    # the stored O was produced by the same BF16 recipe: at most a few ulps apart anywhere
    hist = dict(zip(d["ulp_hist"]["bins"], d["ulp_hist"]["counts"]))
    assert hist["0"] / d["n_elements"] > 0.9


def test_unknown_preset_is_a_one_line_error():
    import typer

    with pytest.raises(typer.Exit) as exc:
        run_tensor_mode(PLANTED, "nope", "fp32", 1, None, 0, "ieee", "emulate", None, None, False)
    assert exc.value.exit_code == 2
