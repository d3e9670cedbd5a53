"""Run every analysis on one dump for the report, through the library, and collect what each gave.

The sections are the registered analyses (fa_forensics.analyses.registry) that have one. Each runs its
compute with the report's selection and recipe and its own options' defaults, then gives its payload (the
same dict the command writes with --json), its tables and its figures, into DIR/<name>/. An analysis
that fails with a user error (e.g. the dump has no dO) becomes a note in the report instead of stopping
it; fix-check's exit code 1 ("the fix does not remove the bias") is a result, not a failure.

The timeline section (the monitor's per-step statistics and the capture's alarms) comes first when the
dump has a timeline and is left out when it has none; on a dump that holds only a timeline, the step
analyses are skipped with a note.

Steps analysed: the given --step, else every complete step of a dump without a timeline. On a monitored
run the steps that matter (`steps_that_matter`): the recorded step(s) nearest the capture's first alarm
(`NEAR_ALARM`; the ring holds the alarm's own) and the step where the loss blows up after it (the spike),
when the dump holds them; the timeline section says which, and why.

The report's recipe (default preset "auto") is the low-precision side of every analysis that
replays one against fp32 (isolate, delta-bias, rank1-sim, pv-trace, fix-check) and bitdiff's side
A (B = fp32); pcast keeps its own fp8 settings and studies the last complete step. With `workers`
(fanout.Workers) the replaying analyses fan their work items out on one cluster, started once for
the whole report.
"""
from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console

from fa_forensics.analyses.jsonable import to_jsonable
from fa_forensics.layers.fanout import Workers, connected
from fa_forensics.enums import Backend
from fa_forensics.fidelity.recipe import Recipe
from fa_forensics.analyses.registry import BY_NAME, REPORTED, Analysis
from fa_forensics.layers.selection import select
from fa_forensics.dump.safe_files import atomic_write, is_no_space
from fa_forensics.errors import UserError

REPORT_TEXT_WIDTH = 160  # columns of the tables embedded in the page
NO_STEP_NOTE = ("skipped: this dump records no step in full, only the monitor's timeline; capture steps with "
                "--steps (or with --alarm, the steps around an alarm) to analyse them")


NEAR_ALARM = 1  # recorded steps nearest the first alarm that the step analyses look at by default (the ring holds it)
ALL_STEPS_UP_TO = 8  # a monitored run without an alarm or a loss blow-up: up to this many stored steps are all analysed


def steps_that_matter(dump) -> tuple[Optional[list[int]], str]:
    """The steps a report of a monitored run analyses by default, and why in words; (None, '') for every step
    (a dump without a timeline, one that holds no more steps than would be chosen, or a run with neither an alarm nor
    a loss blow-up that stores at most `ALL_STEPS_UP_TO` steps)."""
    from fa_forensics.monitor.alarm import recorded_alarms

    steps = list(dump.steps)
    timeline = dump.timeline if steps else None
    if timeline is None or len(steps) <= NEAR_ALARM + 1:
        return None, ""
    alarms = recorded_alarms(timeline)
    chosen, why = [], []
    if alarms:
        first = alarms[0]["step"]
        near = sorted(steps, key=lambda s: (abs(s - first), s > first))[:NEAR_ALARM]
        chosen += near
        why.append(f"{_listed(sorted(near))} around the capture's first alarm (step {first})")
        after = [s for s in steps if s > first and s not in chosen]
    else:
        after = list(steps)
    spike, what, blew_up = _spike(timeline, after, alarms[0]["step"] if alarms else None)
    if not alarms and not blew_up and len(steps) <= ALL_STEPS_UP_TO:
        return None, ""  # a quiet run with few stored steps: every one of them is cheap enough to analyse
    if spike is not None:
        chosen.append(spike)
        why.append(f"step {spike}, {what}")
    if not chosen:
        return None, ""
    return sorted(set(chosen)), (f"the step analyses look at {'; '.join(why)}, of the {len(steps)} steps in the "
                                 "dump; --step N analyses another")


def check_selection(dump, step=None, layer=None, head=None) -> None:
    """DumpError (one line) for a step, layer or head the dump lacks, before any analysis runs; on a monitored run
    without a step, only the steps `steps_that_matter` picks are read (screening every stored step's inputs
    would cost minutes on a run with many)."""
    chosen = steps_that_matter(dump)[0] if step is None else None
    for one in chosen or [step]:
        select(dump, one, layer, head)


def _spike(timeline: dict, candidates: list[int], since: Optional[int]) -> tuple[Optional[int], str, bool]:
    """The recorded step where the loss blows up, how it was found, and whether it blew up: the first candidate at
    or after the loss spike the diagnosis finds (`analyses.timeline.diagnose.loss_spike`, after `since`); without
    one, the candidate with the highest loss."""
    import numpy as np

    from fa_forensics.analyses.timeline.diagnose import loss_spike

    steps = np.asarray(timeline.get("step", []))
    loss = np.asarray(timeline.get("loss", np.full(len(steps), np.nan)), dtype=np.float64)
    if not candidates or len(steps) == 0 or not np.isfinite(loss).any():
        return None, "", False
    start = 1 if since is None else int(np.searchsorted(steps, since, side="right"))
    i = loss_spike(loss, start)
    if i is not None:
        later = [c for c in candidates if c >= steps[i]]
        if later:
            return later[0], f"where the loss blows up (step {int(steps[i])}: {loss[i]:.4g})", True
    known = {int(s): v for s, v in zip(steps, loss) if int(s) in set(candidates) and np.isfinite(v)}
    if not known:
        return None, "", False
    top = max(known, key=known.get)
    return top, f"the highest loss {'after it' if since is not None else 'recorded'} ({known[top]:.4g})", False


def _listed(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))


# The report's sections: every registered analysis that has one, in the registry's order.
SECTIONS: list[Analysis] = list(REPORTED)
ANALYSES = [s.name for s in SECTIONS]


@dataclass(frozen=True)
class SectionResult:
    """What one analysis produced."""

    name: str
    args: list[str]  # the equivalent command line
    exit_code: int  # what the command would exit with: 0, 1 (fix-check: not removed), 2 (no result)
    ok: bool  # produced its JSON
    note: str  # '' or why there is nothing to show
    data: Optional[dict]  # the analysis's JSON payload
    figures: list[str]  # paths relative to the report directory
    text: str  # the tables and the verdict, as the command prints them
    seconds: float
    meta: dict = field(default_factory=dict)


def exit_meaning(section) -> str:
    """What a section's exit code means, in words (the command's own exit code: 0, 1 only for fix-check, 2 no result).
    """
    data = section.data or {}
    if section.exit_code == 2 or not section.ok:
        return "could not run (see its note)"
    if section.name == "fix-check":
        return {"fails": "the fix fails", "remains": "a significant bias remains under the fix",
                "removed": "the fix removes the bias", "no-bias": "no bias to remove",
                "inconclusive": "too few rows to tell whether the fix removes it"}.get(data.get("outcome"), "ran")
    return "ran"


EXIT_CODES = ("exit codes are each command's own: 0 it ran (its finding is in its section); 1 only fix-check's: a "
              "significant bias remains under the fix, or the fix fails; 2 it could not run on this dump (its note "
              "says why)")


def command_line(name: str, dump: Path, selection: dict, recipe: Recipe, backend: Backend) -> list[str]:
    """The `fa-forensics` arguments that give the same section on their own, from the analysis's registered
    section: its selection, the flags that carry the report's recipe, the accumulation and the backend."""
    section = BY_NAME[name].section
    args = [name, str(dump)]
    if section.whole_dump:
        return args
    for flag in ("--step", "--layer", "--head"):
        value = selection.get(flag.removeprefix("--"))
        if value is not None:
            args += [flag, str(value)]
    for flag, value in section.recipe_flags:
        args += [flag, recipe.preset if value == "PRESET" else value]
    return [*args, "--accumulation", recipe.accumulation_name, "--backend", Backend(backend).value]


def _text(renderables: list, verdict: Optional[str]) -> str:
    console = Console(file=io.StringIO(), width=REPORT_TEXT_WIDTH, record=True, color_system=None)
    for r in renderables:
        console.print(r, highlight=False)
    if verdict:
        console.print(f"verdict: {verdict}", highlight=False)
    return console.export_text()


def section_selections(section: Analysis, dump, selection: dict) -> Optional[list]:
    """What one section of the report reads: nothing for the timeline (it reads the whole of it), the last step for a
    whole-dump section (pcast), else the report's selection ({step, layer, head} and, without a step, the `steps`
    that matter)."""
    if section.section.needs == "timeline":
        return None
    if section.section.whole_dump:
        return select(dump, dump.steps[-1] if dump.steps else None)
    if selection.get("step") is None and selection.get("steps"):
        return [sel for step in selection["steps"]
                for sel in select(dump, step, selection.get("layer"), selection.get("head"))]
    return select(dump, selection.get("step"), selection.get("layer"), selection.get("head"))


def run_section(section: Analysis, dump, dump_path: Path, out_dir: Path, selection: dict, recipe: Recipe,
                backend: Backend, workers: Workers = Workers(), published_as: Optional[Path] = None) -> SectionResult:
    """Run one analysis into out_dir/<name>/: its JSON, figures and tables. `published_as`: where out_dir will be
    moved once the report is complete (the figure paths in the JSON name that place)."""
    sec_dir = out_dir / section.name
    sec_dir.mkdir(parents=True, exist_ok=True)
    json_path = sec_dir / f"{section.name}.json"
    if json_path.exists():
        json_path.unlink()
    args = command_line(section.name, dump_path, selection, recipe, backend)
    t0 = time.perf_counter()
    if section.section.needs == "steps" and not dump.steps and dump.timeline is not None:
        return SectionResult(section.name, args, 2, False, NO_STEP_NOTE, None, [], "", 0.0)
    try:
        result = section.report_run(dump, section_selections(section, dump, selection), recipe, backend, workers)
        paths = section.draw(result, sec_dir)
        final = [Path(published_as) / Path(p).relative_to(out_dir) if published_as is not None else p for p in paths]
        payload = to_jsonable({**section.payload(result), "figures": [str(p) for p in final]})
        renderables = section.tables(result)
    except UserError as exc:
        return SectionResult(section.name, args, 2, False, str(exc), None, [], "", time.perf_counter() - t0)
    except OSError as exc:
        if is_no_space(exc):  # nothing more can be written: the whole report stops (output.staged_report words it)
            raise
        note = f"cannot write its output ({exc.strerror or exc})"
        return SectionResult(section.name, args, 2, False, note, None, [], "", time.perf_counter() - t0)
    except Exception as exc:  # a bug in one analysis must not cost the others their section
        return SectionResult(section.name, args, 2, False, f"unexpected {type(exc).__name__}: {exc}", None, [], "",
                             time.perf_counter() - t0)
    if section.section.needs == "timeline" and selection.get("steps_why"):
        payload["analysed_steps"] = {"steps": selection["steps"], "why": selection["steps_why"]}
    atomic_write(json_path, json.dumps(payload, indent=2) + "\n", "out")
    figures = sorted(str(Path(p).relative_to(out_dir)) for p in paths)
    text = _text(renderables, payload.get("verdict"))
    if "analysed_steps" in payload:
        text += f"{selection['steps_why']}\n"
    meta = {"steps": selection["steps"]} if selection.get("steps") and not section.section.whole_dump else {}
    return SectionResult(section.name, args, int(payload.get("exit_code", 0)), True, "", payload, figures,
                         text, time.perf_counter() - t0, meta)


def sections_of(dump, sections=SECTIONS) -> list:
    """The report's sections that apply to `dump`: a section that needs a timeline only when it has one."""
    return [s for s in sections if s.section.needs != "timeline" or dump.timeline is not None]


def run_all(dump, dump_path: Path, out_dir: Path, *, step=None, layer=None, head=None, recipe: Recipe = Recipe(),
            backend: Backend = Backend.EMULATE, sections=SECTIONS,
            on_start: Optional[Callable[[str], None]] = None, workers: Workers = Workers(),
            published_as: Optional[Path] = None) -> list[SectionResult]:
    """Every analysis on `dump` (restricted by step / layer / head when given), lp = `recipe`, the
    work items of each on `workers` (one cluster for all)."""
    selection: dict = {"step": step, "layer": layer, "head": head}
    if step is None:
        chosen, why = steps_that_matter(dump)
        if chosen:
            selection.update(steps=chosen, steps_why=why)
    sections = sections_of(dump, sections)
    results = []
    with contextlib.ExitStack() as stack:
        if not workers.in_process:
            stack.enter_context(connected(workers))
        for section in sections:
            if on_start is not None:
                on_start(section.name)
            results.append(run_section(section, dump, Path(dump_path), Path(out_dir), selection, recipe, backend,
                                       workers, published_as))
    return results
