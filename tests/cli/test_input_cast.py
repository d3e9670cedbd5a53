"""An fp32 dump under a bf16 recipe: the input cast is measured apart, never as a kernel bias.

V's feature 3 is 1 + 3·2⁻¹⁰ for every token: bf16 rounds it down to 1 every time, so the cast alone
lowers O[:, 3] by ≈ 2.9e-3 in every row. Scores are random (no repeated maxima): the paper's mechanism has
nothing to bias. Both sides replay the same bf16-rounded inputs, so whatever bias the kernel comparison finds
in that feature is the kernel's own, never the cast's shift (a constant V column does make the bf16 P̄V
rounding lean one way, by about a tenth of a rounding unit: the t-test sees it).
"""
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import DumpWriter

FEATURE = 3
runner = CliRunner()


@pytest.fixture(scope="module")
def fp32_dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32") / "fp32.zarr"
    g = torch.Generator().manual_seed(7)
    B, H, T, D = 1, 2, 128, 16
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(4))  # (B, H, T, D) fp32
    v[..., FEATURE] = 1 + 3 * 2**-10
    alpha = 1 / math.sqrt(D)
    s = (q.bfloat16().float() @ k.bfloat16().float().transpose(-1, -2)) * alpha
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    assert int(((s == s.amax(-1, keepdim=True)).sum(-1) > 1).sum()) == 0  # no repeated maxima
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=alpha)
    w = DumpWriter(path, {"model": {"name": "fp32 test"}, "capture": {}, "amp_dtype": "float32"})
    for name, x in {"q": q, "k": k, "v": v, "o": o, "do": do}.items():
        w.write_array(0, 0, name, x, layer_attrs={"module": "attn", "causal": True, "scale": alpha})
    w.complete_step(0, loss=1.0)
    w.close()
    return path


def test_bitdiff_reports_the_input_cast_apart_and_no_kernel_bias(fp32_dump, tmp_path):
    res = runner.invoke(app, ["bitdiff", str(fp32_dump), "--a", "bf16", "--b", "fp32", "--json",
                              str(tmp_path / "b.json")])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "b.json").read_text())
    for c in d["biased_features"]:  # what the kernel comparison finds is not the cast's −2.9e-3
        assert abs(c["mean"] - (-3 * 2**-10)) > 10 * c["se"] and c["effect"] < 0.2, c
    cast = d["input_cast"]
    assert cast is not None and cast["n_biased_features"] >= 2  # the cast's own bias, in both heads
    hits = [c for c in cast["biased_features"] if c["feature"] == FEATURE]
    assert len(hits) == 2 and all(c["mean"] == pytest.approx(-3 * 2**-10, rel=0.05) for c in hits)
    assert any("finer than the recipe's bf16 inputs" in w for w in d["warnings"])
    assert "input cast alone" in d["verdict"] and "input-cast" in res.output


def test_fix_check_measures_the_kernel_not_the_cast(fp32_dump, tmp_path):
    res = runner.invoke(app, ["fix-check", str(fp32_dump), "--json", str(tmp_path / "f.json")])
    d = json.loads((tmp_path / "f.json").read_text())
    base = d["baseline"]
    assert abs(base["o_bias"] - (-3 * 2**-10)) > 10 * base["o_bias_se"]  # not the cast's shift
    # the constant-V lean is not the tie mechanism, so the stabilized softmax leaves it: a significant remaining
    # bias, exit code 1, said as such
    assert d["target"]["feature"] == FEATURE and d["has_bias"] and d["outcome"] == "remains"
    assert res.exit_code == 1 and d["verdict"].startswith("FIX DOES NOT REMOVE THE BIAS"), res.output


def test_preset_auto_calls_an_fp32_dump_an_fp32_run(fp32_dump, tmp_path):
    """An fp32 run has no low-precision rounding of its own: auto replays what bf16 would do on its inputs, says
    so first, and measures no fidelity against the fp32 stored O (it is not the recipe replayed)."""
    res = runner.invoke(app, ["delta-bias", str(fp32_dump), "--json", str(tmp_path / "d.json")])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "d.json").read_text())
    fid = d["replay_fidelity"]
    assert (d["preset"], fid["preset"], fid["requested"], fid["run_precision"]) == ("auto", "bf16", "auto", "fp32")
    assert fid["o_bits_equal"] is None and not fid["verifiable"]
    assert any(w.startswith("trained in fp32: no low-precision rounding to analyse") for w in d["warnings"])
    assert not any(w.startswith("replay fidelity") for w in d["warnings"])


@pytest.mark.slow  # about 3 s of CPU or more
def test_isolate_keeps_the_input_cast_out_of_the_kernel_verdict(fp32_dump, tmp_path):
    res = runner.invoke(app, ["isolate", str(fp32_dump), "--preset", "bf16", "--json", str(tmp_path / "i.json")])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "i.json").read_text())
    base = d["variants"][0]
    cast = d["input_cast"]
    # feature 3 rounded down in every row
    assert cast["name"] == "input-cast" and cast["o_bias"] < -5 * cast["o_bias_se"]
    assert abs(base["o_bias"]) < 3 * base["o_bias_se"]  # the kernel on identical inputs: no O bias
    assert d["n_biased_heads"] == 0 and d["culprits"] == [] and "input-cast" in res.output
