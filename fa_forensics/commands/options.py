"""The one table of the options commands share: each one's parameter name, typer type (flag, help) and default.

Every command that takes a shared option reads it here: the analysis commands (around their own options, or
named by the registry's `shared(...)`), `match`, `report`, `info`, `verify`, `import`/`export`, `synth`,
`capture`. Only light modules are imported (typer, the enums, the preset names), so that the app and every
command's --help are built without torch, numba or scipy.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from fa_forensics.enums import AUTO, AccumulationOrAuto, Backend
from fa_forensics.layers.cluster_wait import WORKER_WAIT_SECONDS
from fa_forensics.replay.config import PRESETS

REQUIRED = inspect.Parameter.empty  # the default of an argument the command line must give

# Shared option types (huggingface_hub style): one definition, used by every command.
DumpArg = Annotated[Path, typer.Argument(help="Path of a dump store (a .zarr directory).", show_default=False)]
JsonOpt = Annotated[Optional[Path],
                    typer.Option("--json", help="Write the result as JSON to FILE (keys documented in docs/json.md); "
                                                "- writes it to the standard output.",
                                 metavar="FILE")]
OutOpt = Annotated[Optional[Path],
                   typer.Option("--out", help="Directory for figures (PNG) and other files.", metavar="DIR")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")]
StepOpt = Annotated[Optional[int],
                    typer.Option("--step", help="Training step to analyse (default: every complete step).")]
LayerOpt = Annotated[Optional[int], typer.Option("--layer", help="Layer to analyse (default: every layer).")]
HeadOpt = Annotated[Optional[int], typer.Option("--head", help="Head to analyse (default: every head).")]
RankOpt = Annotated[Optional[int], typer.Option("--rank", metavar="R", min=0,
                                                help="Rank of a multi-rank dump to read (default 0).")]
RanksOpt = Annotated[Optional[str], typer.Option("--rank", metavar="R|all",
                                                 help="Rank of a multi-rank dump to read (default 0), or all: one "
                                                      "result per rank.")]
ALL_RANKS = "all"
WorkersOpt = Annotated[int,
                       typer.Option("--workers",
                                    help="Worker processes (a local dask.distributed cluster); 1 = in-process. The "
                                         "output does not depend on it.")]
SchedulerOpt = Annotated[Optional[str],
                         typer.Option("--scheduler",
                                      help="Address of a running Dask scheduler (tcp://HOST:PORT) to run on instead; "
                                           "the dump must be on storage its workers see.", metavar="ADDRESS")]
WorkerWaitOpt = Annotated[float, typer.Option(
    "--worker-wait", metavar="SECONDS",
    help="How long --workers / --scheduler may have no worker (none at the start, or all lost during the run) "
         "before the command fails.")]


def accumulation_option(preset_flags: Sequence[str] = ("--preset",)) -> Any:
    """--accumulation, its help naming the command's own options that take a preset (`--preset`, or bitdiff's
    `--a` and `--b`): the default follows what each of them resolved to."""
    if len(preset_flags) == 1:
        default = f"the one {preset_flags[0]} auto matched, ieee for a named preset"
    else:
        default = f"for each of {' and '.join(preset_flags)}, the one it matched when auto, ieee for a named preset"
    return Annotated[AccumulationOrAuto, typer.Option(
        "--accumulation", help=f"Accumulation model of every matrix product (default: {default}).")]


AccumulationOpt = accumulation_option()
MatchCacheOpt = Annotated[Optional[str], typer.Option(
    "--match-cache", metavar="DIR|off",
    help="Where `match` results are kept (never in the dump): a directory, or off (default: $FA_FORENSICS_CACHE_DIR, "
         "else $XDG_CACHE_HOME/fa-forensics, else ~/.cache/fa-forensics).")]
BackendOpt = Annotated[Backend, typer.Option("--backend", help="Replay backend: emulate is the CPU reference, "
                                                                "triton runs the GPU kernels.")]
PresetOpt = Annotated[str, typer.Option(
    "--preset", metavar="NAME",
    help=f"Low-precision reading replayed against fp32: {AUTO} (default: per layer-step, the recipe that reproduces "
         "the dump's stored O best among the recipes its recorded precision allows, as `fa-forensics match` finds "
         f"it; kept in the match cache, never in the dump) | a replay preset: {' | '.join(PRESETS)}. --accumulation "
         "still applies.")]


@dataclass(frozen=True)
class SharedOption:
    """A shared option: the command's parameter `name`, its typer `type` and its `default` (REQUIRED: none)."""

    name: str
    type: Any
    default: Any = None


SHARED: dict[str, SharedOption] = {o.name: o for o in (
    SharedOption("dump", DumpArg, REQUIRED),
    SharedOption("step", StepOpt),
    SharedOption("layer", LayerOpt),
    SharedOption("head", HeadOpt),
    SharedOption("rank", RankOpt),
    SharedOption("preset", PresetOpt, AUTO),
    SharedOption("accumulation", AccumulationOpt, AccumulationOrAuto.AUTO),
    SharedOption("backend", BackendOpt, Backend.EMULATE),
    SharedOption("match_cache", MatchCacheOpt),
    SharedOption("workers", WorkersOpt, 1),
    SharedOption("scheduler", SchedulerOpt),
    SharedOption("worker_wait", WorkerWaitOpt, WORKER_WAIT_SECONDS),
    SharedOption("out", OutOpt),
    SharedOption("json_path", JsonOpt),
    SharedOption("debug", DebugOpt, False),
)}

SELECTION = ("dump", "step", "layer", "head", "rank")  # what to analyse: first on every analysis command
RECIPE = ("preset", "accumulation", "backend", "match_cache", "workers", "scheduler", "worker_wait", "out", "json_path",
          "debug")


# The options whose value is a path a command writes (a file, a folder it writes into, a store or page it replaces)
# and the arguments that name what it reads. `common.refuse_outputs_in_inputs` checks every command's outputs
# against its inputs before the command runs, whatever module registered it.
OUTPUT_OPTIONS = ("--json", "--out", "--to", "--tensorboard", "--monitor-tensorboard", "--capture", "--match-cache")
INPUT_ARGUMENTS = ("dump", "file")
# (command, option) of outputs replaced whole: an input inside one would be deleted with it, and no other output of
# the command may lie inside it.
REPLACED_OUTPUTS = frozenset({("import", "--to"), ("export", "--to"), ("synth", "--out"), ("capture", "--out"),
                              ("demo-train", "--capture"), ("report", "--out")})


def shared(name: str, type_: Any = None) -> tuple[str, Any, Any]:
    """(name, type, default) of the shared option `name` (`type_`: a command's own wording of it)."""
    option = SHARED[name]
    return option.name, type_ or option.type, option.default


def signature(options: Iterable[str | tuple[str, Any, Any]]) -> inspect.Signature:
    """A command's signature from its options in --help order: a shared option by name, any other as (name, typer
    type, default). The required ones that lead are positional; typer passes every value by name."""
    parameters = []
    for option in options:
        name, type_, default = shared(option) if isinstance(option, str) else option
        leading = default is REQUIRED and all(p.default is REQUIRED for p in parameters)
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if leading else inspect.Parameter.KEYWORD_ONLY
        parameters.append(inspect.Parameter(name, kind, default=default, annotation=type_))
    return inspect.Signature(parameters)
