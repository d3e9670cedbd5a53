"""The registry of analyses: each analysis is registered here once, and nowhere else.

An `Analysis` names its room (the folder fa_forensics/analyses/<room>/ with compute.py, table.py and
figure.py), its command's help and options (plain data: the CLI makes typer options of them), the keys
of its --json, and its section of the report. The CLI's analysis commands (commands/analysis.py) and
the report's sections (report/run.py) are generated from `ANALYSES`; the report runs each analysis's
compute with the options' defaults.

A room's modules are imported when first used, so that listing the commands stays cheap.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fa_forensics.analyses.payloads import (BitdiffAddPayload, BitdiffPayload, DeltaBiasPayload, FixCheckPayload,
                                            IsolatePayload, PcastDumpPayload, PcastSimulationPayload, PVTracePayload,
                                            Rank1SimPayload, TimelinePayload, keys_of)
from fa_forensics.monitor.alarm_settings import DEFAULTS as ALARM_DEFAULTS

# The formats bitdiff --add can store a sum into.
INTO_CHOICES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp32")

# The key the command adds to an analysis's payload: the figures it drew.
FIGURES = ("figures",)


@dataclass(frozen=True)
class Option:
    """One option of an analysis command, in --help order.

    `shared`: the CLI's own option of that name (DUMP, --step, --layer, --head, --rank, --accumulation, --backend,
    --workers, --scheduler, --worker-wait, --out, --json, --debug): flag, type, help and default are the CLI's one
    table's (commands/options.py).
    `argument`: a positional argument instead of a --flag. `keyword`: the compute's keyword for the value
    (default: `name`). `check(value)`: why a value is refused (None: accepted)."""

    name: str
    flag: Optional[str] = None
    type: Any = None
    default: Any = None
    help: str = ""
    metavar: Optional[str] = None
    min: Optional[int] = None
    keyword: Optional[str] = None
    check: Optional[Callable[[Any], Optional[str]]] = None
    shared: bool = False
    argument: bool = False

    @property
    def compute_keyword(self) -> str:
        return self.keyword or self.name

    def problem(self, value: Any) -> Optional[str]:
        """One line naming the flag when `value` is refused, else None."""
        reason = self.check(value) if self.check is not None else None
        return f"{self.flag} {value} {reason}" if reason else None


def shared(name: str) -> Option:
    """The CLI's shared option `name`, as its table declares it."""
    return Option(name, shared=True)


@dataclass(frozen=True)
class Section:
    """An analysis's section of the report: its title, and how the report's recipe reaches it.

    `recipe_flags`: the command's options that carry the report's low-precision side, as (flag, value), where
    the value PRESET stands for the report's preset; `whole_dump`: it studies the last complete step itself
    and takes neither the report's selection nor its recipe; `needs`: what of a dump it reads, "steps" (a
    complete recorded step) or "timeline" (the monitor's timeline; the section is left out of the report of a
    dump without one)."""

    title: str
    recipe_flags: tuple[tuple[str, str], ...] = (("--preset", "PRESET"),)
    whole_dump: bool = False
    needs: str = "steps"


@dataclass(frozen=True)
class Analysis:
    """One analysis: its room, its command, its --json keys and its report section.

    `json_keys`: the keys of its --json in order, derived from its payload type (`analyses.payloads`).

    `replays`: the command takes the shared selection and recipe options (DUMP, --step/--layer/--head,
    --preset, --accumulation, --backend, --match-cache, --workers, --scheduler, --out, --json, --debug)
    around its own `options`, and its compute is `run(dump, selections, recipe, backend, *, progress,
    workers, **options)`. Otherwise `options` are the whole command line, shared ones included.
    `progress`: the label of its progress bar ({recipe}: the recipe's label); `per_layer_step`: the bar
    counts layer-steps, not work items. `hint`: what to do when its compute refuses the recipe.
    `pass_fail`: its result's `exit_code` is the command's (0 passed, 1 failed) and colours the verdict."""

    name: str
    room: str
    help: str
    json_keys: tuple[str, ...]
    options: tuple[Option, ...] = ()
    replays: bool = True
    progress: str = ""
    per_layer_step: bool = False
    hint: str = ""
    pass_fail: bool = False
    section: Optional[Section] = None
    other_json_keys: dict = field(default_factory=dict)  # {mode: keys} of its other modes (pcast's simulation)

    def module(self, part: str):
        """The room's module `part` (compute, table, figure, ...), imported on first use."""
        return importlib.import_module(f"fa_forensics.analyses.{self.room}.{part}")

    def compute(self, *args: Any, **kwargs: Any) -> Any:
        return self.module("compute").run(*args, **kwargs)

    def payload(self, result: Any) -> dict:
        """The --json payload of a result (without `figures`, which the caller adds)."""
        return self.module("compute").payload(result)

    def tables(self, result: Any) -> list:
        return self.module("table").tables(result)

    def draw(self, result: Any, out: Path) -> list:
        return self.module("figure").draw(result, out)

    def finding(self, payload: dict) -> Optional[str]:
        """The report's one sentence of this analysis, from its --json payload."""
        return self.module("table").finding(payload)

    def key_numbers(self, payload: dict) -> list[tuple[str, str]]:
        """The report's labelled numbers of this analysis (label with its unit, value as text), from its payload."""
        table = self.module("table")
        return table.key_numbers(payload) if hasattr(table, "key_numbers") else []

    def defaults(self) -> dict:
        """The compute's keywords of the analysis's own options, at their defaults (what the report runs)."""
        return {o.compute_keyword: o.default for o in self.options if not o.shared and not o.argument}

    def report_run(self, dump, selections, recipe, backend, workers) -> Any:
        """Run the analysis as its report section does: the report's recipe on the sides `section.recipe_flags`
        names, fp32 (or the named preset) on the others, every own option at its default."""
        if self.section is not None and self.section.whole_dump:
            return self.compute(dump, selections)
        if self.replays:
            return self.compute(dump, selections, recipe, backend, workers=workers, **self.defaults())
        from fa_forensics.fidelity.recipe import Recipe

        sides = [recipe if value == "PRESET" else Recipe(value, recipe.accumulation)
                 for _, value in self.section.recipe_flags]
        return self.compute(dump, selections, *sides, backend, workers=workers)


def _greater_than_one(value: float) -> Optional[str]:
    return None if value > 1 else "must be > 1 (the paper uses 2 to 8)"


def _not_negative(value: float) -> Optional[str]:
    return None if value >= 0 else "must be >= 0"


def _finite_positive(value: float) -> Optional[str]:
    ok = math.isfinite(value) and value > 0
    return None if ok else "must be a finite number > 0 (the fixed shift m = rowmax + offset of App. C)"


ISOLATE = Analysis(
    "isolate", "isolate",
    "Replay under single repairs to localize the failing operation (paper §3.2, Claim 1).",
    json_keys=keys_of(IsolatePayload, then=FIGURES),
    progress="isolate",
    section=Section("isolate: which precision choice causes the error (paper §3.2)"),
)

DELTA_BIAS = Analysis(
    "delta-bias", "delta_bias",
    "Sign and origin of Σ_T(δ_lp − δ_hp): per step/layer/head, cumulative, per feature (paper §3.3, Fig. 5).",
    json_keys=keys_of(DeltaBiasPayload, then=FIGURES),
    progress="delta-bias",
    section=Section("delta-bias: is Σ(δ_lp − δ_hp) biased, and through which features (§3.3.1-3.3.2, Fig. 5)"),
)

RANK1_SIM = Analysis(
    "rank1-sim", "rank1_sim",
    "Similar rank-1 matrices (PK)[T]ᵀX[T] and the accumulation of the W_Q gradient error (paper §3.3.1, Fig. 4).",
    options=(Option("tokens", "--tokens", int, 4, min=1, keyword="tokens_per_step",
                    help="Tokens per step whose rank-1 matrices are compared (largest |δ error| first)."),),
    json_keys=keys_of(Rank1SimPayload, then=FIGURES),
    progress="rank1-sim",
    section=Section("rank1-sim: structurally similar rank-1 error terms (§3.3.1, Fig. 4)"),
)

PV_TRACE = Analysis(
    "pv-trace", "pv_trace",
    "Trace the error of one P̄V dot product down to the bits (paper Eq. 4-5, Fig. 6).",
    options=(
        Option("row", "--row", Optional[int], None,
               help="Query row T to trace (default: the row with the largest error in the chosen feature)."),
        Option("feature", "--feature", Optional[int], None,
               help="Feature i of V / O to trace (default: the feature with the largest mean O bias)."),
    ),
    json_keys=keys_of(PVTracePayload, then=FIGURES),
    progress="replaying ({recipe} vs fp32)",
    per_layer_step=True,
    hint="use --preset fp8-s1, or `fa-forensics pcast` for the scale study",
    section=Section("pv-trace: the error of one P̄V dot product, term by term (§3.3.2, Fig. 6)"),
)

BITDIFF = Analysis(
    "bitdiff", "bitdiff",
    "Explain one addition bit by bit (--add A B), or compare two O tensors of a dump bit by bit.",
    replays=False,
    options=(
        Option("dump", type=Optional[Path], argument=True, help="Dump store (tensor mode); not needed with --add."),
        Option("add", "--add", Optional[tuple[str, str]], None, metavar="A B",
               help="Explain A + B: decimal, 32-char fp32 bits, or 0x hex."),
        Option("into", "--into", str, "bf16", help="Format the sum is stored into: " + " | ".join(INTO_CHOICES) + "."),
        Option("acc", "--acc", str, "fp32", help="Accumulator format the addition happens in."),
        Option("a", "--a", str, "auto", metavar="PRESET",
               help="Tensor mode: replay preset of the first O (auto: the recipe that reproduces the stored O best)."),
        Option("b", "--b", str, "fp32", metavar="PRESET", help="Tensor mode: replay preset of the second O."),
        shared("step"), shared("layer"), shared("head"), shared("rank"), shared("accumulation"), shared("backend"),
        shared("workers"), shared("scheduler"), shared("worker_wait"), shared("out"), shared("json_path"),
        shared("debug"),
    ),
    json_keys=keys_of(BitdiffPayload, then=FIGURES),
    other_json_keys={"add": keys_of(BitdiffAddPayload, then=("warnings",))},
    section=Section("bitdiff: O replayed in low precision vs fp32, bit by bit (the bias map)",
                    recipe_flags=(("--a", "PRESET"), ("--b", "fp32"))),
)

FIX_CHECK = Analysis(
    "fix-check", "fix_check",
    "Check that the stabilized softmax removes the bias and the alternatives do not (paper §4, App. C). "
    "Exit code 0: removed, nothing to remove, or too few rows to tell; 1: a significant bias remains (or the fix "
    "fails); 2: bad input.",
    options=(
        Option("beta", "--beta", float, 2.0, check=_greater_than_one,
               help="β of the stabilized softmax (m = β·r_m for a repeated positive maximum; paper: 2 to 8)."),
        Option("eps", "--eps", float, 1e-3, check=_not_negative,
               help="ε: scores within ε of the row maximum count as repeated maxima."),
        Option("offset", "--offset", float, 1.0, check=_finite_positive,
               help="Offset of App. C's fixed-offset alternative: m = rowmax + offset."),
    ),
    json_keys=keys_of(FixCheckPayload, then=FIGURES),
    progress="replaying variants",
    pass_fail=True,
    section=Section("fix-check: does the stabilized softmax remove the bias (§4, App. C)"),
)

PCAST = Analysis(
    "pcast", "pcast",
    "FP8 P-cast study: sink-induced collapse, reverse iteration, S = 2^8 (simulation, or per head of a dump).",
    replays=False,
    options=(
        Option("dump", type=Optional[Path], argument=True,
               help="Optional dump store: analyse its real scores per head instead of simulating."),
        Option("sink_strength", "--sink-strength", str, "4,5,6,7,8,9,10,11,12,13", metavar="LIST",
               help="Sink strengths Δ of the simulation (comma list)."),
        Option("seq", "--seq", str, "512,1024,2048,4096,8192,16384", metavar="LIST",
               help="Sequence lengths N: the Δ sweep runs at 4096 (or the largest N), Fig. 3 at Δ = 7 over all."),
        Option("sinks", "--sinks", int, 4, metavar="K", help="Number of sink tokens k (the first k keys)."),
        Option("block", "--block", int, 64, metavar="B", help="KV block size B of the kernel."),
        Option("queries", "--queries", int, 32, metavar="Q", help="Query rows per instance (simulation)."),
        Option("head_dim", "--head-dim", int, 128, metavar="D", help="Head dimension d (simulation)."),
        Option("scales", "--scales", str, "1,256,448", metavar="LIST", help="Static P scales S (comma list)."),
        Option("order", "--order", str, "forward,reverse", metavar="LIST",
               help="KV iteration orders (comma list of forward, reverse)."),
        Option("seeds", "--seeds", int, 16, metavar="N",
               help="Independent instances (seeds) per cell of the simulation."),
        Option("seed", "--seed", int, 0, help="Base random seed of the simulation."),
        Option("step", "--step", Optional[int], None,
               help="Training step to analyse in dump mode (default: the last complete step)."),
        shared("layer"), shared("head"), shared("rank"), shared("out"), shared("json_path"), shared("debug"),
    ),
    json_keys=keys_of(PcastDumpPayload, then=FIGURES),
    other_json_keys={"simulation": keys_of(PcastSimulationPayload, then=("figures", "warnings"))},
    section=Section("pcast: FP8 P-cast collapse per head (the P-Cast paper)", recipe_flags=(), whole_dump=True),
)

TIMELINE = Analysis(
    "timeline", "timeline",
    "Loss, max logits, top-1 probability, repeated maxima and W_Q spectral norms over the monitored steps (paper\n"
    "Fig. 2, 3, 11, 13), the alarms the capture recorded, and the alarm rule replayed over them.",
    replays=False,
    options=(
        shared("dump"), shared("rank"),
        Option("alarm_warmup", "--alarm-warmup", Optional[int], None, metavar="N",
               help="Monitored steps before the replayed rule's jump or trend may fire "
                    f"(default: the capture's setting, else {ALARM_DEFAULTS.warmup})."),
        Option("alarm_window", "--alarm-window", Optional[int], None, metavar="N",
               help=f"Trailing values of the jump test (default: the capture's, else {ALARM_DEFAULTS.window})."),
        Option("alarm_z", "--alarm-z", Optional[float], None, metavar="Z",
               help="Robust z-score a jump must exceed "
                    f"(default: the capture's, else {ALARM_DEFAULTS.z_threshold:g})."),
        Option("alarm_set", "--alarm-set", Optional[list[str]], None, metavar="KEY=VALUE",
               help="Any other setting of the replayed rule, repeatable (keys and defaults: docs/monitor.md), e.g. "
                    "--alarm-set trend_z=4."),
        Option("tensorboard", "--tensorboard", Optional[Path], None, metavar="DIR",
               help="Also write the timeline as TensorBoard event files into DIR (needs the tensorboard extra)."),
        shared("out"), shared("json_path"), shared("debug"),
    ),
    json_keys=keys_of(TimelinePayload, then=FIGURES),
    section=Section("timeline: the run as it trained, and the alarms the capture raised (paper Fig. 2, 3, 11, 13)",
                    recipe_flags=(), whole_dump=True, needs="timeline"),
)

# In the order of the CLI's --help.
ANALYSES: tuple[Analysis, ...] = (ISOLATE, DELTA_BIAS, RANK1_SIM, PV_TRACE, BITDIFF, FIX_CHECK, PCAST, TIMELINE)
BY_NAME = {a.name: a for a in ANALYSES}
# The report's sections: the training-time view first (what happened, and when), then the step analyses (why).
REPORTED: tuple[Analysis, ...] = (TIMELINE, *(a for a in ANALYSES if a.section is not None and a is not TIMELINE))
