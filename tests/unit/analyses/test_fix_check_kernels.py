"""fix-check on the dumps users bring: a real H200 training capture (cuDNN, matched at 100 % by its kernel model;
tests/data/h200_bits/train_capture) runs under every GPU kernel recipe and compares the kernel's model with the fix
as deployed (stable_attention's contract) and with the same contract without the fix; never exit 2."""
import json
from pathlib import Path

import pytest
from h200_capture import write_training_capture
from typer.testing import CliRunner

from fa_forensics.cli import app

BITS = Path(__file__).resolve().parents[2] / "data" / "h200_bits"


@pytest.fixture(scope="module")
def training_capture(tmp_path_factory):
    """The trimmed training capture as a dump, with the run's recorded attributes (device cuda:0, bf16 autocast)."""
    return write_training_capture(tmp_path_factory.mktemp("gpu") / "gpu.zarr")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["auto", "sdpa-flash", "sdpa-efficient"])
def test_fix_check_runs_on_a_kernel_recipe_with_the_fix_as_deployed(training_capture, tmp_path, preset):
    js = tmp_path / "fc.json"
    res = CliRunner().invoke(app, ["fix-check", str(training_capture), "--preset", preset, "--json", str(js)])
    assert res.exit_code in (0, 1), res.output  # a healthy dump: never a refusal
    d = json.loads(js.read_text())
    if preset == "auto":  # match names cuDNN's model, which reproduces the stored O bit for bit
        fid = d["replay_fidelity"]
        assert fid["preset"].startswith("sdpa-cudnn-sm90") and fid["o_bits_equal"] == 1
    names = [d["fixed"]["name"], *(a["name"] for a in d["alternatives"])]
    assert d["fixed"]["name"] == "stable_attention" and "plain_attention" in names and "stabilized" in names
    assert d["deployment"] is not None and not any("not measured" in w for w in d["warnings"])
    assert res.exit_code == (1 if d["outcome"] in ("fails", "remains") else 0)
    assert d["has_bias"] == d["bias"]["found"]
