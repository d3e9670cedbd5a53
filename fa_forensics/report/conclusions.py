"""What each section concluded, as a typed value: one small adapter per section reads its JSON payload
(defensively: a missing key is a shorter conclusion, never an exception) into a frozen `Conclusion`.

The report's diagnosis (report.diagnosis) composes these and nothing else, so the card quotes only what a section
concluded: a fix's effect only where fix-check found a bias to remove, "compounds" only where rank1-sim said so,
the timeline's mechanism only as the timeline's diagnosis names it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from fa_forensics.analyses.wording import finite, number

ROUNDING_SECTIONS = ("isolate", "delta-bias", "bitdiff", "fix-check", "pv-trace")


def _int(x) -> Optional[int]:
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _float(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


@dataclass(frozen=True)
class Number:
    """One evidence number with its standard error (NaN: none) and what it is."""

    name: str
    value: float
    se: float = math.nan


@dataclass(frozen=True)
class Claim:
    """A section's bias claim (`analyses.quantities.BiasClaim` as its JSON writes it)."""

    quantity: str  # "delta" | "O"
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
    effect: float
    subset: str = "all rows"  # "all rows" | "tied rows": the rows the test that decided looked at
    unit: str = ""  # the independent unit of the test ('' where the section does not say)
    n_units: Optional[int] = None
    steps: tuple[int, ...] = ()  # Σδ: the steps its test pooled (one for a single step's item)

    @classmethod
    def read(cls, c) -> Optional[Claim]:
        if not isinstance(c, dict):
            return None
        steps = tuple(s for s in (_int(x) for x in c.get("steps") or []) if s is not None)
        return cls(str(c.get("quantity") or ""), bool(c.get("found")), _int(c.get("layer")), _int(c.get("head")),
                   _int(c.get("step")), _int(c.get("feature")), _int(c.get("sign")) or 0, _float(c.get("value")),
                   _float(c.get("se")), _float(c.get("p_value")), _float(c.get("adjusted_p")),
                   _int(c.get("n_tests")) or 0, _float(c.get("effect")), str(c.get("subset") or "all rows"),
                   str(c.get("unit") or ""), _int(c.get("n_units")), steps)

    @property
    def at_steps(self) -> str:
        """Where in time the claim was tested: 'at step 2', 'over steps 0..2' ('' when the section does not say)."""
        from fa_forensics.analyses.quantities import steps_text

        if len(self.steps) > 1:
            return f"over {steps_text(self.steps)}"
        return f"at step {self.step}" if self.step is not None else ""


@dataclass(frozen=True)
class Conclusion:
    """What one section concluded."""

    section: str
    ran: bool  # it produced its JSON
    why_not: str = ""  # why it could not run ('' when it ran)
    finding: str = ""  # what it concluded, one of the section's words (e.g. "bias", "no-bias", "compounds")
    found: bool = False  # it found something wrong with the run
    where: str = ""  # "layer 0 head 1 feature 44", '' when nothing was found
    numbers: tuple[Number, ...] = ()  # the evidence, each with its uncertainty
    action: str = ""  # the action it supports ('' none)
    claim: Optional[Claim] = None  # the bias claim of a rounding section


@dataclass(frozen=True)
class FixConclusion(Conclusion):
    """fix-check: whether there is a bias to remove, and what removes it in this dump's kernel and as deployed."""

    outcome: str = ""  # "removed" | "remains" | "fails" | "inconclusive" | "no-bias"
    has_bias: bool = False
    fixed_share: float = math.nan  # the stabilized softmax in this dump's kernel
    deployed_removes: bool = False  # stable_attention as deployed
    deployed_share: float = math.nan
    control_removes: bool = False  # plain_attention: the deployed kernels without the fix
    control_share: float = math.nan
    collapse: str = ""  # where the fix's row-sum floor collapses O under this preset ('' nowhere)
    beta: float = math.nan
    eps: float = math.nan


@dataclass(frozen=True)
class RepairConclusion(Conclusion):
    """isolate: the repairs that remove the Σδ bias, with the share each removes."""

    culprits: tuple[str, ...] = ()
    repairs: tuple[Number, ...] = ()  # (repair name, share of the bias it removes)


@dataclass(frozen=True)
class CompoundingConclusion(Conclusion):
    """rank1-sim: whether the W_Q gradient error compounds over steps (said only with a significant Σδ)."""

    trend: str = ""  # "compounds" | "washes out" | "in between" | '' (not interpreted)
    exponent: float = math.nan


@dataclass(frozen=True)
class MechanismConclusion(Conclusion):
    """pv-trace: the share of the O bias the paper's P̄ = 1 mechanism carries (its rows where P̄ = 1: tie, near-tie,
    carry), with its standard error (NaN: not measured)."""

    p_one_share: float = math.nan
    p_one_se: float = math.nan


@dataclass(frozen=True)
class Fp8Conclusion(Conclusion):
    """pcast: heads whose default FP8 P cast drops probability mass, with the setting that keeps it."""

    heads: tuple[dict, ...] = ()  # {step, layer, head, S, order, mass_zeroed, frac_zeroed}
    borderline: tuple[dict, ...] = ()  # heads in the decision's borderline band
    n_heads: int = 0


@dataclass(frozen=True)
class TimelineConclusion(Conclusion):
    """timeline: the instability its series show (analyses.timeline.diagnose) and the capture's alarms."""

    mechanism: str = ""  # InstabilityFinding.mechanism ('' when the payload has no diagnosis)
    name: str = ""
    step: Optional[int] = None
    summary: str = ""
    also: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    alarms: tuple[dict, ...] = ()
    monitored: int = 0  # monitored steps in the timeline
    loss_spike: Optional[int] = None  # the step of a loss spike the timeline's diagnosis saw (None: none)
    rule_alarms: int = 0  # alarms the alarm rule raises when replayed over the timeline

    @property
    def quiet(self) -> bool:
        """A healthy run as far as its timeline shows: monitored, no instability, no alarm (recorded or replayed), no
        loss spike."""
        return (self.ran and self.monitored > 0 and self.mechanism == "none" and not self.found and not self.alarms
                and not self.rule_alarms and self.loss_spike is None)


@dataclass(frozen=True)
class ReplayConclusion:
    """How well the replay reproduces the run, from the sections' `replay_fidelity`."""

    measured: bool  # some section measured it
    o_bits_equal: float  # NaN: not measured (fp32 run, dropout, no O)
    run_precision: str  # "fp32", "bf16", ... ('' unknown)
    preset: str
    mismatch_unbiased: bool  # the mismatches' sign test finds no bias
    unverifiable: tuple[str, ...] = ()

    @property
    def fp32_run(self) -> bool:
        return self.run_precision == "fp32"

    @property
    def too_few_bits(self) -> bool:
        """The replay reproduces too few of the kernel's bits for its findings to describe the run."""
        from fa_forensics.analyses.contract import FIDELITY_WARN_BELOW, MISMATCH_TEST_ABOVE

        if not finite(self.o_bits_equal) or self.o_bits_equal >= FIDELITY_WARN_BELOW:
            return False
        return not (self.o_bits_equal >= MISMATCH_TEST_ABOVE and self.mismatch_unbiased)


def _place(c: Optional[Claim]) -> str:
    if c is None or c.layer is None:
        return ""
    text = f"layer {c.layer} head {c.head}"
    if c.feature is not None:
        text += f" feature {c.feature}"
    if len(c.steps) > 1:
        text += f" {c.at_steps}"
    elif c.step is not None:
        text += f" step {c.step}"
    return text


def _claim_numbers(c: Optional[Claim]) -> tuple[Number, ...]:
    if c is None:
        return ()
    return (Number("bias" if c.quantity == "O" else "Σδ", c.value, c.se), Number("rounding units", c.effect),
            Number("p", c.p_value), Number("adjusted p", c.adjusted_p))


def _rounding(name: str, d: dict) -> Conclusion:
    c = Claim.read(d.get("bias"))
    found = bool(c and c.found)
    return Conclusion(name, True, finding="bias" if found else "no-bias", found=found,
                      where=_place(c) if found else "", numbers=_claim_numbers(c), claim=c)


def _isolate(d: dict) -> RepairConclusion:
    base = _rounding("isolate", d)
    culprits = tuple(str(x) for x in d.get("culprits") or [] if isinstance(x, str)) if base.found else ()
    repairs = tuple(Number(str(v.get("name")), _float(v.get("reduction"))) for v in d.get("variants") or []
                    if isinstance(v, dict) and v.get("name") in culprits)
    action = ("keep the P̄V product and its accumulator in fp32" if "pv-fp32" in culprits
              else "keep the whole O path in fp32" if "o-fp32" in culprits else "")
    return RepairConclusion(**_fields(base), culprits=culprits, repairs=repairs, action=action)


def _fields(c: Conclusion) -> dict:
    return {f: getattr(c, f) for f in Conclusion.__dataclass_fields__ if f != "action"}


def _fix_check(d: dict) -> FixConclusion:
    base = _rounding("fix-check", d)
    has_bias = bool(d.get("has_bias", base.found)) and base.found
    outcome = str(d.get("outcome") or ("no-bias" if not has_bias else ""))
    fixed, dep = _dict(d.get("fixed")), _dict(d.get("deployment"))
    c = _dict(d.get("collapse"))
    collapse = (f"the stabilized softmax collapses O in {c['rows']} row(s) (repeated maximum up to "
                f"{number(c.get('max_score'), '.4g')} > {number(c.get('threshold'), '.4g')}: the "
                f"{number(c.get('floor'), 'g')} row-sum floor takes over; fix-check)"
                if c.get("rows") and c.get("applies") else "")
    conclusion = FixConclusion(
        **{**_fields(base), "finding": outcome or base.finding, "found": has_bias}, outcome=outcome,
        has_bias=has_bias, fixed_share=_float(fixed.get("removed_share")), deployed_removes=bool(dep.get("removes")),
        deployed_share=_float(dep.get("removed_share")), control_removes=bool(dep.get("control_removes")),
        control_share=_float(dep.get("control_removed_share")), collapse=collapse, beta=_float(d.get("beta")),
        eps=_float(d.get("eps")))
    return conclusion


P_ONE_CLASSES = ("tie", "near-tie", "carry")  # pv-trace's classes of rows where P̄ = 1


def _pv_trace(d: dict) -> MechanismConclusion:
    base = _rounding("pv-trace", d)
    shares = [v for k, v in _dict(d.get("class_shares")).items() if k in P_ONE_CLASSES and isinstance(v, dict)
              and v.get("rows")]
    share = sum(_float(v.get("share")) for v in shares) if shares else math.nan
    se = math.sqrt(sum(_float(v.get("se")) ** 2 for v in shares)) if shares else math.nan
    return MechanismConclusion(**{**_fields(base), "action": base.action}, p_one_share=share, p_one_se=se)


def _rank1(d: dict) -> CompoundingConclusion:
    c = Claim.read(d.get("claim"))
    verdict = str(d.get("verdict") or "")
    trend = next((t for t in ("compounds", "washes out", "in between") if f"({t})" in verdict), "")
    if not (c is None or c.found):
        trend = ""
    found = bool(c and c.found)
    return CompoundingConclusion("rank1-sim", True, finding=trend or ("no-bias" if not found else "not measured"),
                                 found=found and trend == "compounds", where=_place(c) if found else "",
                                 numbers=(Number("accumulation exponent", _float(d.get("accumulation_exponent"))),),
                                 claim=c, trend=trend, exponent=_float(d.get("accumulation_exponent")))


def _pcast(d: dict) -> Fp8Conclusion:
    heads, borderline = [], []
    all_heads = [h for h in d.get("heads") or [] if isinstance(h, dict)]
    for h in all_heads:
        if str(h.get("verdict") or h.get("band") or "") == "borderline":
            borderline.append({"step": h.get("step"), "layer": h.get("layer"), "head": h.get("head")})
        if not h.get("needs_fix"):
            continue
        default = next((s for s in h.get("settings") or [] if isinstance(s, dict) and s.get("S") == 1.0
                        and s.get("order") == "forward"), {})
        heads.append({"step": h.get("step"), "layer": h.get("layer"), "head": h.get("head"),
                      "S": h.get("recommended_S"), "order": h.get("recommended_order"),
                      "mass_zeroed": default.get("mass_zeroed"), "frac_zeroed": default.get("frac_zeroed"),
                      "mass_ci": _interval(h.get("lost_mass_ci"))})
    where = ", ".join(f"layer {h['layer']} head {h['head']}" for h in heads)
    settings = "; ".join(sorted({f"{h.get('order')} S={h.get('S'):g}" if finite(h.get("S")) else str(h.get("order"))
                                 for h in heads}))
    return Fp8Conclusion("pcast", True, finding="p-collapse" if heads else "no-collapse", found=bool(heads),
                         where=where, numbers=tuple(Number(f"mass zeroed, layer {h['layer']} head {h['head']}",
                                                           _float(h.get("mass_zeroed"))) for h in heads),
                         action=f"scale P by S before its E4M3 cast ({settings})" if heads else "",
                         heads=tuple(heads), borderline=tuple(borderline), n_heads=len(all_heads))


def _interval(x) -> Optional[tuple[float, float]]:
    """(low, high) from a JSON pair of finite numbers, else None."""
    if isinstance(x, (list, tuple)) and len(x) == 2 and all(finite(v) for v in x):
        return float(x[0]), float(x[1])
    return None


def _timeline(d: dict) -> TimelineConclusion:
    diag = _dict(d.get("diagnosis"))
    alarms = [a for a in d.get("alarms") or [] if isinstance(a, dict)] or \
        [{"step": s} for s in d.get("alarm_steps") or [] if isinstance(s, (int, float))]
    mechanism = str(diag.get("mechanism") or "")
    found = bool(diag.get("found")) and mechanism not in ("", "none", "no-evidence")
    evidence = _dict(diag.get("evidence"))
    layer, head = _int(diag.get("layer")), _int(diag.get("head"))
    return TimelineConclusion(
        "timeline", True, finding=mechanism or ("alarms" if alarms else ""), found=found,
        where=(f"layer {layer} head {head}" if layer is not None else "") if found else "",
        numbers=tuple(Number(str(k), _float(v)) for k, v in evidence.items()),
        action=str(diag.get("action") or "") if found else "", mechanism=mechanism, name=str(diag.get("name") or ""),
        step=_int(diag.get("step")), summary=str(diag.get("summary") or ""),
        also=tuple(str(x) for x in diag.get("also") or []), missing=tuple(str(x) for x in diag.get("missing") or []),
        alarms=tuple(alarms), monitored=len(d.get("steps") or []), loss_spike=_int(diag.get("loss_spike_step")),
        rule_alarms=len(d.get("rule_alarms") or []))


ADAPTERS = {"isolate": _isolate, "delta-bias": lambda d: _rounding("delta-bias", d),
            "bitdiff": lambda d: _rounding("bitdiff", d), "pv-trace": _pv_trace,
            "fix-check": _fix_check, "rank1-sim": _rank1, "pcast": _pcast, "timeline": _timeline}


def conclude(section) -> Conclusion:
    """The conclusion of one section (any object with `name`, `data` (its JSON payload or None) and `note`)."""
    if section.data is None:
        return Conclusion(section.name, False, why_not=str(getattr(section, "note", "") or "no result"))
    adapter = ADAPTERS.get(section.name)
    return adapter(section.data) if adapter is not None else Conclusion(section.name, True)


def conclusions(sections) -> dict[str, Conclusion]:
    """{section name: its conclusion}, in the sections' order."""
    return {s.name: conclude(s) for s in sections}


def replay(sections) -> ReplayConclusion:
    """The replay's fidelity as the first section that measured it says, and the run's precision."""
    run_precision, preset = "", ""
    for s in sections:
        fid = _dict(None if s.data is None else s.data.get("replay_fidelity"))
        if not fid:
            continue
        run_precision = run_precision or str(fid.get("run_precision") or "")
        preset = preset or str(fid.get("preset") or "")
        share = fid.get("o_bits_equal")
        if finite(share):
            mismatch = _dict(fid.get("mismatch"))
            return ReplayConclusion(True, float(share), run_precision, preset,
                                    bool(mismatch) and not mismatch.get("biased"),
                                    tuple(str(u.get("reason")) for u in fid.get("unverifiable") or []
                                          if isinstance(u, dict)))
    return ReplayConclusion(False, math.nan, run_precision, preset, False)
