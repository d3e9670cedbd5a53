"""report: the summary card, the one-line verdict, the sections' sentences and numbers read the commands' JSON keys
(payloads built here: a timeline with alarms or an instability, an FP8-only finding, claims that disagree, keys
missing, an fp32 run, a replay that reproduces too few bits)."""
import html
import re

from fa_forensics.report.html import findings, render
from fa_forensics.report.run import SectionResult
from fa_forensics.report.verdict import build_verdict, report_verdict

RAW = re.compile(r"\bNone\b|\bnan\b|n/a%")


def _sec(name, data, figures=(), note="", exit_code=None):
    code = exit_code if exit_code is not None else (0 if data is not None else 2)
    return SectionResult(name=name, args=[name, "d.zarr"], exit_code=code, ok=data is not None, note=note,
                         data=data, figures=list(figures), text="table", seconds=1.0)


def _claim(quantity, found, layer, head, *, step=None, feature=None, sign=1, p=1e-9, adjusted=1e-7, effect=0.2):
    return {"found": found, "quantity": quantity, "layer": layer, "head": head, "sign": sign, "p_value": p,
            "n_tests": 280, "step": step, "feature": feature, "adjusted_p": adjusted, "effect": effect,
            "value": sign * 2.5 if quantity == "delta" else sign * 1.4e-3, "se": 0.3 if quantity == "delta" else 7e-5,
            "family": "Holm over 280 tests"}


def _planted_like(delta_found=True, o_found=True):
    """Payloads as the analyses write them for a bias at layer 0 head 1 feature 44 over steps 0-2."""
    delta = _claim("delta", delta_found, 0, 1, step=0, adjusted=1e-7 if delta_found else 0.4)
    o = _claim("O", o_found, 0, 1, feature=44, sign=-1, adjusted=1e-40 if o_found else 0.3)
    items = [{"step": s, "layer": 0, "head": 1, "significant": delta_found} for s in (0, 1, 2)]
    fidelity = {"preset": "bf16", "accumulation": "ieee", "o_bits_equal": 1.0, "unverifiable": [], "mismatch": None}
    fc = {"bias": o, "has_bias": o_found, "removed": True, "exit_code": 0, "beta": 2.0, "eps": 1e-3,
          "outcome": "removed" if o_found else "no-bias",
          "target": {"layer": 0, "head": 1, "feature": 44},
          "baseline": {"name": "baseline", "o_bias": -1.4e-3},
          "fixed": {"name": "stabilized", "o_bias": -7e-6, "removed_share": 0.99},
          "alternatives": [{"name": "stable_attention", "o_bias": -8e-6, "removed_share": 0.98}],
          "deployment": {"removes": True, "removed_share": 0.98, "control_removes": False},
          "bias_reduction": 190.0, "verdict": "FIX REMOVES THE BIAS at layer 0 head 1 feature 44",
          "replay_fidelity": fidelity}
    return [
        _sec("isolate", {"bias": delta, "culprits": ["pv-fp32", "stabilized"], "heads": items,
                         "variants": [{"name": "pv-fp32", "reduction": 0.97}], "replay_fidelity": fidelity}),
        _sec("delta-bias", {"bias": delta, "per_step": items, "replay_fidelity": fidelity}),
        _sec("bitdiff", {"bias": o, "mismatch_rate": 0.36, "replay_fidelity": fidelity,
                         "biased_features": [{"layer": 0, "head": 1, "feature": 44, "mean": -1.4e-3, "se": 7e-5}]}),
        _sec("fix-check", fc),
        _sec("pv-trace", {"bias": o, "step": 1, "layer": 0, "head": 1, "row": 58, "feature": 44, "final_error": -7.8e-3,
                          "frac_error_from_p_one": 1.0, "p_one_positions": [43, 57], "o_bias": {"significant": o_found},
                          "class_shares": {"tie": {"share": 1.0, "se": 0.02, "rows": 700}},
                          "replay_fidelity": fidelity}, ["pv-trace/a.png"]),
    ]


def test_the_card_comes_first_and_names_what_where_and_what_to_do():
    secs = _planted_like()
    page = render("d.zarr", secs)
    v = build_verdict(secs)
    assert v.status == "affected" and v.where == "layer 0 head 1, steps 0, 1, 2, feature 44"
    assert v.answer.startswith("Biased rounding in P̄V at layer 0 head 1 feature 44: the low-precision attention "
                               "output comes out too low on average") and v.cause == "biased-rounding"
    assert "What to do: replace the attention by fa_forensics.stable_attention(q, k, v, beta=2, eps=0.001)" in v.answer
    assert page.index(v.answer.split(":")[0]) < page.index("<h2")  # the card before any section
    assert v.lead == ("Biased rounding in P̄V at layer 0 head 1 feature 44. What to do: replace the attention by "
                      "fa_forensics.stable_attention(q, k, v, beta=2, eps=0.001).")
    assert f"<p class='answer'>{html.escape(v.lead)}</p>" in page and html.escape(v.because) in page
    assert v.because.startswith("Evidence: the low-precision attention output comes out too low on average (O −")
    assert page.index("fa_forensics.stable_attention(q, k, v, beta=2, eps=0.001)") < page.index("<h2")
    assert "removes 98% of the bias" in page and "Keep the P̄V product and its accumulator in fp32" in page
    assert "<details><summary>The technical verdict</summary>" in page and "<a href='#glossary'>" in page
    assert "id='glossary'" in page and "id='g-p-bar'" in page and "<img src='pv-trace/a.png'" in page
    # the card and the one-line verdict render one object
    line = report_verdict(secs)
    assert line == v.line() and v.where in line and v.where in page
    assert "found by isolate, delta-bias, bitdiff, fix-check, pv-trace" in line
    assert "0: the fix removes the bias" in page


def test_an_fp8_finding_reaches_the_headline_without_a_rounding_bias():
    secs = _planted_like(delta_found=False, o_found=False)
    pcast = {"heads": [{"step": 2, "layer": 0, "head": h, "needs_fix": h != 1, "recommended_S": 256.0,
                        "recommended_order": "forward",
                        "settings": [{"S": 1.0, "order": "forward", "mass_zeroed": 0.0103, "frac_zeroed": 0.96}]}
                       for h in range(4)]}
    v = build_verdict([*secs, _sec("pcast", pcast)])
    assert v.status == "fp8-only" and "nothing to fix" not in v.line()
    assert "FP8: 3 of 4 heads need a P-cast fix" in v.line() and "use forward S=256" in v.line()
    assert any("scale P by S before its E4M3 cast (forward S=256)" in a.what for a in v.actions)
    page = render("d.zarr", [*secs, _sec("pcast", pcast)])
    assert v.answer.startswith("FP8 P-collapse in 3 of 4 heads (layer 0 head 0, layer 0 head 2, layer 0 head 3)")
    assert "Nothing: no analysis found" not in page


def test_timeline_alarms_lead_the_card_and_the_verdict():
    timeline = {"alarms": [{"step": 120, "metric": "max_logit", "layer": 1, "head": 2, "value": 41.5,
                            "rule": "robust z > 6"}, {"step": 121, "metric": "near_max_ties", "layer": 1, "head": 2,
                                                      "value": 9.0, "rule": "robust z > 6"}],
                "alarm_steps": [120, 121], "steps": list(range(200))}
    secs = [*_planted_like(delta_found=False, o_found=False), _sec("timeline", timeline)]
    v = build_verdict(secs)
    assert v.status == "cannot tell" and v.findings[0].startswith("The training monitor raised 2 alarms at steps 120, "
                                                                   "121 (first: max_logit at layer 1 head 2 = 41.5")
    assert v.line().startswith("VERDICT: Cannot tell: the monitor raised 2 alarms (steps 120, 121), but neither the "
                               "timeline nor the captured steps show a mechanism") and "nothing to fix" not in v.line()
    assert v.actions == ()  # the steps are in the dump: nothing asks to capture them
    # a payload with alarm steps only, on a dump that holds only the timeline: capture the flagged steps
    old = build_verdict([_sec("timeline", {"alarm_steps": [7]}), _sec("isolate", None, note="no step")])
    assert old.line().startswith("VERDICT: Cannot tell: the monitor raised 1 alarm (step 7)")
    assert old.actions[0].what == "Capture the steps the monitor flagged (7) in full"


def test_an_o_bias_that_does_not_reach_the_gradient_is_a_finding_with_its_reason():
    secs = _planted_like(delta_found=False, o_found=True)
    v = build_verdict(secs)
    assert v.status == "affected" and "nothing to fix" not in v.line()
    assert any("does not make Σδ significant" in d and "whether dO adds it up into the W_Q gradient is not shown" in d
               for d in v.disagreements)
    assert v.answer.startswith("Biased rounding in P̄V at layer 0 head 1 feature 44: the low-precision attention "
                               "output comes out too low") and "W_Q gradient" not in v.answer


def test_analyses_of_one_quantity_that_disagree_are_named():
    secs = _planted_like()
    secs[2] = _sec("bitdiff", {"bias": _claim("O", False, 0, 2, feature=3, adjusted=0.5)})
    v = build_verdict(secs)
    assert v.status == "disagree"
    assert any(d.startswith("the analyses of the O bias disagree: fix-check, pv-trace find one at layer 0 head 1 "
                            "feature 44; bitdiff do not find one at layer 0 head 2 feature 3") for d in v.disagreements)


def test_missing_keys_never_raise_nor_show_raw_values():
    names = ("isolate", "delta-bias", "rank1-sim", "pv-trace", "bitdiff", "fix-check", "pcast")
    secs = [_sec(n, {}) for n in names]
    f = findings(secs)
    assert len(f) == 7 and all(isinstance(x, str) for x in f)
    page = render("d.zarr", secs)
    body = page[page.index("<body>"):]
    assert not RAW.search(body), RAW.search(body)
    assert build_verdict(secs).status == "not affected" and build_verdict([]).status == "no result"


def test_the_glossary_gives_the_e4m3_thresholds_the_cast_has():
    """S = 1 zeroes P̄ at or below 2⁻¹⁰ (half of E4M3's smallest value 2⁻⁹, a tie to even), S = 256 those at or
    below 2⁻¹⁸: the glossary's numbers are the cast's."""
    import torch

    from fa_forensics.numerics import round_to
    from fa_forensics.report.html import GLOSSARY

    meaning = next(m for anchor, _, m in GLOSSARY if anchor == "fp8-s")
    smallest, up = torch.tensor([2.0 ** -9]), 1 + 2.0 ** -20
    assert float(round_to(smallest, "fp8_e4m3")) == 2.0 ** -9 and "smallest value is 2⁻⁹" in meaning
    for s, exponent in ((1.0, 10), (256.0, 18)):
        at, above = torch.tensor([2.0 ** -exponent]), torch.tensor([2.0 ** -exponent * up])
        assert float(round_to(at * s, "fp8_e4m3")) == 0 and float(round_to(above * s, "fp8_e4m3")) > 0
        assert f"at or below 2⁻{''.join('⁰¹²³⁴⁵⁶⁷⁸⁹'[int(d)] for d in str(exponent))}" in meaning


def test_analyses_that_could_not_run_qualify_a_clean_verdict():
    """A dump without dO (a GPU capture of the forward): the Σδ analyses cannot run, so the page says no bias was
    found in what was tested and names what was not, never a bare 'nothing to fix'."""
    secs = [s for s in _planted_like(delta_found=False, o_found=False) if s.name not in ("isolate", "delta-bias")]
    note = "step 10 layer 3: the dump has no 'do' array; isolate needs dO to compute δ"
    secs = [_sec("isolate", None, note=note), _sec("delta-bias", None, note=note), _sec("rank1-sim", None, note=note),
            *secs]
    v = build_verdict(secs)
    assert v.status == "not affected" and v.untested == ("isolate", "delta-bias", "rank1-sim")
    assert v.answer.startswith("Nothing wrong found in what could be tested: no significant biased rounding; isolate, "
                               "delta-bias and rank1-sim could not run on this dump")
    assert "nothing to fix in what was tested (isolate, delta-bias and rank1-sim could not run)" in v.line()
    assert any(c.startswith("Not tested: isolate, delta-bias and rank1-sim") for c in v.confidence)
    page = render("d.zarr", secs)
    assert "Nothing for what was tested" in page and "Nothing: no analysis found" not in page
    clean = build_verdict(_planted_like(delta_found=False, o_found=False))  # every analysis ran: the plain answer
    assert clean.answer == ("Nothing wrong found: no significant biased rounding, no FP8 P-collapse: nothing to fix."
                            ) and not clean.untested and clean.cause == "none"


def test_a_share_above_100_percent_says_it_is_signed():
    """Only a share beyond 100 % (or below 0) by more than its noise says the other rows push the other way."""
    secs = _planted_like()
    pv = secs[-1].data
    pv["class_shares"] = {"tie": {"share": 1.15, "se": 0.02, "rows": 700}, "carry": {"share": -0.02, "se": 0.01,
                                                                                    "rows": 90}}
    line = build_verdict(secs).line()
    assert "carries 113% ± 2% of the O bias in that feature (a signed share: the other rows' rounding pushes" in line
    pv["class_shares"] = {"tie": {"share": 1.03, "se": 0.02, "rows": 700}}
    assert "signed share" not in build_verdict(secs).line()
    pv["class_shares"] = {"tie": {"share": 0.97, "se": 0.02, "rows": 700}}
    assert "signed share" not in build_verdict(secs).line()


def test_when_the_kernels_without_the_fix_remove_the_bias_the_card_says_fp32_pv_not_the_fix():
    """fix-check: the stabilized softmax alone removes 1 % in the dump's kernel, stable_attention 80 % and its kernels
    without the fix 81 %: what helps is their fp32 P̄V accumulator, and the first action says so."""
    secs = _planted_like()
    fc = next(s for s in secs if s.name == "fix-check").data
    fc.update(outcome="remains", removed=False, exit_code=1,
              fixed={"name": "stabilized", "o_bias": -1.39e-3, "removed_share": 0.01},
              deployment={"removes": True, "removed_share": 0.80, "control_removes": True,
                          "control_removed_share": 0.81})
    v = build_verdict(secs)
    first = v.actions[0]
    assert first.what == "Keep the P̄V product and its accumulator in fp32" and "stable_attention(" not in first.what
    assert "without the fix (plain_attention) remove 81% of the bias as deployed" in first.effect
    assert "What to do: keep the P̄V product and its accumulator in fp32" in v.answer
    assert "What to do: replace" not in v.answer and "stable_attention(" not in v.answer
    assert not any(a.what.startswith(("Replace the attention", "Or use")) for a in v.actions)
    assert v.actions[-1].what.startswith("The stabilized softmax alone is not enough here")  # a caution comes last
    assert "removes 1% of the bias" in v.actions[-1].effect
    assert sum("fp32" in a.what for a in v.actions) == 1  # isolate's pv-fp32 repair not repeated


def _timeline_section(mechanism="attention-logit-growth", found=True):
    """The timeline section of a run whose layer 0 head 1 logits grew from step 40 (the diagnosis as
    analyses.timeline.diagnose writes it)."""
    from fa_forensics.analyses.timeline.diagnose import diagnose

    steps = list(range(100))
    logit = [[[0.1, 0.1 if not found else 0.1 * (1.2 ** max(0, s - 40))]] for s in steps]
    top1 = [[[0.2, 0.2 if not found else min(0.999, 0.2 + 0.02 * max(0, s - 40))]] for s in steps]
    diagnosis = diagnose(steps, [3.0] * 100, max_logit=logit, top1_prob=top1).to_json()
    assert diagnosis["mechanism"] == (mechanism if found else "none")
    return _sec("timeline", {"steps": steps, "alarms": [], "alarm_steps": [], "diagnosis": diagnosis})


def _fp32(secs):
    """The same sections as an fp32 run's: the findings replay bf16 on fp32 inputs."""
    for s in secs:
        if s.data is not None and "replay_fidelity" in s.data:
            s.data["replay_fidelity"] = {"preset": "bf16", "accumulation": "ieee", "o_bits_equal": None,
                                         "run_precision": "fp32", "unverifiable": [], "mismatch": None}
    return secs


def test_an_fp32_run_with_logit_growth_is_diagnosed_as_logit_growth_never_rounding():
    secs = _fp32([_timeline_section(), *_planted_like()])  # the bf16 replay finds a bias: not what trained
    v = build_verdict(secs)
    assert v.cause == "attention-logit-growth" and v.status == "unstable" and "biased-rounding" not in v.causes
    assert v.answer.startswith("Attention-logit growth in layer 0 head 1 from step ")
    assert "What to do: add qk-layernorm" in v.answer and "lower the learning rate" in v.answer
    assert "its attention's rounding is not the cause" in v.answer
    assert not any("stable_attention" in a.what or "fp32" in a.what or "FP8" in a.what for a in v.actions)
    assert v.line().startswith("VERDICT: Attention-logit growth")
    assert "In a bf16 replay (not what trained), biased" in v.line()
    page = render("d.zarr", secs)
    card = page[page.index("<section class='card"):page.index("</section>")]
    assert "Yes:" not in card and "stable_attention(" not in card and "qk-layernorm" in card
    # without a timeline an fp32 run is never "affected" by rounding either
    plain = build_verdict(_fp32(_planted_like()))
    assert plain.cause == "none" and plain.status == "not affected" and not plain.actions
    assert plain.answer.startswith("Nothing wrong found: this run trained in fp32") and "no timeline" in plain.answer


def test_a_low_precision_run_whose_bias_shows_as_logit_growth_is_rounding_first():
    v = build_verdict([_timeline_section(), *_planted_like()])
    assert v.causes == ("biased-rounding", "attention-logit-growth") and v.status == "affected"
    assert v.actions[0].what.startswith("Replace the attention by fa_forensics.stable_attention")
    assert any(a.what.startswith("Add qk-layernorm") for a in v.actions[1:])
    assert "Also: attention-logit growth" in v.answer


def test_a_replay_that_reproduces_too_few_bits_cannot_tell():
    """Plain-attention captures that no recipe reproduces (58 % of O bits): the card says it cannot tell, never
    'nothing to fix', and quotes no bias."""
    for found in (False, True):
        secs = _planted_like(delta_found=found, o_found=found)
        for s in secs:
            s.data["replay_fidelity"] = {"preset": "bf16-hw", "accumulation": "ieee", "o_bits_equal": 0.58,
                                         "run_precision": "bf16", "unverifiable": [], "mismatch": None}
        v = build_verdict(secs)
        assert v.status == "cannot tell" and v.cause == "cannot-tell", v.answer
        assert v.answer.startswith("Cannot tell: the replayed recipe (bf16-hw) reproduces only 58.0 % of the stored O "
                                   "bits") and "nothing to fix" not in v.line() and not v.actions
    good = _planted_like(delta_found=False, o_found=False)  # 96 % with unbiased mismatches: the findings stand
    for s in good:
        s.data["replay_fidelity"] = {"preset": "bf16-hw", "o_bits_equal": 0.96, "run_precision": "bf16",
                                     "mismatch": {"biased": False, "verdict": "the mismatches are unbiased"}}
    assert build_verdict(good).status == "not affected"


def test_the_card_quotes_a_fix_only_where_fix_check_found_a_bias_to_remove():
    secs = _planted_like()
    fc = next(s for s in secs if s.name == "fix-check").data
    fc.update(has_bias=False, outcome="no-bias", bias={**fc["bias"], "found": False, "adjusted_p": 0.31},
              verdict="NO BIAS TO REMOVE at layer 0 head 1 feature 44",
              deployment={"removes": True, "removed_share": 0.88, "control_removes": False},
              fixed={"name": "stabilized", "removed_share": 0.88})
    v = build_verdict(secs)
    page = render("d.zarr", secs)
    card = page[page.index("<section class='card"):page.index("</section>")]
    assert "88%" not in card and "stable_attention(" not in card and "88%" not in v.line()
    assert v.actions[0].what == "Keep the P̄V product and its accumulator in fp32"  # isolate's repair, which helps


def test_compounding_is_said_only_where_rank1_sim_concluded_it():
    for trend, said in (("compounds", True), ("washes out", False), (None, False)):
        secs = _planted_like()
        if trend:
            secs.append(_sec("rank1-sim", {"claim": secs[0].data["bias"], "accumulation_exponent":
                                           0.95 if trend == "compounds" else 0.4,
                                           "verdict": f"layer 0 head 1: … accumulation exponent 0.9 ({trend})"}))
        v = build_verdict(secs)
        text = " ".join([v.answer, *v.findings, v.line()])
        assert ("compounds" in text) == said and "adds up" not in text and "step after step" not in text, trend
        assert ("washes out" in text) == (trend == "washes out")


def test_pcast_s_interval_and_borderline_heads_reach_the_card():
    """pcast decides on the lost mass's interval: the card quotes the interval of the head it names and says which
    heads it cannot tell from the floor, never calling them collapsed."""
    secs = _planted_like(delta_found=False, o_found=False)
    bands = ["needs-fix", "borderline", "no-fix", "borderline"]
    pcast = {"heads": [{"step": 2, "layer": 0, "head": h, "needs_fix": bands[h] == "needs-fix", "band": bands[h],
                        "recommended_S": 256.0, "recommended_order": "forward", "lost_mass_ci": [0.006, 0.012],
                        "settings": [{"S": 1.0, "order": "forward", "mass_zeroed": 0.009, "frac_zeroed": 0.95}]}
                       for h in range(4)]}
    v = build_verdict([*secs, _sec("pcast", pcast)])
    assert v.cause == "fp8-p-collapse" and "up to 0.90% of the probability mass (95 % interval 0.60% to 1.20%)" in \
        v.answer
    pcast["heads"][0].update(needs_fix=False, band="no-fix")
    v = build_verdict([*secs, _sec("pcast", pcast)])
    assert v.cause == "none" and v.answer.endswith("pcast cannot tell 2 heads from its FP8 P-collapse floor "
                                                   "(borderline; its section says which).")


def test_each_section_concludes_from_its_json_and_missing_keys_are_a_shorter_conclusion():
    from fa_forensics.report.conclusions import conclusions

    secs = _planted_like()
    secs[2].data["bias"].update(subset="tied rows", unit="tied key group", n_units=41)  # keys a claim may carry
    by = conclusions([*secs, _sec("rank1-sim", {}), _sec("pcast", {}), _sec("timeline", {}),
                      _sec("delta-bias", None, note="no dO")])
    assert by["bitdiff"].claim.subset == "tied rows" and by["bitdiff"].claim.n_units == 41 and by["bitdiff"].found
    assert by["fix-check"].has_bias and by["fix-check"].outcome == "removed" and by["fix-check"].deployed_removes
    assert by["isolate"].culprits == ("pv-fp32", "stabilized") and by["isolate"].action.startswith("keep the P̄V")
    assert by["rank1-sim"].trend == "" and not by["pcast"].found and by["timeline"].mechanism == ""
    assert not by["delta-bias"].ran and by["delta-bias"].why_not == "no dO"
    v = build_verdict([*secs[:2], secs[2], *secs[3:]])
    assert "in the rows whose maximum repeats" in v.answer  # the O claim decided on tied rows says where it lives


def _small_bias_not_the_mechanism(secs):
    """The planted-like payloads turned into a healthy run's small bias that the P̄ = 1 mechanism does not carry:
    pv-trace's P̄ = 1 rows carry 12% ± 7%, the stabilized softmax removes 4% (fix-check exits 1), plain_attention's
    fp32 P̄V accumulator 99%."""
    for s in secs:
        if s.name == "fix-check":
            s.data.update(outcome="remains", exit_code=1, removed=False,
                          fixed={"name": "stabilized", "o_bias": -1.34e-3, "removed_share": 0.04},
                          deployment={"removes": True, "removed_share": 0.98, "control_removes": True,
                                      "control_removed_share": 0.99})
        if s.name == "pv-trace":
            s.data["class_shares"] = {"tie": {"share": 0.09, "se": 0.06, "rows": 40},
                                      "carry": {"share": 0.03, "se": 0.03, "rows": 12}}
    return secs


def test_a_quiet_monitored_run_with_a_small_bias_is_healthy_first():
    """A monitored run whose timeline is quiet: the first line says so, names the bias with its size ± se and where,
    says the paper's mechanism does not explain it (and why), and what to watch; no fix comes first."""
    secs = [_timeline_section(found=False), *_small_bias_not_the_mechanism(_planted_like(delta_found=False))]
    v = build_verdict(secs)
    assert v.cause == "no-instability" and v.status == "healthy" and v.causes == ("no-instability", "biased-rounding")
    assert v.lead.startswith("No instability in this run: its monitored timeline is quiet over 100 steps (no alarm, "
                             "no loss spike). A small rounding bias at layer 0 head 1 feature 44 (0.2 ± 0.01 of a "
                             "rounding unit) is not the paper's tied-maximum mechanism"), v.lead
    assert "rows with P̄ = 1 carry 12% ± 7% of it" in v.lead and "removes 4% of it" in v.lead
    assert v.lead.endswith("Nothing to act on while the run is healthy: watch layer 0 head 1.")
    assert "O −: -0.0014 ± 7e-05" in v.because and "W_Q spectral norm" in v.because
    assert v.actions[0].what.startswith("Nothing to act on while the run is healthy; watch layer 0 head 1's")
    assert v.actions[1].what.startswith("Should it start to matter (an alarm, or a significant Σδ): keep the P̄V")
    assert "nothing to fix" not in v.line() and "What to do: keep" not in v.lead
    page = render("d.zarr", secs)
    card = page[page.index("<section class='card"):page.index("</section>")]
    assert "card healthy" in card and "The timeline shows no instability over 100 monitored steps" in card


def test_a_quiet_run_whose_bias_the_fix_removes_is_the_paper_s_mechanism():
    v = build_verdict([_timeline_section(found=False), *_planted_like()])
    assert v.cause == "no-instability" and "is the paper's tied-maximum mechanism (pv-trace: rows with P̄ = 1 carry " \
        "100% ± 2% of it; fix-check: the stabilized softmax, which leaves no P̄ = 1, removes 99% of it)" in v.lead


def test_a_quiet_timeline_does_not_hide_a_compounding_bias_or_an_alarm():
    """Where rank1-sim finds the Σδ compounding, or the monitor alarmed, the rounding is named first as before, and a
    quiet timeline is said beside it."""
    secs = [_timeline_section(found=False), *_planted_like()]
    secs.append(_sec("rank1-sim", {"claim": secs[1].data["bias"], "accumulation_exponent": 0.95,
                                   "verdict": "layer 0 head 1: … accumulation exponent 0.95 (compounds)"}))
    v = build_verdict(secs)
    assert v.cause == "biased-rounding" and v.status == "affected"
    assert v.because.endswith("The timeline shows no instability over 100 monitored steps (no alarm, no loss spike).")
    alarmed = [_timeline_section(found=False), *_planted_like()]
    alarmed[0].data["alarms"] = [{"step": 70, "metric": "near_max_ties", "layer": 0, "head": 1, "value": 38}]
    v = build_verdict(alarmed)
    assert v.cause == "biased-rounding" and "no instability over" not in v.because


def test_a_quiet_timeline_is_said_once():
    v = build_verdict([_timeline_section(found=False), *_small_bias_not_the_mechanism(_planted_like(False))])
    said = " ".join([v.lead, v.because]).lower()
    assert said.count("no instability") == 1 and said.count("loss spike") == 2  # the lead's and the evidence's


def test_a_quiet_run_whose_bias_is_a_sigma_delta_names_its_step_and_watches_its_sign():
    v = build_verdict([_timeline_section(found=False), *_planted_like(delta_found=True, o_found=False)])
    assert v.cause == "no-instability" and "A small rounding bias at layer 0 head 1 step 0 (" in v.lead
    assert "(0.2 ± 0.024 of a rounding unit); whether the paper's tied-maximum mechanism explains it is not shown. " \
        in v.lead  # pv-trace and fix-check measure the O bias
    assert "whether its Σδ keeps its sign on later captures" in v.because
