"""The report's diagnosis: what is wrong with this run and what to do, composed from the sections' conclusions
(report.conclusions) and nothing else.

It chooses among the mechanisms the tool has evidence for, each with its evidence and the action it supports:
- a training instability the timeline shows (attention-logit growth or entropy collapse, output-logit divergence,
  an optimizer or learning-rate blow-up: analyses.timeline.diagnose);
- biased rounding in P̄V (the paper's mechanism: the rounding sections' bias claims), never on an fp32 run;
- FP8 P-collapse (pcast), never on an fp32 run;
- "cannot tell": the replay reproduces too few of the kernel's bits for the rounding findings to describe the run,
  the monitor alarmed with no mechanism in sight, or no evidence could be gathered.
In a low-precision run where the rounding sections find the bias, a timeline's attention-logit growth, an
optimizer-like blow-up or an unexplained loss spike is how that bias shows in training (the paper's failure), so the
rounding is the cause; an output-logit divergence is not the attention's and comes first.
Where the timeline is quiet (monitored, no instability, no alarm, no loss spike) and the bias found does not compound
(rank1-sim), the run is healthy: the diagnosis says so first ("no-instability"), names the bias with its size and
uncertainty, where it lives and whether the paper's tied-maximum mechanism explains it (pv-trace's P̄ = 1 share,
fix-check's stabilized softmax), and what to watch; the fixes follow as what to do should it start to matter.
The first action is the one that helps: where the kernels without the fix remove the bias as well, it is fp32 P̄V
accumulation, not the fix; a fix is quoted only where fix-check found a bias to remove.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from fa_forensics.analyses.wording import finite, number, share_with_se
from fa_forensics.analyses.significance import PARTIAL_SHARE
from fa_forensics.report.conclusions import (
    Claim, CompoundingConclusion, Conclusion, FixConclusion, Fp8Conclusion, MechanismConclusion, RepairConclusion,
    ReplayConclusion, TimelineConclusion, ROUNDING_SECTIONS,
)

ROUNDING = "biased-rounding"
FP8 = "fp8-p-collapse"
CANNOT_TELL = "cannot-tell"
NONE = "none"
NO_INSTABILITY = "no-instability"  # a healthy monitored run whose rounding shows a bias to watch
# timeline mechanisms that biased rounding in a low-precision run explains (its failure shows as these)
SHOWS_ROUNDING = ("attention-logit-growth", "attention-entropy-collapse", "optimizer-blow-up", "loss-spike")


@dataclass(frozen=True)
class Action:
    """One thing to do, with its measured effect."""

    what: str
    effect: str


@dataclass(frozen=True)
class Cause:
    """One mechanism with evidence: what it is, where, its evidence sentence, which sections concluded it."""

    mechanism: str  # ROUNDING | FP8 | a timeline mechanism | CANNOT_TELL | NONE
    name: str  # in words
    evidence: str  # a sentence with its numbers
    sections: tuple[str, ...]


@dataclass(frozen=True)
class Diagnosis:
    """What is wrong with this run (the first cause) and what to do (the first action helps)."""

    cause: Cause
    others: tuple[Cause, ...]  # other mechanisms with evidence
    actions: tuple[Action, ...]
    headline: str  # the whole diagnosis in one sentence group: the start of the one-line verdict
    fp32_run: bool
    lead: str = ""  # the card's first line: what is wrong, what to do (the evidence follows in `because`)
    because: str = ""  # the evidence of the named cause, and the other causes


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _share(x: float) -> str:
    return share_with_se(x, None)


def _rounding_cause(rounding: dict[str, Conclusion], rank1: Optional[CompoundingConclusion]) -> Optional[Cause]:
    found = {n: c for n, c in rounding.items() if c.found and c.claim is not None}
    if not found:
        return None
    o = next((c.claim for c in found.values() if c.claim.quantity == "O"), None)
    delta = next((c.claim for c in found.values() if c.claim.quantity == "delta"), None)
    main = o or delta
    where = f"layer {main.layer} head {main.head}" + (f" feature {o.feature}" if o is not None and o.feature
                                                       is not None else "")
    parts = []
    if o is not None:
        rows = " in the rows whose maximum repeats" if o.subset == "tied rows" else ""
        parts.append(f"the low-precision attention output comes out too {'high' if o.sign > 0 else 'low'} on average"
                     f"{rows} (O {'+' if o.sign > 0 else '−'}: {number(o.value, '+.3g')} ± {number(o.se, '.2g')}, "
                     f"{number(o.effect, '.2g')} of a rounding unit, Holm p {number(o.adjusted_p, '.2g')})")
    if delta is not None:
        text = (f"the error reaches the W_Q gradient (Σδ {'+' if delta.sign > 0 else '−'}: "
                f"{number(delta.value, '+.3g')} ± {number(delta.se, '.2g')} {delta.at_steps})")
        if rank1 is not None and rank1.trend == "compounds":
            text += f" and compounds over the captured steps (rank1-sim, exponent {number(rank1.exponent, '.2f')})"
        elif rank1 is not None and rank1.trend:
            text += (f"; rank1-sim finds it {rank1.trend} over the captured steps (exponent "
                     f"{number(rank1.exponent, '.2f')})")
        parts.append(text)
    return Cause(ROUNDING, f"biased rounding in P̄V at {where}", "; ".join(parts), tuple(found))


def _effect(c: Claim) -> str:
    """'0.059 ± 0.012 of a rounding unit' (the effect's se scaled from the bias's)."""
    effect_se = c.effect * c.se / abs(c.value) if finite(c.effect) and finite(c.se) and c.value else math.nan
    return (f"{number(c.effect, '.2g')} ± {number(effect_se, '.2g')}" if finite(effect_se)
            else number(c.effect, '.2g')) + " of a rounding unit"


def _size(c: Claim) -> str:
    """'O −: -3.07e-05 ± 6.1e-06, 0.059 ± 0.012 of a rounding unit, Holm p 0.00088'."""
    name = "O" if c.quantity == "O" else "Σδ"
    return (f"{name} {'+' if c.sign > 0 else '−'}: {number(c.value, '+.3g')} ± {number(c.se, '.2g')}, {_effect(c)}, "
            f"Holm p {number(c.adjusted_p, '.2g')}")


def mechanism_text(pv: Optional[MechanismConclusion], fc: Optional[FixConclusion]) -> tuple[Optional[bool], str]:
    """(whether the paper's tied-maximum (P̄ = 1) mechanism explains the O bias: True, False or None (not shown), its
    evidence: 'pv-trace: rows with P̄ = 1 carry 12% ± 7% of it; fix-check: the stabilized softmax, which leaves no
    P̄ = 1, removes 4% of it'). It explains the bias where the stabilized softmax removes it (fix-check) or the rows
    with P̄ = 1 carry most of it (pv-trace); it does not where what was measured of the two is below half."""
    share = pv.p_one_share if pv is not None and pv.ran else math.nan
    se = pv.p_one_se if pv is not None else math.nan
    fixed = fc.fixed_share if fc is not None and fc.has_bias else math.nan
    said = []
    if finite(share):
        said.append(f"pv-trace: rows with P̄ = 1 carry {share_with_se(share, se)} of it")
    if finite(fixed):
        said.append(f"fix-check: the stabilized softmax, which leaves no P̄ = 1, removes {_share(fixed)} of it")
    evidence = "; ".join(said)
    if (fc is not None and fc.has_bias and fc.outcome == "removed") or (finite(share) and share - 2 * se >= 0.5):
        return True, evidence
    low_share = finite(share) and share + 2 * se < PARTIAL_SHARE
    low_fix = finite(fixed) and fixed < PARTIAL_SHARE and fc is not None and fc.outcome == "remains"
    if (low_share or not finite(share)) and (low_fix or not finite(fixed)) and (low_share or low_fix):
        return False, evidence
    return None, evidence


def _no_instability(tl: TimelineConclusion, rounding: dict[str, Conclusion], pv: Optional[MechanismConclusion],
                    fc: Optional[FixConclusion]) -> tuple[Cause, str, str]:
    """A healthy monitored run whose rounding shows a bias: (its cause, the card's first line: the run first, then the
    bias as what it is and whether the paper's mechanism explains it, what to watch; the evidence)."""
    c = watched_claim(rounding)
    where = f"layer {c.layer} head {c.head}" + (f" feature {c.feature}" if c.feature is not None else "") + (
        f" step {c.step}" if c.quantity == "delta" and c.step is not None else "")
    rows = " in the rows whose maximum repeats" if c.subset == "tied rows" else ""
    explains, evidence = mechanism_text(pv, fc) if c.quantity == "O" else (None, "")
    steps = f"{tl.monitored} step{'s' if tl.monitored != 1 else ''}"
    size = _effect(c)
    what = {True: "is the paper's tied-maximum mechanism", False: "is not the paper's tied-maximum mechanism",
            None: "; whether the paper's tied-maximum mechanism explains it is not shown"}[explains]
    lead = (f"No instability in this run: its monitored timeline is quiet over {steps} (no alarm, no loss spike). "
            f"A small rounding bias at {where}{rows} ({size}){'' if explains is None else ' '}{what}"
            + (f" ({evidence})" if evidence else "")
            + f". Nothing to act on while the run is healthy: watch layer {c.layer} head {c.head}.")
    because = (f"Evidence: the timeline shows no attention-logit growth, entropy collapse, output-logit drift or loss "
               f"spike over {steps}; the bias: {_size(c)}. What to watch: {watch_text(c)}.")
    cause = Cause(NO_INSTABILITY, f"no instability in the monitored timeline over {steps}",
                  f"a small rounding bias at {where}{rows} ({_size(c)}){'' if explains is None else ' '}{what}",
                  ("timeline", *(n for n, x in rounding.items() if x.found)))
    return cause, lead, because


def watched_claim(rounding: dict[str, Conclusion]) -> Claim:
    """The bias a healthy run's card names and says to watch: the O claim where one is found, else the first found."""
    found = [c.claim for c in rounding.values() if c.found and c.claim is not None]
    return next((x for x in found if x.quantity == "O"), found[0])


def watch_text(c: Claim) -> str:
    """What to watch for a bias on a healthy run: its head's timeline series and the W_Q gradient on later steps."""
    later = ("whether its Σδ keeps its sign on later captures" if c.quantity == "delta"
             else "whether Σδ becomes significant on later captures")
    return (f"layer {c.layer} head {c.head}'s max logit, repeated maxima and W_Q spectral norm in the timeline (train "
            f"with --alarm so that a jump records the next steps in full), and {later}")


def _fp8_cause(pcast: Optional[Fp8Conclusion]) -> Optional[Cause]:
    if pcast is None or not pcast.found:
        return None
    lost = [h for h in pcast.heads if finite(h.get("mass_zeroed"))]
    worst = max(lost, key=lambda h: h["mass_zeroed"]) if lost else None
    mass = f", up to {worst['mass_zeroed']:.2%} of the probability mass" if worst else ""
    if worst and worst.get("mass_ci"):
        mass += f" (95 % interval {worst['mass_ci'][0]:.2%} to {worst['mass_ci'][1]:.2%})"
    return Cause(FP8, f"FP8 P-collapse in {len(pcast.heads)} of {pcast.n_heads} heads ({pcast.where})",
                 f"an FP8 kernel's default P cast (E4M3, S = 1) silently zeroes their small probabilities{mass} "
                 "(pcast)", ("pcast",))


def _timeline_cause(tl: Optional[TimelineConclusion]) -> Optional[Cause]:
    if tl is None or not tl.found:
        return None
    where = f" in {tl.where}" if tl.where else ""
    when = f" from step {tl.step}" if tl.step is not None else ""
    return Cause(tl.mechanism, f"{tl.name}{where}{when}", tl.summary, ("timeline",))


def rounding_actions(fc: Optional[FixConclusion], iso: Optional[RepairConclusion], when: str = "") -> list[Action]:
    """What removes the rounding bias, the action that helps first; a fix only where fix-check found a bias. `when`:
    the condition the actions wait for (a healthy run's), said before each action that changes the attention."""
    out: list[Action] = []
    cautions: list[Action] = []
    fp32_pv = False
    if fc is not None and fc.has_bias:
        settings = f"beta={number(fc.beta, 'g')}, eps={number(fc.eps, 'g')}"
        if fc.collapse:
            cautions.append(Action(f"Do not use the stabilized softmax with this row-sum floor (β = "
                                   f"{number(fc.beta, 'g')})", fc.collapse))
        elif fc.deployed_removes and fc.control_removes:
            out.append(Action("Keep the P̄V product and its accumulator in fp32",
                              f"the kernels of fa_forensics.stable_attention without the fix (plain_attention) "
                              f"remove {_share(fc.control_share)} of the bias as deployed (fix-check): their fp32 "
                              "P̄V accumulator is what helps here"))
            fp32_pv = True
            if fc.outcome == "removed":
                out.append(Action(f"Or use the stabilized softmax (Algorithm 3, {settings}) in this kernel",
                                  f"fix-check: it removes {_share(fc.fixed_share)} of the bias in this dump's kernel"))
        elif fc.deployed_removes:
            out.append(Action(f"Replace the attention by fa_forensics.stable_attention(q, k, v, {settings})",
                              f"it removes {_share(fc.deployed_share)} of the bias as deployed, and its kernels "
                              f"without the fix (plain_attention) do not ({_share(fc.control_share)}; fix-check)"))
        elif fc.outcome == "removed":
            out.append(Action(f"Use the stabilized softmax (Algorithm 3, {settings}) in this kernel",
                              f"fix-check: it removes {_share(fc.fixed_share)} of the bias"))
        elif fc.outcome == "inconclusive":
            cautions.append(Action("Capture more steps or batch rows before choosing a fix",
                                   f"fix-check cannot tell yet: the fix removes {_share(fc.fixed_share)} of the bias "
                                   "and what is left is not significant either"))
        if fc.outcome in ("remains", "fails") and not fc.collapse:
            cautions.append(Action("The stabilized softmax alone is not enough here (fix-check exits 1)",
                                   f"it removes {_share(fc.fixed_share)} of the bias in this dump's kernel"))
    if iso is not None and iso.action and not fp32_pv:
        name = "pv-fp32" if "pv-fp32" in iso.culprits else "o-fp32"
        share = next((r.value for r in iso.repairs if r.name == name), float("nan"))
        out.append(Action(_cap(iso.action) + (" (P̄V, accumulator, stored O)" if name == "o-fp32" else ""),
                          f"isolate's {name} repair removes {_share(share)} of the Σδ bias"))
    out += cautions
    return [Action(when + a.what[:1].lower() + a.what[1:], a.effect) for a in out] if when else out


def _cannot_tell(replay: ReplayConclusion, tl: Optional[TimelineConclusion], untested: tuple[str, ...],
                 ran: list[str]) -> Optional[Cause]:
    if replay.too_few_bits and not replay.fp32_run:
        return Cause(CANNOT_TELL, "cannot tell",
                     f"the replayed recipe ({replay.preset}) reproduces only {100 * replay.o_bits_equal:.1f} % of the "
                     "stored O bits, so the rounding findings describe another kernel than the one that trained",
                     ("replay fidelity",))
    if tl is not None and tl.alarms and not tl.found:
        steps = sorted({a.get("step") for a in tl.alarms if a.get("step") is not None})
        shown = ", ".join(map(str, steps[:6])) + (f" and {len(steps) - 6} more" if len(steps) > 6 else "")
        return Cause(CANNOT_TELL, "cannot tell",
                     f"the monitor raised {len(tl.alarms)} alarm{'s' if len(tl.alarms) != 1 else ''} (step"
                     f"{'s' if len(steps) != 1 else ''} {shown}), but neither the timeline nor the captured steps show "
                     "a mechanism", ("timeline",))
    if not ran:
        return Cause(CANNOT_TELL, "cannot tell", "no analysis could run on this dump (see the notes below)", ())
    return None


def diagnose(by_name: dict[str, Conclusion], replay: ReplayConclusion) -> Diagnosis:
    """The diagnosis from the sections' conclusions (report.conclusions.conclusions) and the replay's fidelity."""
    rounding = {n: c for n, c in by_name.items() if n in ROUNDING_SECTIONS and c.ran}
    rank1 = by_name.get("rank1-sim") if isinstance(by_name.get("rank1-sim"), CompoundingConclusion) else None
    tl = by_name.get("timeline") if isinstance(by_name.get("timeline"), TimelineConclusion) else None
    pcast = by_name.get("pcast") if isinstance(by_name.get("pcast"), Fp8Conclusion) else None
    fc = by_name.get("fix-check") if isinstance(by_name.get("fix-check"), FixConclusion) else None
    iso = by_name.get("isolate") if isinstance(by_name.get("isolate"), RepairConclusion) else None
    pv = by_name.get("pv-trace") if isinstance(by_name.get("pv-trace"), MechanismConclusion) else None
    untested = tuple(n for n, c in by_name.items() if not c.ran)
    ran = [n for n, c in by_name.items() if c.ran]
    fp32 = replay.fp32_run
    trusted = not replay.too_few_bits
    instability = _timeline_cause(tl)
    rounding_cause = _rounding_cause(rounding, rank1) if not fp32 and trusted else None
    fp8 = _fp8_cause(pcast) if not fp32 else None
    causes: list[Cause] = []
    healthy = (rounding_cause is not None and instability is None and tl is not None and tl.quiet
               and not (rank1 is not None and rank1.trend == "compounds"))
    quiet_lead = ("", "")
    if healthy:
        quiet, *quiet_lead = _no_instability(tl, rounding, pv, fc)
        causes = [quiet, rounding_cause]
    elif rounding_cause is not None and (instability is None or instability.mechanism in SHOWS_ROUNDING):
        causes = [rounding_cause, *([instability] if instability else [])]
    else:
        causes = [c for c in (instability, rounding_cause) if c is not None]
    if fp8 is not None:
        causes.append(fp8)
    actions: list[Action] = []
    for cause in causes:
        if cause.mechanism == NO_INSTABILITY:
            watch = watch_text(watched_claim(rounding))
            actions.append(Action(f"Nothing to act on while the run is healthy; watch {watch}",
                                  "the timeline shows no instability, and the bias is small (its size and "
                                  "uncertainty are in the first line)"))
        elif cause.mechanism == ROUNDING and healthy:
            actions += rounding_actions(fc, iso, "Should it start to matter (an alarm, or a significant Σδ): ")
        elif cause.mechanism == ROUNDING:
            actions += rounding_actions(fc, iso)
        elif cause.mechanism == FP8:
            actions.append(Action(f"If attention runs in FP8: {pcast.action}",
                                  "pcast: the recommended setting keeps the probability mass the default cast drops, "
                                  "at the lowest MSE within its noise"))
        elif tl is not None and cause.mechanism == tl.mechanism:
            actions.append(Action(_cap(tl.action), f"the remedy for {tl.name} (timeline, from step {tl.step})"))
    if tl is not None and tl.alarms and ran == ["timeline"]:
        steps = sorted({a.get("step") for a in tl.alarms if a.get("step") is not None})
        actions.append(Action(f"Capture the steps the monitor flagged ({', '.join(map(str, steps[:6]))}) in full",
                              "this dump holds only the timeline, so no step could be analysed"))
    if causes:
        cause, others = causes[0], tuple(causes[1:])
    else:
        cause = _cannot_tell(replay, tl, untested, ran) or Cause(NONE, "nothing wrong found", "", ())
        others = ()
    headline, lead, because = _headline(cause, others, actions, fp32, untested, tl,
                                        len(pcast.borderline) if pcast is not None else 0)
    if cause.mechanism == NO_INSTABILITY:
        also = "".join(f" Also: {o.name}." for o in others if o.mechanism != ROUNDING)
        lead, because = quiet_lead[0] + also, quiet_lead[1]
        headline = f"{lead} {because}"
    if tl is not None and tl.quiet and "no instability" not in headline.lower():
        because = (f"{because} The timeline shows no instability over {tl.monitored} monitored steps (no alarm, no "
                   "loss spike).").strip()
    return Diagnosis(cause, others, tuple(actions), headline, fp32, lead, because)


def _headline(cause: Cause, others, actions, fp32: bool, untested, tl, borderline: int = 0) -> tuple[str, str, str]:
    """(the whole diagnosis, its first line: what is wrong and what to do, the evidence behind it)."""
    fp32_note = " This run trained in fp32: its attention's rounding is not the cause." if fp32 else ""
    if cause.mechanism == CANNOT_TELL:
        what = {"replay fidelity": " What to do: find the recipe that reproduces the kernel (`fa-forensics match`; a "
                                   "custom kernel needs a kernel model) before acting on any rounding finding.",
                "timeline": " What to do: look at the timeline's figures around the alarms."}.get(
            cause.sections[0] if cause.sections else "", " What to do: see the notes below.")
        text = f"Cannot tell: {cause.evidence}.{what}{fp32_note}"
        return text, text, ""
    if cause.mechanism == NONE:
        if fp32:
            seen = ("no instability in its timeline" if tl is not None else
                    "it recorded no timeline, so a training instability could not be seen (capture with "
                    "--monitor-every 1 to watch one)")
            text = (f"Nothing wrong found: this run trained in fp32, so its attention has no low-precision rounding "
                    f"to go wrong; {seen}.")
        elif untested:
            names = ", ".join(untested[:-1]) + (" and " if len(untested) > 1 else "") + untested[-1]
            text = (f"Nothing wrong found in what could be tested: no significant biased rounding; {names} could not "
                    "run on this dump (see the notes below).")
        else:
            text = "Nothing wrong found: no significant biased rounding, no FP8 P-collapse" + (
                ", no instability in the timeline" if tl is not None else "") + ": nothing to fix."
        if borderline and not fp32:
            text += (f" pcast cannot tell {borderline} head{'s' if borderline != 1 else ''} from its FP8 P-collapse "
                     "floor (borderline; its section says which).")
        return text, text, ""
    if cause.mechanism == NO_INSTABILITY:  # its lines are composed by `_no_instability`
        return "", "", ""
    todo = f" What to do: {actions[0].what[:1].lower() + actions[0].what[1:]}." if actions else ""
    also = "".join(f" Also: {o.name}." for o in others)
    what = _cap(cause.evidence) if cause.sections == ("timeline",) else f"{_cap(cause.name)}: {cause.evidence}"
    evidence = cause.evidence.split(": ", 1)[-1] if cause.sections == ("timeline",) else cause.evidence
    return (f"{what}.{todo}{also}{fp32_note}", f"{_cap(cause.name)}.{todo}{fp32_note}",
            f"Evidence: {evidence}.{also}")
