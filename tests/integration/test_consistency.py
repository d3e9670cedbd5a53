"""The analyses tell one story: on planted dumps made here (other heads, seeds, sink strengths, ties) the headline
names the planted head and feature and pcast's FP8 finding, and on every dump (the bundled planted and demo dumps,
synth dumps made here: planted, null, and a planted one stored as an fp32 run's) the card (the structured verdict
and the rendered page) and every section agree: a bias named ↔ the sections' found flags, every number the card
quotes ↔ a section that has it, "compounds" ↔ rank1-sim, the first action ↔ isolate's and fix-check's results,
an fp32 run ↔ no rounding cause."""
import html as html_lib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fa_forensics.analyses.contract import FIDELITY_WARN_BELOW, MISMATCH_TEST_ABOVE
from fa_forensics.analyses.significance import ALPHA, EFFECT_FLOOR
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.planted import SynthSpec, synth
from fa_forensics.report.html import render
from fa_forensics.report.run import SECTIONS, SectionResult, run_all
from fa_forensics.report.verdict import build_verdict, claims

ROOT = Path(__file__).resolve().parents[2]
QUANTITY = {"isolate": "delta", "delta-bias": "delta", "bitdiff": "O", "fix-check": "O", "pv-trace": "O"}
PERCENT = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)%")  # "99%", "1.03%" (fidelity's "100.0 %" has a space)


def assert_agrees_with_itself(secs, verdict):
    """No section's claim contradicts the headline; every claim and exit code follows the policy."""
    data = {s.name: s.data for s in secs if s.data is not None}
    found = {q: any(e.found for e in verdict.evidence if e.quantity == q) for q in ("delta", "O")}
    for name, c in claims(secs).items():
        if c["found"]:  # the policy's floor: significant after the family's correction, and large enough
            assert c["adjusted_p"] < ALPHA and (c["effect"] is None or c["effect"] >= EFFECT_FLOOR), (name, c)
        assert c["found"] == found[QUANTITY[name]], (name, c, verdict.line())
    if "delta-bias" in data:  # a head of several steps: its Σδ pooled over them, its sign held; of one step: its item
        db = data["delta-bias"]
        pooled = [x for p in db.get("pooled") or [] for x in (p, p.get("tied")) if x]
        several = {(p["layer"], p["head"]) for p in pooled}
        single = [x for i in db["per_step"] if (i["layer"], i["head"]) not in several for x in (i, i.get("tied")) if x]
        assert (any(x["holds"] for x in pooled) or any(x["significant"] for x in single)) == found["delta"]
    if "isolate" in data:
        assert found["delta"] or data["isolate"]["culprits"] == []
    if "bitdiff" in data:
        assert bool(data["bitdiff"]["biased_features"]) == found["O"]
    if "fix-check" in data:
        fc, code = data["fix-check"], next(s.exit_code for s in secs if s.name == "fix-check")
        assert fc["has_bias"] == found["O"] and code == fc["exit_code"]
        assert code == (1 if fc["outcome"] in ("fails", "remains") else 0)
        assert fc["has_bias"] or fc["outcome"] in ("no-bias", "fails")
        assert fc["verdict"].startswith("NO BIAS TO REMOVE") == (fc["outcome"] == "no-bias")
    if "pv-trace" in data:
        assert data["pv-trace"]["o_bias"]["significant"] == found["O"]
    if "rank1-sim" in data:
        r1 = data["rank1-sim"]
        assert r1["claim"]["found"] == found["delta"]
        assert ("(compounds)" in r1["verdict"] or "(washes out)" in r1["verdict"]) <= found["delta"]
        if found["delta"]:
            assert (r1["focus"]["layer"], r1["focus"]["head"]) == (r1["claim"]["layer"], r1["claim"]["head"])
    fp8 = [(h["layer"], h["head"]) for h in (data.get("pcast") or {}).get("heads", []) if h["needs_fix"]]
    assert [(h["layer"], h["head"]) for h in verdict.fp8_heads] == fp8


SHARE_KEYS = ("share", "reduction", "mass", "frac", "ci")  # the keys of the shares a card may quote as percentages


def _shares(obj, key: str = "") -> list[float]:
    """Every finite number of a JSON value held under a key naming a share or a standard error (a list inherits its
    key)."""
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _shares(v, str(k))]
    if isinstance(obj, list):
        return [x for v in obj for x in _shares(v, key)]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        share = any(w in key for w in SHARE_KEYS) or key == "se" or key.endswith("_se")  # a share or its error
        return [float(obj)] if share else []
    return []


def _card_text(page: str) -> str:
    card = page[page.index("<section class='card"):page.index("</section>")]
    return html_lib.unescape(re.sub(r"<[^>]+>", " ", card))


def _fidelity(data: dict) -> tuple[str, bool]:
    """(the run's recorded precision, the replay reproduces too few of its bits), from the sections' own keys."""
    for d in data.values():
        fid = d.get("replay_fidelity")
        if isinstance(fid, dict) and (fid.get("run_precision") or fid.get("o_bits_equal") is not None):
            share = fid.get("o_bits_equal")
            unbiased = isinstance(fid.get("mismatch"), dict) and not fid["mismatch"].get("biased")
            few = share is not None and share < FIDELITY_WARN_BELOW and not (share >= MISMATCH_TEST_ABOVE and unbiased)
            return str(fid.get("run_precision") or ""), few
    return "", False


def assert_one_story(secs, verdict, page: str) -> None:
    """The card (the structured verdict and the rendered card) and every section tell one story."""
    assert_agrees_with_itself(secs, verdict)
    data = {s.name: s.data for s in secs if s.data is not None}
    card = _card_text(page)
    said = " ".join([card, verdict.line(), *verdict.findings])
    assert verdict.lead in html_lib.unescape(page) and page.index("class='answer'") < page.index("<h2")
    precision, too_few = _fidelity(data)
    # a bias named <-> the sections' found flags (never on an fp32 run, never where the replay misses the kernel)
    bias_found = any(c["found"] for c in claims(secs).values())
    rounding = "biased-rounding" in verdict.causes
    assert rounding == (bias_found and precision != "fp32" and not too_few), (verdict.causes, verdict.answer)
    assert (verdict.status in ("affected", "disagree")) == (verdict.cause == "biased-rounding")
    assert (verdict.status == "healthy") == (verdict.cause == "no-instability")
    if precision == "fp32":
        assert "fp8-p-collapse" not in verdict.causes and "stable_attention" not in card, card
        assert "its attention's rounding is not the cause" in verdict.answer or verdict.cause == "none"
    if too_few and precision != "fp32":
        assert verdict.cause in ("cannot-tell",) + tuple(c for c in verdict.causes if c not in ("biased-rounding",))
    assert ("nothing to fix" in verdict.answer) == (verdict.cause == "none" and not verdict.untested
                                                   and precision != "fp32"), verdict.answer
    assert verdict.answer.startswith("Cannot tell") == (verdict.cause == "cannot-tell")
    # every percentage the card quotes is a number of a section
    numbers = [x for d in data.values() for x in _shares(d)] + [EFFECT_FLOOR, ALPHA]  # and the policy's own
    shares = [v for k, v in ((data.get("pv-trace") or {}).get("class_shares") or {}).items()
              if k in ("tie", "near-tie", "carry") and isinstance(v, dict) and v.get("rows")
              and isinstance(v.get("share"), float) and isinstance(v.get("se"), float)]
    if shares:  # the P̄ = 1 mechanism's share: pv-trace's classes where P̄ = 1 together, and their combined error
        numbers += [sum(v["share"] for v in shares), sum(v["se"] ** 2 for v in shares) ** 0.5]
    for text in PERCENT.findall(card):
        digits = len(text.partition(".")[2])
        assert any(format(x, f".{digits}%") == f"{text}%" for x in numbers), (text, card)
    # fix-check is quoted only where it found a bias to remove
    fc = data.get("fix-check")
    if fc is not None and not fc["has_bias"]:
        assert not any("fix-check" in a.effect or "stable_attention" in a.what for a in verdict.actions), \
            verdict.actions
    # "compounds" <-> rank1-sim
    compounds = "(compounds)" in (data.get("rank1-sim") or {}).get("verdict", "")
    claims_compounding = "compounds" in said.replace("neither compounds nor washes out", "")
    assert claims_compounding == compounds and ("adds up" in said or "step after step" in said) <= compounds, said
    # a quiet monitored timeline: the card says so; with a bias that does not compound, the run is healthy first
    tl = data.get("timeline") or {}
    diag = tl.get("diagnosis") or {}
    quiet = bool(tl.get("steps")) and diag.get("mechanism") == "none" and not tl.get("alarms") \
        and not tl.get("alarm_steps") and not tl.get("rule_alarms") and diag.get("loss_spike_step") is None
    if quiet:
        assert f"no instability over {len(tl['steps'])} monitored steps" in card, card
    assert (verdict.cause == "no-instability") == (quiet and rounding and not compounds), (verdict.cause, quiet)
    if verdict.cause == "no-instability":
        assert verdict.status == "healthy" and verdict.lead.startswith("No instability in this run")
        assert verdict.actions[0].what.startswith("Nothing to act on while the run is healthy")
        assert not any(a.what.startswith(("Replace", "Keep", "Use")) for a in verdict.actions), verdict.actions
        o = next((e for e in verdict.evidence if e.quantity == "O" and e.found), None)
        if o is not None:  # the bias named with its size and where
            assert f"layer {o.layer} head {o.head} feature {o.feature} ({o.effect:.2g} ± " in verdict.lead
    # the first action is what helps, as isolate and fix-check measured it
    if rounding and verdict.cause == "biased-rounding":
        first = verdict.actions[0]
        assert not first.what.startswith(("The stabilized softmax alone", "Capture more", "Do not use")), first
        dep = (fc or {}).get("deployment") or {}
        collapse = ((fc or {}).get("collapse") or {}).get("applies") and ((fc or {}).get("collapse") or {}).get("rows")
        if fc and fc["has_bias"] and not collapse and dep.get("removes") and dep.get("control_removes"):
            assert "fp32" in first.what and "stable_attention" not in first.what, first
        elif fc and fc["has_bias"] and not collapse and dep.get("removes"):
            assert "stable_attention(" in first.what, first
        elif fc and fc["has_bias"] and not collapse and fc["outcome"] == "removed":
            assert "stabilized softmax" in first.what, first
        elif set((data.get("isolate") or {}).get("culprits") or []) & {"pv-fp32", "o-fp32"}:
            assert "fp32" in first.what, first
        shares = PERCENT.findall(first.effect)
        assert shares and float(shares[0]) >= 50, first  # what helps removes most of the bias
    if verdict.cause == "fp8-p-collapse":
        assert verdict.actions[0].what.startswith("If attention runs in FP8")


def _sections_of_report(js: Path) -> list[SectionResult]:
    d = json.loads(js.read_text())
    return [SectionResult(s["name"], [], s["exit_code"], s["ok"], s["note"], s["json"], s["figures"], "", 0.0)
            for s in d["sections"]]


PLANTED = [
    SynthSpec(seq=256, heads=4, head_dim=64, batch=4, steps=3, planted_heads=(2,), sink_strength=8.0, seed=3),
    SynthSpec(seq=256, heads=4, head_dim=64, batch=8, steps=3, planted_heads=(0,), sink_strength=7.0, ties=4, seed=5),
    SynthSpec(seq=256, heads=4, head_dim=64, batch=4, steps=3, planted_heads=(1, 3), sink_strength=8.0, seed=2),
]


@pytest.mark.parametrize("spec", PLANTED, ids=["head2-sink8", "head0-sink7-ties4", "heads1,3-sink8"])
def test_the_headline_names_the_planted_head_and_the_fp8_finding(spec, tmp_path):
    path = tmp_path / "planted.zarr"
    truth = synth(path, spec)
    secs = run_all(open_dump(path), path, tmp_path / "out", sections=SECTIONS)
    assert all(s.ok for s in secs), [(s.name, s.note) for s in secs]
    v = build_verdict(secs)
    page = render(str(path), secs)
    assert_one_story(secs, v, page)
    planted = truth["planted_heads"]
    assert v.status == "affected" and v.where.startswith(f"layer 0 head {planted[0]}"), v.where
    assert all(f"layer 0 head {h}" in v.where for h in planted), v.where
    o = next(e for e in v.evidence if e.quantity == "O")
    delta = next(e for e in v.evidence if e.quantity == "delta")
    assert o.found and o.feature == truth["planted_feature"] and o.sign == -1  # rounded up in magnitude, V < 0
    # dO < 0 in the planted feature: Σδ leans + (one step's units are few, so it need not be significant)
    assert delta.sign == 1 and delta.place == o.place
    assert v.fp8_heads and {h["head"] for h in v.fp8_heads} <= set(truth["sink_heads"])
    assert f"FP8: {len(v.fp8_heads)} of 4 heads need a P-cast fix" in v.line() and "use forward S=256" in v.line()
    assert v.answer.startswith(f"Biased rounding in P̄V at layer 0 head {planted[0]} feature {truth['planted_feature']}")
    assert v.causes == ("biased-rounding", "fp8-p-collapse") and v.where in page


@pytest.mark.parametrize("name", ["planted.zarr", "demo.zarr"])
def test_every_bundled_dump_tells_one_story(name, tmp_path):
    path = ROOT / "sample_dumps" / name
    out, js = tmp_path / "report", tmp_path / "report.json"
    res = CliRunner().invoke(app, ["report", str(path), "--out", str(out), "--json", str(js)])
    assert res.exit_code == 0, res.output
    d = json.loads(js.read_text())
    secs = _sections_of_report(js)
    v = build_verdict(secs)
    page = (out / "index.html").read_text()
    assert_one_story(secs, v, page)
    assert d["verdict"] == v.line() and d["summary"]["status"] == v.status and d["summary"]["cause"] == v.cause
    card = _card_text(page)
    assert "How sure" in card and "What to do" in card
    assert " ".join(res.output.split()).endswith(" ".join(v.line().removeprefix("VERDICT: ").split()))
    if name == "planted.zarr":
        assert v.cause == "biased-rounding" and v.where.startswith("layer 0 head 1")
    if name == "demo.zarr":  # a healthy monitored run: its small O bias is named, not blamed
        assert v.cause == "no-instability" and v.status == "healthy" and "card healthy" in page
        assert v.lead.startswith("No instability in this run: its monitored timeline is quiet over 60 steps")
    for s in d["sections"]:  # no section's sentence contradicts a card that found no bias
        if v.cause in ("none", "cannot-tell"):
            assert "DOES NOT REMOVE" not in (s["json"] or {}).get("verdict", "")


def test_a_null_dump_tells_one_story(dump_builder, tmp_path):
    """Random bf16 attention with its bf16 reference output: nothing is planted, nothing is named."""
    path = dump_builder(tmp_path / "null.zarr", steps=(0, 1, 2), heads=2, seq=64, head_dim=16, batch=2, seed=4)
    secs = run_all(open_dump(path), path, tmp_path / "out", sections=SECTIONS)
    v = build_verdict(secs)
    assert_one_story(secs, v, render(str(path), secs))
    assert v.cause in ("none", "cannot-tell") and not any(c["found"] for c in claims(secs).values())


def _as_fp32_run(planted: Path, out: Path) -> Path:
    """The planted dump's q, k, v, dO, X stored as an fp32 run's (their values are bf16's, so a bf16 replay finds
    the planted bias) with O the fp32 attention: what trained had no low-precision rounding."""
    from fa_forensics.dump import DumpWriter

    src = open_dump(planted)
    writer = DumpWriter(out, {"model": {"name": "test"}, "capture": {"source": "tests"}, "amp_dtype": "float32"})
    for step in src.steps:
        for layer in src.layers():
            t = {n: src.read(step, layer, n).float() for n in ("q", "k", "v", "do", "x")}
            info = src.layer_info(step, layer)
            t["o"] = torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True,
                                                                      scale=info.scale)
            for n in ("q", "k", "v", "o", "do", "x"):
                writer.write_array(step, layer, n, t[n], layer_attrs={"module": info.module or "attn",
                                                                     "causal": True, "scale": info.scale})
        writer.complete_step(step, loss=1.0)
    writer.close()
    return out


def test_an_fp32_run_whose_bf16_replay_is_biased_names_no_rounding_cause(tmp_path):
    planted = tmp_path / "planted.zarr"
    synth(planted, SynthSpec(seq=256, heads=2, head_dim=64, batch=1, steps=2, planted_heads=(1,), seed=7))
    path = _as_fp32_run(planted, tmp_path / "fp32.zarr")
    secs = run_all(open_dump(path), path, tmp_path / "out", sections=SECTIONS)
    v = build_verdict(secs)
    assert_one_story(secs, v, render(str(path), secs))
    assert any(c["found"] for c in claims(secs).values())  # the bf16 replay finds the planted bias ...
    assert v.cause == "none" and v.status == "not affected" and not v.actions  # ... which is not what trained
    assert v.answer.startswith("Nothing wrong found: this run trained in fp32")
    assert "In a bf16 replay (not what trained), biased rounding" in v.line()
