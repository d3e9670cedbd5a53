"""`fa-forensics match` on a dump whose O the paper's reference forward computed (tests/helpers/
paper_reference.py), standard and with its fix (STABLE=1) at T = 1024."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fa_forensics.fidelity.match import candidate_recipes, compare_o
from fa_forensics.cli import app
from fa_forensics.dump.writer import DumpWriter
from fa_forensics.dump import open_dump

from paper_reference import negative_max_inputs, paper_forward

T, D = 1024, 16


def _reference_dump(path: Path, T: int) -> Path:
    """Step 0: layer 0 O from the reference forward, layer 1 O from it with STABLE=1."""
    q, k, v, do = negative_max_inputs(T, D, seed=11, H=1)
    with DumpWriter(path, {"amp_dtype": "bfloat16"}) as w:
        for layer, stable in ((0, False), (1, True)):
            o, _ = paper_forward(q, k, v, stable=stable)
            attrs = {"module": f"ref.layer{layer}.attn", "causal": True, "scale": D ** -0.5}
            for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
                w.write_array(0, layer, name, x, layer_attrs=attrs)
        w.complete_step(0)
    return path


@pytest.fixture(scope="module")
def reference_dump(tmp_path_factory):
    return _reference_dump(tmp_path_factory.mktemp("match") / "reference.zarr", T)


def test_match_finds_the_reference_forward_standard_and_with_its_fix(reference_dump, tmp_path):
    out = tmp_path / "m.json"
    res = CliRunner().invoke(app, ["match", str(reference_dump), "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    standard, stable = d["layers"]
    assert standard["best"] == {"preset": "bf16-autocast-train", "accumulation": "ieee", "o_bits_equal": 1.0,
                                "max_ulp": 0}
    assert len(standard["candidates"]) == 1  # stops at the first 100 %
    assert stable["best"] == {"preset": "bf16-autocast-stabilized", "accumulation": "ieee", "o_bits_equal": 1.0,
                              "max_ulp": 0}
    tried = {(c["preset"], c["accumulation"]): c for c in stable["candidates"]}
    assert tried[("bf16-autocast-train", "ieee")]["o_bits_equal"] < 1.0  # the fix changes O
    assert tried[("bf16-autocast-train", "ieee")]["max_abs_err"] > 0
    assert d["warnings"] == [] and d["compared_in"] == "bfloat16"
    assert "stored O reproduced 100 % in every selected layer-step (2)" in d["verdict"]
    assert "step 0 layer 1: stored O reproduced 100 % by bf16-autocast-stabilized / ieee" in res.output


def test_match_tries_what_the_facts_allow_and_all_tries_every_recipe_saying_which_facts_it_overrode(tmp_path):
    small = _reference_dump(tmp_path / "small.zarr", 128)
    assert open_dump(small).attrs.get("device") == "cpu"  # the writer records the device: a CPU run
    every = {(r.preset, r.accumulation) for r in candidate_recipes(head_dim=D, n_keys=128)}
    kernels = {(p, a) for p, a in every if p.startswith(("sdpa-", "flash-attn-"))}
    other_precision = {(p, a) for p, a in every if p.startswith(("fp8", "fp16", "fp32"))}
    assert kernels and other_precision

    out = tmp_path / "m.json"
    res = CliRunner().invoke(app, ["match", str(small), "--layer", "0", "--json", str(out)])
    assert res.exit_code == 0, res.output
    (layer,) = json.loads(out.read_text())["layers"]
    plain = {(p, a) for p, a in every if p.startswith("eager")}  # no op sequence of torch ops recorded
    # a bf16 CPU run: no GPU kernel, no FP8
    assert layer["recipes_admitted"] == len(every - kernels - other_precision - plain)

    res = CliRunner().invoke(app, ["match", str(small), "--layer", "0", "--all", "--json", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    (layer,) = d["layers"]
    tried = {(c["preset"], c["accumulation"]) for c in layer["candidates"]}
    assert tried == every and not any(c["sampled"] for c in layer["candidates"])  # every recipe, every element
    assert layer["overridden"] == {"device cpu": len(kernels), "precision bf16": len(other_precision),
                                   "no recorded op sequence": len(plain)}
    assert any(n.startswith("--all tried every recipe, also those the recorded facts exclude (device cpu: ")
               for n in d["notes"])
    assert layer["run_precision"] == "bf16"
    shares = {(c["preset"], c["accumulation"]): c["o_bits_equal"] for c in layer["candidates"]}
    assert shares[("bf16-autocast", "ieee")] == 1.0  # same forward as the training recipe
    # fp32 scores and statistics: another kernel
    assert shares[("bf16", "ieee")] < 0.9 and shares[("fp32", "ieee")] < 0.9
    assert all(0 <= s <= 1 for s in shares.values())


def test_compare_o_counts_bits_in_the_stored_dtype():
    stored = torch.tensor([1.0, 2.0, -3.0, 0.5]).to(torch.bfloat16)
    replayed = stored.float().clone()
    replayed[1] = 2.0 + 2.0 ** -6  # one bf16 ulp up
    replayed[3] = 0.5 + 2.0 ** -12  # below half a bf16 ulp: rounds back to the stored bits
    share, max_err, n = compare_o(replayed, stored)
    assert (share, n) == (0.75, 4) and max_err == pytest.approx(2.0 ** -6)


DEMO = Path(__file__).resolve().parents[2] / "sample_dumps" / "demo.zarr"


def test_match_reproduces_every_layer_of_the_demo_dump(tmp_path):
    """The demo trains with the reference code's recipe: its stored O replays bit for bit."""
    out = tmp_path / "m.json"
    res = CliRunner().invoke(app, ["match", str(DEMO), "--json", str(out)])
    assert res.exit_code == 0, res.output
    layers = json.loads(out.read_text())["layers"]
    assert len(layers) == 8  # steps 56-59, layers 1 and 3
    assert all(lm["best"] == {"preset": "bf16-autocast-train", "accumulation": "ieee",
                              "o_bits_equal": 1.0, "max_ulp": 0} for lm in layers)


def test_every_analysis_json_carries_replay_fidelity_and_warns_below_99_percent(make_dump, tmp_path):
    path = make_dump(steps=(0,), seq=64, head_dim=16)  # its O is the bf16 preset's replay
    for preset, expect_warning in (("bf16", False), ("bf16-autocast", True)):
        out = tmp_path / f"{preset}.json"
        res = CliRunner().invoke(app, ["delta-bias", str(path), "--preset", preset, "--json", str(out)])
        assert res.exit_code == 0, res.output
        d = json.loads(out.read_text())
        fid = d["replay_fidelity"]
        assert fid["preset"] == preset and fid["per_layer"][0]["step"] == 0
        assert (fid["o_bits_equal"] == 1.0) is not expect_warning
        lines = [w for w in d["warnings"] if w.startswith("replay fidelity:")]
        assert len(lines) == int(expect_warning)
        assert ("warning: replay fidelity: preset bf16-autocast" in res.output) is expect_warning


def test_shares_near_every_bit_never_overstate():
    """A share below 100 % never reads "100.00 %", and the lower bound the verdict states is cut, not rounded."""
    from fa_forensics.commands.match import _pct

    assert _pct(1.0) == "100 %" and _pct(0.5) == "50.00 %"
    assert _pct(0.999985) == "99.999 %" and _pct(0.999985, floor=True) == "99.998 %"
    assert _pct(1 - 1e-12) != "100.000000 %" and not _pct(1 - 1e-12).startswith("100")
