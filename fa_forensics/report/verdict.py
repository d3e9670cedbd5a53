"""The report's opening verdict: one sentence a user can act on, from the analyses' bias claims.

Each analysis's JSON has a `bias` claim (`analyses.contract.BiasClaim`: found after Bonferroni at
p < 0.01, quantity O or δ, layer, head, sign). The verdict says whether the analyses agree that a
bias exists and where (culprit layer, head, step), which operation carries it (isolate's repairs,
pv-trace's P̄ = 1 share), whether the fix removes it (fix-check) and the replay fidelity (with the sign
test of the mismatches, or why it is unverifiable); when the analyses disagree it says so, naming which
found what. An fp32 run's verdict leads with that: there is no low-precision rounding in it to analyse.
"""
from __future__ import annotations

from typing import Optional

from fa_forensics.analyses.wording import bit_share, finite, number, share_with_se

CLAIMING = ("isolate", "delta-bias", "bitdiff", "fix-check", "pv-trace")


def claims(sections) -> dict[str, dict]:
    """{section name: its JSON `bias` claim} for the sections that produced one."""
    return {s.name: s.data["bias"] for s in sections if s.data is not None and isinstance(s.data.get("bias"), dict)}


def agreement(by_name: dict[str, dict]) -> tuple[bool, Optional[tuple[int, int]]]:
    """(the analyses agree, the (layer, head) they agree on or None): all found at one (layer, head),
    with one sign per quantity, or none found."""
    found = {n: c for n, c in by_name.items() if c["found"]}
    if not found:
        return True, None
    if len(found) != len(by_name):
        return False, None
    places = {(c["layer"], c["head"]) for c in found.values()}
    signs = {(c["quantity"], c["sign"]) for c in found.values()}
    one_sign = len(signs) == len({q for q, _ in signs})
    return (len(places) == 1 and one_sign), (next(iter(places)) if len(places) == 1 else None)


def report_verdict(sections) -> str:
    """The one-sentence verdict that opens the report, led by what the run's precision means when it is fp32."""
    verdict, lead = _report_verdict(sections), _precision(sections)
    if not lead:
        return verdict
    body = verdict.removeprefix("VERDICT: ")
    return f"VERDICT: {lead}{body[:1].upper()}{body[1:]}"


def _precision(sections) -> str:
    """What the run's recorded precision means, leading the verdict ('' for a low-precision run)."""
    from fa_forensics.analyses.contract import precision_line

    for s in sections:
        line = precision_line(None if s.data is None else s.data.get("replay_fidelity"))
        if line:
            return f"{line}. "
    return ""


def _fidelity(sections) -> str:
    """The verdict's fidelity clause: the share of the stored O the replayed recipe reproduces and what the
    mismatches mean (their sign test from 88 %), or why it cannot be measured (attention dropout)."""
    from fa_forensics.analyses.contract import FIDELITY_WARN_BELOW, MISMATCH_TEST_ABOVE

    for s in sections:
        fidelity = None if s.data is None else s.data.get("replay_fidelity")
        if fidelity is None:
            continue
        named = f"recipe {fidelity.get('preset')} / {fidelity.get('accumulation')}"
        reasons = list(dict.fromkeys(u.get("reason") for u in fidelity.get("unverifiable") or []
                                     if not str(u.get("reason", "")).startswith("trained in fp32")))
        if reasons:
            why = "the recipe the recorded settings imply" if fidelity.get("requested") == "auto" else "as asked"
            return f"replay fidelity unverifiable ({'; '.join(reasons)}): the findings describe {named}, {why}"
        share = fidelity.get("o_bits_equal")
        if share is None:
            if fidelity.get("run_precision") == "fp32":
                return f"the findings describe {named} replayed on the run's fp32 inputs"
            return f"replay fidelity: {named} reproduces an unknown share of the stored O bits"
        shown = f"replay fidelity: {named} reproduces {bit_share(share)} of the stored O bits"
        mismatch = fidelity.get("mismatch")
        if share < 1.0 and share >= MISMATCH_TEST_ABOVE and mismatch:
            return f"{shown}; {mismatch['verdict']}"
        if share < FIDELITY_WARN_BELOW:
            return f"{shown}: the findings describe that recipe, not the kernel that trained"
        return shown
    return "replay fidelity not measured (the findings describe the replayed recipe)"


def _collapse_clause(fc: dict) -> str:
    """'; the stabilized softmax collapses O in N row(s) (...)' when fix-check found it under the preset's floor."""
    c = fc.get("collapse") or {}
    if not (c.get("rows") and c.get("applies")):
        return ""
    return (f"; the stabilized softmax collapses O in {c['rows']} row(s) (repeated maximum up to "
            f"{number(c.get('max_score'), '.4g')} > {number(c.get('threshold'), '.4g')}: the "
            f"{number(c.get('floor'), 'g')} row-sum floor takes over; fix-check)")


def _report_verdict(sections) -> str:
    """The verdict's sentence, before the run's precision leads it."""
    by_name = claims(sections)
    data = {s.name: s.data for s in sections if s.data is not None}
    fidelity = _fidelity(sections)
    if not by_name:
        return f"VERDICT: no analysis produced a bias claim for this dump (see the notes below); {fidelity}."
    agree, place = agreement(by_name)
    names = ", ".join(by_name)
    collapse = _collapse_clause(data.get("fix-check") or {})
    if agree and place is None:
        return (f"VERDICT: no significant bias (sign or t-test, Bonferroni-corrected p < 0.01) in {names}: "
                f"nothing to fix{collapse}; {fidelity}.")
    if not agree:
        parts = [f"{n} {'finds' if c['found'] else 'does not find'} one at layer {c['layer']} head {c['head']}"
                 f" ({'+' if c['sign'] > 0 else '−'}{c['quantity']}, p={c['p_value']:.2g} of {c['n_tests']} tests)"
                 for n, c in by_name.items()]
        return (f"VERDICT: the analyses disagree on whether or where a bias exists: {'; '.join(parts)}{collapse}; "
                f"{fidelity}.")
    layer, head = place
    steps = sorted({c["step"] for c in by_name.values() if c.get("step") is not None})
    feature = next((c["feature"] for c in by_name.values() if c.get("feature") is not None), None)
    o_sign = next((c["sign"] for c in by_name.values() if c["quantity"] == "O"), 0)
    d_sign = next((c["sign"] for c in by_name.values() if c["quantity"] == "delta"), 0)
    where = f"layer {layer} head {head}" + (f", step {steps[0]}" if len(steps) == 1
                                            else f", steps {steps}" if steps else "")
    where += f", feature {feature}" if feature is not None else ""
    signs = ", ".join(x for x in (f"O {'+' if o_sign > 0 else '−'}" if o_sign else "",
                                   f"Σδ {'+' if d_sign > 0 else '−'}" if d_sign else "") if x)
    operation = ""
    if "isolate" in data:
        culprits = data["isolate"].get("culprits") or []
        operation = f"; repairs that remove it: {', '.join(culprits)}" if culprits else "; no single repair removes it"
    if "pv-trace" in data:
        shares = data["pv-trace"].get("class_shares") or {}
        p_one = [v for k, v in shares.items() if k in ("tie", "near-tie", "carry") and v.get("rows")]
        if p_one:
            total = sum(v["share"] for v in p_one)
            se = sum(v["se"] ** 2 for v in p_one) ** 0.5
            if finite(total):
                operation += (f"; the P̄ = 1 rounding mechanism carries {share_with_se(total, se)} of the O bias "
                              "in that feature")
    fix = ""
    if "fix-check" in data:
        fc = data["fix-check"]
        if collapse:
            fix = collapse
        else:
            fix = ("; the stabilized softmax removes it" if fc.get("removed")
                   else "; the stabilized softmax does NOT remove it")
            fix += f" (fix-check: reduction {number(fc.get('bias_reduction'), '.1f')}x)"
    return f"VERDICT: biased rounding at {where} ({signs}), found by {names}{operation}{fix}; {fidelity}."
