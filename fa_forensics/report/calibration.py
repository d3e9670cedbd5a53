"""The claims the report makes on one dump, counted: what the false-alarm benchmark measures.

`alarms` runs the report's sections as the report runs them (`report.run`: the recipe "auto", every option at its
default, the same selection) without drawing their figures, composes the report's verdict from them with the
report's own function (`report.verdict.build_verdict`: the sections' conclusions and the diagnosis), and says what
each claims: each section's `found` (its conclusion, `report.conclusions`), fix-check's exit code 1, the O and Σδ
claims of the verdict's evidence, and the card: the cause the diagnosis names. On a null dump
(`analyses.calibration`) a card that names biased rounding (or any mechanism but FP8 P-collapse) is false; FP8
P-collapse is counted apart, since sink and previous-token heads really lose probability mass to the E4M3 cast
(pcast's claim is false only on a plain N(0, 1) head: `pcast, plain heads`); "cannot tell" is no claim, counted
apart. Whatever claims the sections and the diagnosis make, they are counted through this one path.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# what `alarms` counts beside each section's `found`
FIX_EXIT_1 = "fix-check exit 1"
O_CLAIM = "O claim"
DELTA_CLAIM = "Σδ claim"
CARD = "card"
CARD_FP8 = "card: FP8 P-collapse"
CARD_CANNOT_TELL = "card: cannot tell"
PCAST_PLAIN = "pcast, plain heads"
NOT_RUN = "a section could not run"
ANY = "any bias claim"
NOT_FALSE = (CARD_FP8, CARD_CANNOT_TELL, "pcast", NOT_RUN)  # counted, but not false alarms on these families


@dataclass(frozen=True)
class SectionRun:
    """One section as the report ran it: what `report.verdict.build_verdict` and `report.conclusions` read."""

    name: str
    data: Optional[dict]  # its JSON payload (None: it could not run)
    note: str = ""


def run_sections(dump, analyses: Optional[tuple[str, ...]] = None) -> list[SectionRun]:
    """The report's sections on `dump` (all of those the report runs on it, or the named ones), each run as
    `run.run_section` runs it (`run.section_selections`), without figures or files."""
    from fa_forensics.analyses.jsonable import to_jsonable
    from fa_forensics.analyses.registry import BY_NAME
    from fa_forensics.enums import Backend
    from fa_forensics.errors import UserError
    from fa_forensics.fidelity.recipe import Recipe
    from fa_forensics.layers.fanout import Workers
    from fa_forensics.report.run import SECTIONS, section_selections, sections_of, steps_that_matter

    wanted = SECTIONS if analyses is None else [BY_NAME[name] for name in analyses]
    selection = {"step": None, "layer": None, "head": None, "steps": steps_that_matter(dump)[0]}
    out = []
    for section in sections_of(dump, wanted):
        try:
            sels = section_selections(section, dump, selection)
            result = section.report_run(dump, sels, Recipe(), Backend.EMULATE, Workers())
            out.append(SectionRun(section.name, to_jsonable(section.payload(result))))
        except UserError as exc:
            out.append(SectionRun(section.name, None, str(exc)))
        except Exception as exc:  # as in the report: a bug in one section costs only that section
            out.append(SectionRun(section.name, None, f"unexpected {type(exc).__name__}: {exc}"))
    return out


def claims(sections: list[SectionRun], truth: Optional[dict] = None) -> dict[str, bool]:
    """What the report says on these sections: {section: its conclusion's `found`, "fix-check exit 1", "O claim",
    "Σδ claim" (the verdict's evidence), "card" (the diagnosis names a cause other than FP8 P-collapse),
    "card: FP8 P-collapse", "card: cannot tell", "any bias claim", "a section could not run"}; with the dump's
    ground truth `truth`, also "pcast, plain heads" (pcast says a plain N(0, 1) head needs a fix)."""
    from fa_forensics.report import diagnosis as dx
    from fa_forensics.report.conclusions import conclusions
    from fa_forensics.report.verdict import build_verdict

    concluded = conclusions(sections)
    verdict = build_verdict(sections)
    out = {name: bool(c.found) for name, c in concluded.items()}
    fix = next((s for s in sections if s.name == "fix-check"), None)
    if fix is not None:
        out[FIX_EXIT_1] = bool(fix.data) and fix.data.get("exit_code") == 1
    out[O_CLAIM] = any(e.found for e in verdict.evidence if e.quantity == "O")
    out[DELTA_CLAIM] = any(e.found for e in verdict.evidence if e.quantity == "delta")
    causes = verdict.causes or (verdict.cause,)
    out[CARD] = any(c not in (dx.FP8, dx.NONE, dx.CANNOT_TELL) for c in causes)
    out[CARD_FP8] = dx.FP8 in causes
    out[CARD_CANNOT_TELL] = verdict.cause == dx.CANNOT_TELL
    pcast = next((s for s in sections if s.name == "pcast"), None)
    if pcast is not None and truth is not None:
        special = {*truth.get("planted_heads", ()), *truth.get("sink_heads", ()),
                   *truth.get("previous_token_heads", ())}
        out[PCAST_PLAIN] = any(h.get("needs_fix") and h.get("head") not in special
                               for h in (pcast.data or {}).get("heads") or [])
    out[ANY] = any(v for k, v in out.items() if k not in (*NOT_FALSE, PCAST_PLAIN))
    out[NOT_RUN] = any(s.data is None for s in sections)
    return out


def alarms(path: Path, analyses: Optional[tuple[str, ...]] = None) -> dict[str, bool]:
    """`claims` of the report's sections (all, or the named ones) on the dump at `path`."""
    from fa_forensics.dump import open_dump

    dump = open_dump(path)
    return claims(run_sections(dump, analyses), dump.ground_truth)
