"""The analyses tell one story: on planted dumps made here (other heads, seeds, sink strengths, ties) the headline
names the planted head and feature and pcast's FP8 finding, and on every dump, the sample demo included, no
section contradicts the headline and every claim and exit code follows the statistics policy."""
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fa_forensics.analyses.significance import ALPHA, EFFECT_FLOOR
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.planted import SynthSpec, synth
from fa_forensics.report.run import SECTIONS, SectionResult, run_all
from fa_forensics.report.verdict import build_verdict, claims

ROOT = Path(__file__).resolve().parents[2]
QUANTITY = {"isolate": "delta", "delta-bias": "delta", "bitdiff": "O", "fix-check": "O", "pv-trace": "O"}


def assert_agrees_with_itself(secs, verdict):
    """No section's claim contradicts the headline; every claim and exit code follows the policy."""
    data = {s.name: s.data for s in secs if s.data is not None}
    found = {q: any(e.found for e in verdict.evidence if e.quantity == q) for q in ("delta", "O")}
    for name, c in claims(secs).items():
        by_policy = (math.isfinite(c["adjusted_p"] if c["adjusted_p"] is not None else math.nan)
                     and c["adjusted_p"] < ALPHA and (c["effect"] is None or c["effect"] >= EFFECT_FLOOR))
        assert c["found"] == by_policy, (name, c)
        assert c["found"] == found[QUANTITY[name]], (name, c, verdict.line())
    if "delta-bias" in data:
        assert any(i["significant"] for i in data["delta-bias"]["per_step"]) == found["delta"]
    if "isolate" in data:
        assert (data["isolate"]["n_biased_heads"] > 0) == found["delta"]
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
    alarms = bool((data.get("timeline") or {}).get("alarms") or (data.get("timeline") or {}).get("alarm_steps"))
    anything = found["delta"] or found["O"] or fp8 or alarms
    assert ("nothing to fix" in verdict.line()) == (not anything), verdict.line()
    assert verdict.status == ("affected" if found["delta"] or found["O"] else "fp8-only" if fp8 else
                              "alarms-only" if alarms else "not affected")


PLANTED = [
    SynthSpec(seq=256, heads=4, head_dim=64, batch=1, steps=2, planted_heads=(2,), sink_strength=8.0, seed=3),
    SynthSpec(seq=256, heads=4, head_dim=64, batch=1, steps=2, planted_heads=(0,), sink_strength=7.0, ties=4, seed=5),
    SynthSpec(seq=256, heads=4, head_dim=64, batch=1, steps=2, planted_heads=(1, 3), sink_strength=8.0, seed=2),
]


@pytest.mark.parametrize("spec", PLANTED, ids=["head2-sink8", "head0-sink7-ties4", "heads1,3-sink8"])
def test_the_headline_names_the_planted_head_and_the_fp8_finding(spec, tmp_path):
    path = tmp_path / "planted.zarr"
    truth = synth(path, spec)
    secs = run_all(open_dump(path), path, tmp_path / "out", sections=SECTIONS)
    assert all(s.ok for s in secs), [(s.name, s.note) for s in secs]
    v = build_verdict(secs)
    assert_agrees_with_itself(secs, v)
    planted = truth["planted_heads"]
    assert v.status == "affected" and v.where.startswith(f"layer 0 head {planted[0]}"), v.where
    assert all(f"layer 0 head {h}" in v.where for h in planted), v.where
    o = next(e for e in v.evidence if e.quantity == "O")
    delta = next(e for e in v.evidence if e.quantity == "delta")
    assert o.found and o.feature == truth["planted_feature"] and o.sign == -1  # rounded up in magnitude, V < 0
    assert delta.found and delta.sign == 1  # dO < 0 in the planted feature
    assert v.fp8_heads and {h["head"] for h in v.fp8_heads} <= set(truth["sink_heads"])
    assert f"FP8: {len(v.fp8_heads)} of 4 heads need a P-cast fix" in v.line() and "use forward S=256" in v.line()
    page = (tmp_path / "page.html")
    from fa_forensics.report.html import render

    page.write_text(render(str(path), secs))
    text = page.read_text()
    assert text.index("Is this run affected? Yes") < text.index("<h2") and v.where in text


def test_the_demo_dump_page_agrees_with_itself(tmp_path):
    path = ROOT / "sample_dumps" / "demo.zarr"
    out, js = tmp_path / "report", tmp_path / "report.json"
    res = CliRunner().invoke(app, ["report", str(path), "--out", str(out), "--json", str(js)])
    assert res.exit_code == 0, res.output
    d = json.loads(js.read_text())
    secs = [SectionResult(s["name"], [], s["exit_code"], s["ok"], s["note"], s["json"], s["figures"], "", 0.0)
            for s in d["sections"]]
    v = build_verdict(secs)
    assert_agrees_with_itself(secs, v)
    assert d["verdict"] == v.line() and d["summary"]["status"] == v.status
    page = (out / "index.html").read_text()
    card = page[page.index("<section class='card"):page.index("</section>")]
    assert v.answer in card and "How sure" in card and "What to do" in card
    for s in d["sections"]:  # no section's sentence contradicts a card that found no bias
        if v.status in ("not affected", "alarms-only"):
            assert "DOES NOT REMOVE" not in (s["json"] or {}).get("verdict", "")
