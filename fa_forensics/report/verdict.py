"""The report's verdict: one structured answer (`Verdict`) that both the page's summary card and the one-line CLI
verdict render, so that they cannot disagree.

Its first line is the diagnosis (report.diagnosis): what is wrong with this run and what to do, composed from the
sections' typed conclusions (report.conclusions). Around it, from the same sections' JSON payloads:
- the bias claims grouped by quantity: Σδ per (step, layer, head) (isolate, delta-bias) and the O bias per (layer,
  head, feature) (bitdiff, fix-check, pv-trace); where the two quantities point at different places, or one finds a
  bias and the other does not, the verdict says which and why;
- pcast's FP8 finding, the timeline's alarms and the instability it shows;
- how sure: the replay fidelity with the mismatch test, the claims' p-values in their family.
An fp32 run's verdict says so: its findings show what a low-precision replay would do, and rounding is never the
cause it names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from fa_forensics.analyses.significance import ALPHA, EFFECT_FLOOR, METHOD, REMOVED_SHARE, rule_text
from fa_forensics.analyses.wording import bit_share, finite, number, share_with_se
from fa_forensics.report.conclusions import CompoundingConclusion, conclusions, replay
from fa_forensics.report.diagnosis import Action, Diagnosis, diagnose

CLAIMING = ("isolate", "delta-bias", "bitdiff", "fix-check", "pv-trace")
QUANTITY_OF = {"isolate": "delta", "delta-bias": "delta", "bitdiff": "O", "fix-check": "O", "pv-trace": "O"}


def claims(sections) -> dict[str, dict]:
    """{section name: its JSON `bias` claim} for the sections that produced one."""
    return {s.name: s.data["bias"] for s in sections if s.data is not None and isinstance(s.data.get("bias"), dict)}


def agreement(by_name: dict[str, dict]) -> tuple[bool, Optional[tuple[int, int]]]:
    """(the analyses agree, the (layer, head) they agree on or None): all found at one (layer, head),
    with one sign per quantity, or none found."""
    found = {n: c for n, c in by_name.items() if c.get("found")}
    if not found:
        return True, None
    if len(found) != len(by_name):
        return False, None
    places = {(c.get("layer"), c.get("head")) for c in found.values()}
    signs = {(c.get("quantity"), c.get("sign")) for c in found.values()}
    one_sign = len(signs) == len({q for q, _ in signs})
    return (len(places) == 1 and one_sign), (next(iter(places)) if len(places) == 1 else None)


# ---- the structured verdict ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Evidence:
    """One quantity's claim as the analyses that test it make it."""

    quantity: str  # "delta" (Σδ per (step, layer, head)) | "O" (O bias per (layer, head, feature))
    found: bool
    layer: Optional[int]
    head: Optional[int]
    step: Optional[int]
    feature: Optional[int]
    sign: int
    value: float
    se: float
    p_value: float
    adjusted_p: float
    n_tests: int
    effect: float  # in rounding units
    analyses: tuple[str, ...]  # the analyses that make this claim
    steps: tuple[int, ...] = ()  # Σδ: the steps of the place's significant items
    others: tuple[tuple[int, int], ...] = ()  # the other (layer, head) with a significant item or cell
    subset: str = "all rows"  # the rows the claim is over: all rows, or the tied rows (maximum attained twice)

    @property
    def place(self) -> Optional[tuple[int, int]]:
        return None if self.layer is None else (self.layer, self.head)

    def stats(self) -> str:
        """'+2.45 ± 0.24, 0.18 rounding units, p = 1.3e-21 (3.5e-19 after Holm over 550 tests)'."""
        value = f"{self.value:+.3g} ± {self.se:.2g}" if finite(self.value) and finite(self.se) else number(self.value)
        return (f"{value}, {number(self.effect, '.2g')} of a rounding unit, p = {_p(self.p_value)} "
                f"({_p(self.adjusted_p)} after {METHOD} over {self.n_tests} tests)")


@dataclass(frozen=True)
class Verdict:
    """The answer of the report, in fields the card and the one-line verdict both render."""

    status: str  # "affected" | "disagree" | "unstable" | "fp8-only" | "cannot tell" | "healthy" (a quiet monitored
    # run whose rounding shows a bias to watch) | "not affected" | "no result"
    answer: str  # the diagnosis: what is wrong with this run and what to do
    where: str  # layer, head, step(s), feature ('' when nothing was found)
    findings: tuple[str, ...]  # one plain sentence per finding (timeline, bias, FP8)
    actions: tuple[Action, ...]  # what to do, each with its measured effect
    confidence: tuple[str, ...]  # how sure: fidelity, p-values, the mismatch test
    disagreements: tuple[str, ...]  # which analyses disagree and why
    rule: str  # what "significant" means here
    technical: str  # the technical sentence (its words follow the analyses' own)
    evidence: tuple[Evidence, ...] = ()
    fp8_heads: tuple[dict, ...] = ()  # pcast's heads that need a fix: {step, layer, head, S, order, mass_zeroed}
    alarms: tuple[dict, ...] = ()  # the timeline's alarms
    fidelity: str = ""
    precision: str = ""  # what the run's precision means ('' for a low-precision run)
    untested: tuple[str, ...] = ()  # the analyses that could not run on this dump (their notes say why)
    lead: str = ""  # the card's first line: what is wrong, what to do
    because: str = ""  # the evidence behind it, and the other causes with evidence
    cause: str = ""  # the mechanism the diagnosis names (report.diagnosis: "biased-rounding", "fp8-p-collapse", ...)
    causes: tuple[str, ...] = ()  # every mechanism with evidence, the named one first

    def line(self) -> str:
        """The one-line verdict of the CLI and the page's technical sentence."""
        return self.technical


def _p(p) -> str:
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not math.isfinite(p):
        return "n/a"
    return "< 1e-300" if p == 0 else f"{p:.2g}"


def _int(x) -> Optional[int]:
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _float(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _evidence(by_name: dict[str, dict], data: dict[str, dict], quantity: str) -> list[Evidence]:
    """The distinct claims of one quantity (one when the analyses agree), each with the analyses that make it."""
    groups: dict[tuple, list[str]] = {}
    for name, c in by_name.items():
        if c.get("quantity") != quantity:
            continue
        key = (bool(c.get("found")), _int(c.get("layer")), _int(c.get("head")), _int(c.get("step")),
               _int(c.get("feature")), _int(c.get("sign")) or 0)
        groups.setdefault(key, []).append(name)
    out = []
    for (found, layer, head, step, feature, sign), names in groups.items():
        c = by_name[names[0]]
        steps: tuple[int, ...] = ()
        if quantity == "delta":
            items = (data.get("delta-bias") or {}).get("per_step") or (data.get("isolate") or {}).get("heads") or []
        else:
            items = (data.get("bitdiff") or {}).get("biased_features") or []
        items = [i for i in items if isinstance(i, dict) and _significant_item(i)]
        if quantity == "delta":
            steps = tuple(sorted({i["step"] for i in items if (i.get("layer"), i.get("head")) == (layer, head)}))
            pooled = tuple(s for s in c.get("steps") or [] if isinstance(s, int))
            steps = pooled if len(pooled) > 1 else steps  # a claim pooled over steps: the steps it pooled
        others = tuple(sorted({(i.get("layer"), i.get("head")) for i in items} - {(layer, head)}))
        out.append(Evidence(quantity, found, layer, head, step, feature, sign, _float(c.get("value")),
                            _float(c.get("se")), _float(c.get("p_value")), _float(c.get("adjusted_p")),
                            _int(c.get("n_tests")) or 0, _float(c.get("effect")), tuple(names), steps,
                            others if found else (), str(c.get("subset") or "all rows")))
    return sorted(out, key=lambda e: (not e.found, len(e.analyses) * -1))


def _significant_item(item: dict) -> bool:
    """An item or cell significant over all its rows or over its tied rows (`tied`)."""
    tied = item.get("tied")
    return bool(item.get("significant", True)) or (isinstance(tied, dict) and bool(tied.get("significant")))


def _precision(sections) -> str:
    """What the run's recorded precision means ('' for a low-precision run)."""
    from fa_forensics.analyses.contract import precision_line

    for s in sections:
        fid = None if s.data is None else s.data.get("replay_fidelity")
        line = precision_line(fid.get("run_precision"), fid.get("preset")) if isinstance(fid, dict) else None
        if line:
            return line
    return ""


def _fidelity(sections) -> str:
    """The fidelity clause: the share of the stored O the replayed recipe reproduces and what the
    mismatches mean (their sign test from 88 %), or why it cannot be measured (attention dropout)."""
    from fa_forensics.analyses.contract import FIDELITY_WARN_BELOW, MISMATCH_TEST_ABOVE

    for s in sections:
        fidelity = None if s.data is None else s.data.get("replay_fidelity")
        if not isinstance(fidelity, dict):
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
        if share < 1.0 and share >= MISMATCH_TEST_ABOVE and isinstance(mismatch, dict):
            return f"{shown}; {mismatch.get('verdict')}"
        if share < FIDELITY_WARN_BELOW:
            return f"{shown}: the findings describe that recipe, not the kernel that trained"
        return shown
    return "replay fidelity not measured (the findings describe the replayed recipe)"


def _collapse_clause(by_name) -> str:
    """'; the stabilized softmax collapses O in N row(s) (...)' where fix-check found it under the preset's floor."""
    fc = by_name.get("fix-check")
    collapse = getattr(fc, "collapse", "")
    return f"; {collapse}" if collapse else ""


def _alarm_text(alarms: list[dict]) -> str:
    steps = sorted({a.get("step") for a in alarms if a.get("step") is not None})
    first = alarms[0]
    what = ""
    if first.get("metric"):
        where = (f" at layer {first.get('layer')} head {first.get('head')}"
                 if first.get("layer") is not None and first.get("head") is not None else "")
        what = f" (first: {first.get('metric')}{where} = {number(first.get('value'), '.4g')}" + (
            f", rule {first.get('rule')})" if first.get("rule") else ")")
    shown = ", ".join(str(s) for s in steps[:6]) + (f" and {len(steps) - 6} more" if len(steps) > 6 else "")
    return (f"the training monitor raised {len(alarms)} alarm{'s' if len(alarms) != 1 else ''} at step"
            f"{'s' if len(steps) != 1 else ''} {shown}{what}")


def _fp8_text(heads: list[dict], pcast: dict) -> str:
    n = len((pcast or {}).get("heads") or [])
    where = ", ".join(f"layer {h['layer']} head {h['head']}" for h in heads[:4]) + (
        f" and {len(heads) - 4} more" if len(heads) > 4 else "")
    lost = [h["mass_zeroed"] for h in heads if finite(h.get("mass_zeroed"))]
    zeroed = [h["frac_zeroed"] for h in heads if finite(h.get("frac_zeroed"))]
    mass = (f" (up to {max(zeroed):.0%} of the non-sink probabilities, {max(lost):.2%} of the probability mass)"
            if lost and zeroed else "")
    return (f"FP8: {len(heads)} of {n} heads need a P-cast fix: an FP8 kernel's default P cast (E4M3, S = 1, "
            f"forward KV order) silently zeroes small probabilities there{mass}: {where}")


def _fp8_settings(heads: list[dict]) -> str:
    return "; ".join(sorted({f"{h.get('order')} S={number(h.get('S'), 'g')}" for h in heads}))


def _signs_text(evidence: list[Evidence]) -> str:
    words = []
    for e in evidence:
        if e.found and e.sign:
            words.append(f"{'O' if e.quantity == 'O' else 'Σδ'} {'+' if e.sign > 0 else '−'}")
    return ", ".join(words)


def _where(delta: Optional[Evidence], o: Optional[Evidence]) -> str:
    """'layer 0 head 1, steps 0, 1, 2, feature 44' from the found claims that agree on (layer, head)."""
    main = delta if delta is not None and delta.found else o
    if main is None or not main.found:
        return ""
    text = f"layer {main.layer} head {main.head}"
    steps = delta.steps if delta is not None and delta.found and delta.place == main.place else ()
    if steps:
        text += f", step {steps[0]}" if len(steps) == 1 else f", steps {', '.join(map(str, steps))}"
    if o is not None and o.found and o.place == main.place and o.feature is not None:
        text += f", feature {o.feature}"
    others = sorted(set(main.others) | (set(o.others) if o is not None and o.found else set()) - {main.place})
    if others:
        text += f" (also {'; '.join(f'layer {l} head {h}' for l, h in others)})"
    return text


def _over(steps: tuple[int, ...]) -> str:
    """'pooled over steps 0..2' (a Σδ claim tested over several steps)."""
    from fa_forensics.analyses.quantities import steps_text

    return f"pooled over {steps_text(steps)}, its sign held at every step" if steps else "over its steps"


def _plain_bias(delta: Optional[Evidence], o: Optional[Evidence], rank1: Optional[CompoundingConclusion],
                replayed: str = "") -> list[str]:
    """The bias findings in plain words; "compounds" only where rank1-sim concluded it. `replayed`: the preset an
    fp32 run's findings replay (its findings say what that preset would do, not what trained)."""
    out = []
    lead = f"In a {replayed} replay of this fp32 run (not what trained), the" if replayed else "The"
    if o is not None and o.found:
        direction = "too high" if o.sign > 0 else "too low"
        rows = " in the rows whose maximum repeats" if o.subset == "tied rows" else ""
        out.append(f"{lead} low-precision attention output O comes out {direction} on average{rows} in layer "
                   f"{o.layer} head {o.head} feature {o.feature}: {o.stats()} (t-test over its "
                   f"independent units; {', '.join(o.analyses)}).")
    if delta is not None and delta.found:
        direction = "positive" if delta.sign > 0 else "negative"
        text = (f"That error reaches the gradient: Σ(δ_lp − δ_hp) is one-signed ({direction}) in layer "
                f"{delta.layer} head {delta.head}, "
                f"{f'most significant at step {delta.step}' if delta.step is not None else _over(delta.steps)}: "
                f"{delta.stats()} "
                f"({', '.join(delta.analyses)}).")
        if rank1 is not None and rank1.trend == "compounds":
            text += (f" rank1-sim finds that it compounds: W_Q's gradient error grows with the number of steps "
                     f"(accumulation exponent {number(rank1.exponent, '.2f')}; paper §3.3).")
        elif rank1 is not None and rank1.trend:
            trend = "washes out" if rank1.trend == "washes out" else "neither compounds nor washes out"
            text += (f" rank1-sim finds that it {trend} over the captured steps (accumulation exponent "
                     f"{number(rank1.exponent, '.2f')}).")
        out.append(text)
    return out


def _disagreements(evidence: list[Evidence], delta: Optional[Evidence], o: Optional[Evidence]) -> list[str]:
    out = []
    for quantity in ("delta", "O"):
        group = [e for e in evidence if e.quantity == quantity]
        if len(group) > 1:
            parts = [f"{', '.join(e.analyses)} {'find' if e.found else 'do not find'} one at layer {e.layer} head "
                     f"{e.head}" + (f" feature {e.feature}" if e.feature is not None else "") for e in group]
            out.append(f"the analyses of {'Σδ' if quantity == 'delta' else 'the O bias'} disagree: {'; '.join(parts)} "
                       "(they replay different sides or selections; compare their commands below)")
    if delta is not None and o is not None and delta.found and o.found and delta.place != o.place:
        out.append(f"the O bias is most significant at layer {o.layer} head {o.head} feature {o.feature} "
                   f"({', '.join(o.analyses)}), Σδ at layer {delta.layer} head {delta.head} "
                   f"({', '.join(delta.analyses)}): Σδ weighs every feature's O error by dO, so the head whose "
                   "gradient error is largest need not hold the most biased single feature")
    elif delta is not None and o is not None and o.found and not delta.found:
        out.append(f"the O bias at layer {o.layer} head {o.head} feature {o.feature} ({', '.join(o.analyses)}) does "
                   f"not make Σδ significant ({', '.join(delta.analyses)}: {delta.stats()}"
                   + (f", pooled over steps {', '.join(map(str, delta.steps))}" if len(delta.steps) > 1 else "")
                   + "), so whether dO adds it up into the W_Q gradient is not shown here")
    elif delta is not None and o is not None and delta.found and not o.found:
        out.append(f"Σδ is significant at layer {delta.layer} head {delta.head} ({', '.join(delta.analyses)}) though "
                   f"no single O feature is (most significant: layer {o.layer} head {o.head} feature {o.feature}, "
                   f"{o.stats()}; {', '.join(o.analyses)}): Σδ sums every feature's O error of every token, weighted "
                   "by dO, so it reaches significance before a single feature does, or when the bias is spread over "
                   "features")
    return out


def _status(d: Diagnosis, evidence: list[Evidence], disagreements: list[str]) -> str:
    from fa_forensics.report import diagnosis as dx

    mechanism = d.cause.mechanism
    if mechanism == dx.ROUNDING:
        return "disagree" if any("disagree" in x for x in disagreements) else "affected"
    if mechanism == dx.FP8:
        return "fp8-only"
    if mechanism == dx.CANNOT_TELL:
        return "no result" if d.cause.sections == () else "cannot tell"
    if mechanism == dx.NONE:
        return "not affected"
    if mechanism == dx.NO_INSTABILITY:
        return "healthy"
    return "unstable"


def build_verdict(sections) -> Verdict:
    """The report's verdict from its sections (any object with `name`, `data` (the JSON payload or None) and
    `note`)."""
    data = {s.name: s.data for s in sections if s.data is not None}
    untested = tuple(s.name for s in sections if s.data is None)
    by_name = claims(sections)
    concluded = conclusions(sections)
    fit = replay(sections)
    d = diagnose(concluded, fit)
    evidence = _evidence(by_name, data, "delta") + _evidence(by_name, data, "O")
    delta = next((e for e in evidence if e.quantity == "delta"), None)
    o = next((e for e in evidence if e.quantity == "O"), None)
    found = any(e.found for e in evidence)
    pcast = concluded.get("pcast")
    fp8 = list(getattr(pcast, "heads", ()))
    timeline = concluded.get("timeline")
    alarms = list(getattr(timeline, "alarms", ()))
    rank1 = concluded.get("rank1-sim") if isinstance(concluded.get("rank1-sim"), CompoundingConclusion) else None
    fidelity = _fidelity(sections)
    precision = _precision(sections)
    disagreements = _disagreements(evidence, delta, o)
    findings = []
    if timeline is not None and getattr(timeline, "found", False):
        findings.append(f"The timeline shows {timeline.summary} (timeline).")
    elif timeline is not None and getattr(timeline, "quiet", False):
        findings.append(f"The timeline shows no instability over {timeline.monitored} monitored steps: no alarm, no "
                        "loss spike, no attention-logit growth or entropy collapse (timeline).")
    if alarms:
        findings.append(_alarm_text(alarms)[:1].upper() + _alarm_text(alarms)[1:] + ".")
    findings += _plain_bias(delta, o, rank1, fit.preset if fit.fp32_run else "")
    if fp8:
        findings.append(("If this run's attention ran in FP8: " if fit.fp32_run else "")
                        + _fp8_text(fp8, data.get("pcast") or {}) + ".")
    confidence = [fidelity[:1].upper() + fidelity[1:] + "."]
    if untested:
        confidence.append(f"Not tested: {_names(untested)} could not run on this dump (see {_their(untested)} notes).")
    for e in evidence:
        if e.found:
            confidence.append(f"{'Σδ' if e.quantity == 'delta' else 'O bias'}: {e.stats()}.")
    if not found and evidence:
        best = min(evidence, key=lambda e: e.adjusted_p if finite(e.adjusted_p) else 2.0)
        confidence.append(f"Most significant {'Σδ item' if best.quantity == 'delta' else 'O cell'}: layer {best.layer} "
                          f"head {best.head}"
                          + (f" feature {best.feature}" if best.feature is not None else "")
                          + (f" step {best.step}" if best.step is not None else "") + f", {best.stats()}.")
    technical = _technical(d, concluded, data, by_name, evidence, delta, o, found, fp8, alarms, fidelity, precision,
                           untested, fit.preset if fit.fp32_run else "")
    return Verdict(status=_status(d, evidence, disagreements), answer=d.headline, where=_where(delta, o),
                   findings=tuple(findings), actions=d.actions, confidence=tuple(confidence),
                   disagreements=tuple(disagreements), rule=rule_text(), technical=technical,
                   evidence=tuple(evidence), fp8_heads=tuple(fp8), alarms=tuple(alarms), fidelity=fidelity,
                   precision=precision, untested=untested, lead=d.lead, because=d.because, cause=d.cause.mechanism,
                   causes=tuple(c.mechanism for c in (d.cause, *d.others)))


def _names(names: tuple[str, ...]) -> str:
    """'isolate', 'isolate and pcast', 'isolate, delta-bias and pcast'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _their(names: tuple[str, ...]) -> str:
    return "its" if len(names) == 1 else "their"


def _technical(d: Diagnosis, concluded, data, by_name, evidence, delta, o, found, fp8, alarms, fidelity, precision,
               untested=(), replayed: str = "") -> str:
    """The one-line verdict: 'VERDICT: <the diagnosis> Technical: …; replay fidelity …'."""
    lead = f"{precision}. " if precision else ""
    parts = []
    if alarms:
        parts.append(_alarm_text(alarms))
    names = ", ".join(by_name)
    collapse = _collapse_clause(concluded)
    if not by_name:
        parts.append("no analysis produced a bias claim for this dump (see the notes below)")
    elif not found:
        tail = "no fix for rounding bias needed" if d.cause.mechanism != "none" else "nothing to fix"
        if untested:
            tail = f"nothing to fix in what was tested ({_names(untested)} could not run)"
        parts.append(f"no significant bias (t-test of the mean over independent units, {METHOD}-corrected p < "
                     f"{ALPHA:g} and at least {EFFECT_FLOOR:.0%} of a rounding unit) in {names}: {tail}{collapse}")
    else:
        signs = _signs_text(evidence)
        finders = ", ".join(n for e in evidence if e.found for n in e.analyses)
        what = f"in a {replayed} replay (not what trained), biased rounding" if replayed else "biased rounding"
        sentence = f"{what} at {_where(delta, o)} ({signs}), found by {finders}"
        disagree = _disagreements(evidence, delta, o)
        if disagree:
            sentence += f"; {'; '.join(disagree)}"
        sentence += _operation(data, concluded, o) + _fix(concluded, collapse)
        parts.append(sentence)
    if fp8:
        parts.append(("if it ran in FP8: " if replayed else "") + _fp8_text(fp8, data.get("pcast") or {})
                     + f"; use {_fp8_settings(fp8)}")
    body = "; ".join(parts)
    return f"VERDICT: {d.headline} Technical: {lead}{body[:1].upper() if lead else body[:1]}{body[1:]}; {fidelity}."


def _operation(data: dict, concluded, o: Optional[Evidence]) -> str:
    """Which operation carries it: isolate's repairs, pv-trace's P̄ = 1 share (where the O bias is significant)."""
    text = ""
    iso = data.get("isolate")
    if iso is not None:  # isolate's repairs act on the Σδ it localizes: without a Σδ bias it names none
        culprits = iso.get("culprits") or []
        found = bool((iso.get("bias") or {}).get("found"))
        text = (f"; repairs that remove it: {', '.join(culprits)}" if culprits else
                "; no single repair removes it" if found else "")
    pv = data.get("pv-trace") or {}
    if pv and o is not None and o.found and (pv.get("o_bias") or {}).get("significant", True):
        mechanism = concluded.get("pv-trace")
        total = getattr(mechanism, "p_one_share", math.nan)
        se = getattr(mechanism, "p_one_se", math.nan)
        if finite(total):
            text += f"; the P̄ = 1 rounding mechanism carries {share_with_se(total, se)} of the O bias in that feature"
            if total - 2 * se > 1 or total + 2 * se < 0:  # beyond 0-100 %: the rest of the rows push the other way
                text += " (a signed share: the other rows' rounding pushes the other way)"
    return text


def _fix(concluded, collapse: str) -> str:
    """What fix-check concluded about the fix, only where it found a bias to remove."""
    fc = concluded.get("fix-check")
    if fc is None or not getattr(fc, "has_bias", False):
        return ""
    if collapse:
        return collapse
    most = finite(fc.fixed_share) and fc.fixed_share < REMOVED_SHARE
    text = {"removed": ("; the stabilized softmax removes most of it (what is left is not significant)" if most
                        else "; the stabilized softmax removes it"),
            "inconclusive": "; too few rows to tell whether the stabilized softmax removes it"}.get(
        fc.outcome, "; the stabilized softmax does NOT remove it")
    text += f" (fix-check: {share_with_se(fc.fixed_share, None)} removed)"
    return text


def report_verdict(sections) -> str:
    """The one-line verdict that opens the report and ends `fa-forensics report`."""
    return build_verdict(sections).line()
