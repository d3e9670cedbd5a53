"""Run a training command under capture and say what came of it: what `fa-forensics capture` does between
parsing its options and printing.

`run_script(settings, command, same_python)` launches the command (rewritten to start through the capture
launcher, capture/command_line.py) with the settings in its environment (capture/launched.py's LaunchOrder),
waits for it (Ctrl-C gives it CTRL_C_GRACE seconds to leave its store whole), and reads each rank's tree of the
store and each capturing process's report into a `ScriptRun`: per rank what was recorded, how far it ran, which
selected steps it never reached, the warnings said, and the exit code the command ends with.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fa_forensics.capture.command_line import check_target, rewrite_command
from fa_forensics.capture.launched import ENV_VAR, LaunchOrder
from fa_forensics.capture.selection import StepSet
from fa_forensics.capture.settings import CaptureSettings
from fa_forensics.errors import UserError

if TYPE_CHECKING:
    from fa_forensics.monitor.alarm import AlarmRule

NEVER_LISTED = 1000  # never_reached in --json lists at most this many steps (the warning gives them all as ranges)
CTRL_C_GRACE = 60.0  # seconds a training script that got Ctrl-C has to end (its capture writer finishes its queue)


@dataclass(frozen=True)
class RankOutcome:
    """What one rank's tree of the store holds and how far that rank ran."""

    rank: int
    steps: list[int]
    incomplete_steps: list[int]
    layers: list[int]
    monitored_steps: int
    alarm_steps: list[int]
    alarms: list
    do_missing: dict[str, list[int]]
    never_reached: list[int]  # selected steps never reached (the first NEVER_LISTED)
    steps_run: Optional[int]  # optimizer steps the rank made (None: its launcher wrote no report)
    ran_without_attention: list[int]  # selected steps it ran without an attention call
    never_reached_text: str  # every never-reached step, as a list or in ranges

    @property
    def recorded(self) -> bool:
        return bool(self.steps or self.incomplete_steps or self.monitored_steps)

    def to_json(self, *left_out: str) -> dict:
        """The outcome as `--json` gives it (its never-reached steps as a list only)."""
        return {k: v for k, v in asdict(self).items() if k not in ("never_reached_text", *left_out)}


@dataclass(frozen=True)
class ScriptRun:
    """A training command's run under capture: its exit code, every rank's outcome, the warnings said."""

    out: Path
    command: list[str]
    returncode: int
    outcomes: list[RankOutcome]
    launcher_warnings: list[str]  # said by the capturing processes (already shown by them)
    warmup_line: Optional[str]  # the alarm's warm-up covered every monitored step

    @property
    def several(self) -> bool:
        return len(self.outcomes) > 1

    @property
    def never_reached_lines(self) -> list[str]:
        """One warning per rank with selected steps it never reached."""
        return [never_reached_line(o, self.several) for o in self.outcomes if o.never_reached]

    @property
    def warnings(self) -> list[str]:
        return [*self.launcher_warnings, *self.never_reached_lines, *([self.warmup_line] if self.warmup_line else [])]

    @property
    def recorded(self) -> bool:
        return any(o.recorded for o in self.outcomes)

    @property
    def silent(self) -> bool:
        """The launcher or the script said why it stopped, in its own line: nothing more to print."""
        return self.returncode == 2 and not self.recorded

    @property
    def shows_summary(self) -> bool:
        return self.recorded or Path(self.out).exists()

    def to_json(self) -> dict:
        first = self.outcomes[0]
        return {"out": str(self.out), "returncode": self.returncode, "command": list(self.command),
                **first.to_json("rank"), "world_size": len(self.outcomes),
                "ranks": [o.to_json() for o in self.outcomes], "warnings": self.warnings}

    def failure_line(self) -> Optional[str]:
        """What failed and what was kept, when the training command exited with an error."""
        if self.returncode == 0:
            return None
        monitored = sum(o.monitored_steps for o in self.outcomes)
        kept = [what for what, there in (("the steps completed before it", any(o.steps for o in self.outcomes)),
                                         (f"its timeline ({monitored} monitored steps)", monitored)) if there]
        kept_text = f"{' and '.join(kept)} are kept in {self.out}" if kept else "nothing was recorded"
        return f"the training command exited with code {self.returncode}; {kept_text}"

    @property
    def exit_code(self) -> int:
        """The command's exit code: the script's on failure (1 outside 1..255), 1 when a selected step was never
        reached or ran without attention, else 0."""
        if self.silent:
            return 2
        if self.returncode != 0:
            return self.returncode if 0 < self.returncode < 256 else 1
        if any(o.never_reached or o.ran_without_attention for o in self.outcomes):
            return 1
        return 0


def run_script(settings: CaptureSettings, command: list[str], same_python: bool = True,
               alarm_rule: Optional[AlarmRule] = None) -> ScriptRun:
    """Run `command` under capture with `settings`; UserError (one line) for a command that cannot start.
    alarm_rule: the rule the settings' alarm was built from, for the warm-up warning."""
    from fa_forensics.dump.safe_files import refuse_link

    argv = rewrite_command(list(command), same_python=same_python)
    check_target(argv)
    out = Path(settings.out)
    refuse_link(out, "out")  # resolving the store would follow a planted link; the writer refuses one too
    launched = settings.replace(
        out=str(out.resolve()), run_id=uuid.uuid4().hex,  # the ranks of this run open the store in order by it
        monitor_tensorboard=None if settings.monitor_tensorboard is None
        else str(Path(settings.monitor_tensorboard).resolve()))
    with tempfile.TemporaryDirectory(prefix="fa-forensics-capture-") as tmp:
        order = LaunchOrder(launched, tuple(command), report=tmp)  # each process writes rank_<r>.json there
        env = {**os.environ, ENV_VAR: order.to_json()}
        try:
            training = subprocess.Popen(argv, env=env)
        except OSError as exc:
            raise UserError(f"cannot start {argv[0]!r}: {exc.strerror or exc}; check the training command") from exc
        code = _wait_for(training)
        reports = _launcher_reports(tmp)
    outcomes = rank_outcomes(out, settings.steps, reports)
    rule = alarm_rule if alarm_rule is not None else settings.alarm_rule()
    return ScriptRun(out, list(command), code, outcomes,
                     [w for r in sorted(reports) for w in reports[r].get("warnings", [])],
                     warmup_covered_line(rule, outcomes[0].monitored_steps))


def warmup_covered_line(rule: Optional[AlarmRule], monitored_steps: int) -> Optional[str]:
    """The warning for an alarm whose warm-up covered every monitored step (None when it did not)."""
    if rule is not None and 0 < monitored_steps <= rule.warmup:
        return (f"the alarm's warm-up ({rule.warmup} monitored steps) covered all {monitored_steps} monitored "
                "steps, so only a non-finite value could fire it; give a short run a short warm-up, e.g. "
                f"--alarm-warmup {max(monitored_steps // 4, 1)}")
    return None


def _wait_for(training: subprocess.Popen) -> int:
    """The training script's exit code. On Ctrl-C (which the script, in the same process group, gets too) it is
    given CTRL_C_GRACE seconds to end as it handles the interrupt, so its store is left whole and unlocked,
    then terminated; the interrupt then goes on."""
    try:
        return training.wait()
    except KeyboardInterrupt:
        try:
            training.wait(timeout=CTRL_C_GRACE)
        except subprocess.TimeoutExpired:
            training.terminate()
            try:
                training.wait(timeout=10)
            except subprocess.TimeoutExpired:
                training.kill()
                training.wait()
        raise


def _store_summary(out: Path, rank: int = 0) -> dict:
    """What rank `rank`'s tree of the store holds (empty when there is no such store or tree)."""
    from fa_forensics.dump import open_dump
    from fa_forensics.monitor.alarm import recorded_alarms

    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dump = open_dump(out, rank=rank)
            timeline = dump.timeline or {}
            alarms = timeline.get("alarms")
            return {"steps": dump.steps, "incomplete_steps": dump.incomplete_steps,
                    "layers": dump.layers() if dump.steps else [],
                    "monitored_steps": int(len(timeline.get("step", []))),
                    "alarm_steps": [] if alarms is None
                    else [int(s) for s, n in zip(timeline["step"], alarms) if n > 0],
                    "alarms": recorded_alarms(timeline),
                    "do_missing": dump.do_missing()}
    except UserError:
        return {"steps": [], "incomplete_steps": [], "layers": [], "monitored_steps": 0, "alarm_steps": [],
                "alarms": [], "do_missing": {}}


def _launcher_reports(folder: str) -> dict[int, dict]:
    """Each capturing process's report (steps run, warnings said) by rank; a rank whose launcher did not get to
    write one is missing."""
    reports = {}
    for path in sorted(Path(folder).glob("rank_*.json")):
        try:
            with open(path) as fh:
                report = json.load(fh)
            reports[int(report["rank"])] = report
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return reports


def rank_outcomes(out: Path, selected_steps: StepSet, reports: dict[int, dict]) -> list[RankOutcome]:
    """Per rank of the run (every rank of its world size, those in the store and those that reported): what its
    tree holds, how far it ran, which selected steps (walked lazily: the set may be endless) it never reached
    (the first NEVER_LISTED; `never_reached_text` names them all) and which it ran without an attention call."""
    from fa_forensics.dump.ranks import store_ranks

    world = max([1] + [int(r.get("world_size") or 1) for r in reports.values()])
    ranks = sorted(set(store_ranks(out) if Path(out).is_dir() else [0]) | set(reports) | set(range(world)))
    outcomes = []
    for rank in ranks:
        summary = _store_summary(out, rank)
        recorded = set(summary["steps"]) | set(summary["incomplete_steps"])
        ran = reports.get(rank, {}).get("steps_run")
        without_attention = [] if ran is None else [s for s in selected_steps.below(ran) if s not in recorded]
        unreached = selected_steps if ran is None else selected_steps.from_step(ran)
        never = list(itertools.islice((s for s in unreached if s not in recorded), NEVER_LISTED + 1))
        never_text = _span_text(never) if len(never) <= NEVER_LISTED else unreached.to_text()
        outcomes.append(RankOutcome(rank=rank, **summary, never_reached=never[:NEVER_LISTED], steps_run=ran,
                                    ran_without_attention=without_attention, never_reached_text=never_text))
    return outcomes


def _span_text(steps: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def never_reached_line(outcome: RankOutcome, several: bool) -> str:
    ran = outcome.steps_run
    who = f"rank {outcome.rank}" if several else "the run"
    return ((f"rank {outcome.rank}: " if several else "")
            + f"selected step(s) {outcome.never_reached_text} were never reached ({who} made "
            f"{'fewer' if ran is None else ran} optimizer.step() calls); nothing recorded for them. Check --steps "
            "against the run's length")
