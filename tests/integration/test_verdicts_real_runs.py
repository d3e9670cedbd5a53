"""Verdicts on real training runs: HF GPT-2 (from a config, no download) trained under capture with its
default attention dropout, with bf16 autocast on the CPU, and in fp32; the project's demo model's capture
(sample_dumps/demo.zarr); the demo model trained in fp32 at a learning rate that makes its attention logits grow.
What a user reads must follow what the run recorded, and no command alters a dump."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_hf import capture_training, tiny_gpt2
from typer.testing import CliRunner

import fa_forensics
from fa_forensics.fidelity import match_cache
from fa_forensics.fidelity.match import best_recipe
from fa_forensics.cli import app
from fa_forensics.commands.match import runner_up
from fa_forensics.dump import open_dump
from fa_forensics.report.verdict import report_verdict

T = 16
DEMO = Path(__file__).resolve().parents[2] / "sample_dumps" / "demo.zarr"
AUTO_ANALYSES = ("delta-bias", "isolate", "bitdiff", "fix-check", "pv-trace", "rank1-sim")
runner = CliRunner()


def _capture_gpt2(out: Path, *, attn_pdrop: float, autocast: bool) -> Path:
    """Two real AdamW steps of a 2-layer GPT-2 under capture; step 1 recorded."""
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    return capture_training(tiny_gpt2(T, attn_pdrop=attn_pdrop), out, ids, steps=2, record=[1], autocast=autocast)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    bf16 = _capture_gpt2(root / "bf16.zarr", attn_pdrop=0.0, autocast=True)
    return SimpleNamespace(
        dropout=_capture_gpt2(root / "dropout.zarr", attn_pdrop=0.1, autocast=True),  # HF GPT-2's default dropout
        bf16=bf16, pristine=shutil.copytree(bf16, root / "pristine" / "bf16.zarr"),  # a copy no test analyses
        fp32=_capture_gpt2(root / "fp32.zarr", attn_pdrop=0.0, autocast=False),
    )


def _json(args: list[str], tmp_path: Path, name: str = "out.json") -> tuple[dict, str]:
    out = tmp_path / name
    res = runner.invoke(app, [*args, "--json", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text()), res.output


def test_a_dropout_run_is_analysed_with_its_recorded_recipe_and_fidelity_is_unverifiable(runs, tmp_path):
    m, _ = _json(["match", str(runs.dropout)], tmp_path, "m.json")
    for layer in m["layers"]:
        assert not any(c["preset"].startswith("fp8") for c in layer["candidates"])  # a bf16 run is never an FP8 run
        assert layer["run_precision"] == "bf16" and "attention dropout p=0.1" in layer["unverifiable"]
    assert m["verdict"].startswith("fidelity unverifiable at step 1 layer 0, step 1 layer 1: attention dropout p=0.1")
    assert "the analyses replay bf16-hw / ieee" in m["verdict"] and m["verdict"] in " ".join(m["warnings"])

    for command in ("delta-bias", "pv-trace"):
        d, output = _json([command, str(runs.dropout)], tmp_path, f"{command}.json")
        fid = d["replay_fidelity"]
        assert (fid["preset"], fid["accumulation"]) == ("bf16-hw", "ieee")
        assert fid["o_bits_equal"] is None and fid["verifiable"] is False
        assert [u["layer"] for u in fid["unverifiable"]] == [0, 1]
        line = next(w for w in d["warnings"] if w.startswith("replay fidelity unverifiable at step 1 layer 0"))
        assert "analysed with preset bf16-hw / ieee, the recipe the recorded settings imply" in line
        assert "fp8" not in output
    verdict = report_verdict([SimpleNamespace(name="delta-bias", data=d)])
    assert "replay fidelity unverifiable (attention dropout p=0.1" in verdict

    d, _ = _json(["delta-bias", str(runs.dropout), "--preset", "bf16"], tmp_path, "named.json")
    assert any(w.endswith("analysed with preset bf16 / ieee, as asked") for w in d["warnings"])


def test_mismatches_of_a_bf16_autocast_run_get_a_sign_test(runs, tmp_path):
    d, output = _json(["delta-bias", str(runs.bf16)], tmp_path)
    fid = d["replay_fidelity"]
    assert fid["preset"] == "bf16-hw" and 0.88 <= fid["o_bits_equal"] < 0.99 and fid["run_precision"] == "bf16"
    mm = fid["mismatch"]
    assert mm["n_mismatched"] == round((1 - fid["o_bits_equal"]) * 2 * 2 * 2 * T * 16)  # 2 layers of (2, 2, T, 16)
    assert sum(mm["ulp_histogram"].values()) == mm["n_mismatched"] and 0 <= mm["p_feature"] <= 1
    assert not mm["biased"] and mm["verdict"].startswith("the mismatches are unbiased (p = ")
    line = next(w for w in d["warnings"] if w.startswith("replay fidelity: preset bf16-hw / ieee reproduces"))
    assert line.endswith("bias findings stand") and "describe that recipe" not in line
    assert "the mismatches are unbiased" in report_verdict([SimpleNamespace(name="delta-bias", data=d)])


def test_the_runner_up_of_a_cached_match_is_not_the_best(runs, tmp_path):
    first = best_recipe(open_dump(runs.bf16), 1, 0)
    cached = best_recipe(open_dump(runs.bf16), 1, 0)  # a new Dump: read back from the match cache
    assert cached == first and cached.best is not first.best
    second = runner_up(cached)
    assert (second.preset, second.accumulation) != (cached.best.preset, cached.best.accumulation)
    out = runner.invoke(app, ["match", str(runs.bf16), "--layer", "0"]).output
    row = next(line for line in out.splitlines() if "bf16-hw / ieee" in line and "97." in line)
    assert row.count("bf16-hw / ieee") == 1
    assert "warning: stored O reproduced only 97.56 % by the best known recipe: every analysis tests whether" in out


def test_an_fp32_run_is_called_an_fp32_run(runs, tmp_path):
    d, _ = _json(["delta-bias", str(runs.fp32)], tmp_path)
    assert d["replay_fidelity"]["run_precision"] == "fp32" and d["replay_fidelity"]["preset"] == "bf16"
    assert d["warnings"][-1] == ("trained in fp32: no low-precision rounding to analyse; the findings show what bf16 "
                                 "would do on these inputs")
    verdict = report_verdict([SimpleNamespace(name="delta-bias", data=d)])
    assert verdict.startswith("VERDICT: Nothing wrong found: this run trained in fp32, so its attention has no "
                              "low-precision rounding to go wrong")
    assert verdict.endswith("the findings describe recipe bf16 / ieee replayed on the run's fp32 inputs.")
    d, _ = _json(["delta-bias", str(runs.fp32), "--preset", "fp32"], tmp_path, "named.json")
    assert ("trained in fp32: no low-precision rounding to analyse; preset fp32 replays fp32 on both sides"
            in d["warnings"])
    m, _ = _json(["match", str(runs.fp32)], tmp_path, "m.json")
    assert m["verdict"].startswith("trained in fp32: no low-precision rounding to analyse")
    assert {c["preset"] for layer in m["layers"] for c in layer["candidates"]} == {"fp32"}


def _snapshot(path: Path) -> list:
    """(path, bytes, mode) of the store, its folder's entries beside it included."""
    out = [(str(path.parent), b"", os.lstat(path.parent).st_mode, sorted(p.name for p in path.parent.iterdir()))]
    for p in sorted([path, *path.rglob("*")]):
        out.append((str(p), p.read_bytes() if p.is_file() else b"", os.lstat(p).st_mode, None))
    return out


def _read_only(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), reverse=True):
        p.chmod(0o555 if p.is_dir() else 0o444)
    folder.chmod(0o555)


def _writable(folder: Path) -> None:
    for p in [folder, *folder.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def test_match_and_every_auto_analysis_leave_a_read_only_dump_untouched(runs, tmp_path):
    folder = tmp_path / "evidence"
    folder.mkdir()
    store = folder / "bf16.zarr"
    shutil.copytree(runs.pristine, store)
    _read_only(folder)
    try:
        before = _snapshot(store)
        commands = [["match", str(store)], *([c, str(store)] for c in AUTO_ANALYSES),
                    ["report", str(store), "--out", str(tmp_path / "report")]]
        for args in commands:
            res = runner.invoke(app, args)
            assert res.exit_code in (0, 1), res.output  # fix-check exits 1 when nothing is removed
            assert _snapshot(store) == before, args
    finally:
        _writable(folder)


def test_the_demo_capture_is_answered_by_the_match_it_carries_and_left_untouched(tmp_path):
    folder = tmp_path / "evidence"
    folder.mkdir()
    store = folder / "demo.zarr"
    shutil.copytree(DEMO, store)
    _read_only(folder)
    cache = tmp_path / "cache"
    try:
        before = _snapshot(store)
        d, _ = _json(["match", str(store), "--step", "59", "--match-cache", str(cache)], tmp_path)
        assert all(layer["best"]["preset"] == "bf16-autocast-train" for layer in d["layers"])
        assert not cache.exists()  # every layer-step answered by the fingerprinted in-dump cache
        d, _ = _json(["delta-bias", str(store), "--step", "59", "--layer", "1", "--match-cache", "off"], tmp_path)
        assert d["replay_fidelity"]["o_bits_equal"] == 1.0
        assert match_cache.cache_dir() is not None  # the option held for that command only
        assert _snapshot(store) == before
    finally:
        _writable(folder)


def test_every_warning_on_stderr_is_in_the_json(make_dump, tmp_path):
    path = make_dump(steps=(0,), incomplete=(1,), seq=16, head_dim=8)
    skipped = f"{path}: step(s) 1 are incomplete (cut off while writing) and are skipped"
    commands = [["match"], ["pcast"], *([c] for c in AUTO_ANALYSES), ["report", "--out", str(tmp_path / "report")]]
    for args in commands:
        out = tmp_path / f"{args[0]}.json"
        res = runner.invoke(app, [args[0], str(path), *args[1:], "--json", str(out)])
        assert res.exit_code in (0, 1), res.output
        warnings = json.loads(out.read_text())["warnings"]
        printed = [line.removeprefix("warning: ") for line in res.output.splitlines() if line.startswith("warning: ")]
        assert skipped in warnings and skipped in printed, args[0]
        assert all(line in warnings for line in printed), args[0]


def _train_fp32_logit_growth(out: Path, steps: int = 24) -> Path:
    """The project's demo GPT in fp32 (SDPA attention, no qk-layernorm) memorising one batch with Adam at lr 0.1,
    every step monitored, the alarm on after a 5-step warm-up: its attention logits grow a hundredfold within 20
    steps and its softmax goes one-hot."""
    from fa_forensics.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, attention="sdpa"))
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.9, 0.95))
    data = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(0))
    idx, targets = data[:, :32].contiguous(), data[:, 1:].contiguous()
    with fa_forensics.capture(model, out=out, steps=None, monitor_every=1, alarm={"warmup": 5}, alarm_steps=1,
                              ring=2) as cap:
        for _ in range(steps):
            _, loss = model(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.step(loss)
    return out


def test_an_fp32_run_with_attention_logit_growth_is_diagnosed_so_never_as_rounding(tmp_path):
    """`report --step <first alarm>` on a real fp32 run whose attention logits grew: the card names attention-logit
    growth with qk-layernorm / learning-rate advice, and rounding never (the bf16 replay is not what trained)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the alarm's AlarmWarning
        path = _train_fp32_logit_growth(tmp_path / "fp32.zarr")
    dump = open_dump(path)
    first = int(next(s for s, n in zip(dump.timeline["step"], dump.timeline["alarms"]) if n > 0))
    assert first in dump.steps
    d, output = _json(["report", str(path), "--step", str(first), "--out", str(tmp_path / "r")], tmp_path)
    s = d["summary"]
    assert s["cause"] == "attention-logit-growth" and s["status"] == "unstable", s["answer"]
    assert "biased-rounding" not in s["causes"] and "fp8-p-collapse" not in s["causes"]
    assert s["answer"].startswith("Attention-logit growth in layer ") and "qk-layernorm" in s["answer"]
    assert "lower the learning rate" in s["answer"] and "its attention's rounding is not the cause" in s["answer"]
    assert s["actions"][0]["what"].startswith("Add qk-layernorm")
    assert not any("stable_attention" in a["what"] or "fp32" in a["what"] for a in s["actions"])
    timeline = next(x["json"] for x in d["sections"] if x["name"] == "timeline")
    diagnosis = timeline["diagnosis"]
    assert diagnosis["mechanism"] == "attention-logit-growth" and diagnosis["evidence"]["growth"] > 10
    series = np.asarray(timeline["series"]["max_logit"])[diagnosis["layer"]][diagnosis["head"]]  # (steps,)
    assert series[-1] > 100 * series[0] and diagnosis["step"] < first  # it grew before the alarm
    page = (tmp_path / "r" / "index.html").read_text()
    card = page[page.index("<section class='card"):page.index("</section>")]
    assert "qk-layernorm" in card and "Yes:" not in card and "stable_attention(" not in card
    assert "verdict: Attention-logit growth" in " ".join(output.split())
