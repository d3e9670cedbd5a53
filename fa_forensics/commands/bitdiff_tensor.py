"""`fa-forensics bitdiff DUMP --a X --b Y`: the tensor mode of bitdiff (the command itself, with its
--add mode, lives in commands/bitdiff.py and calls `run_tensor_mode`).

Each side is "dump" (the O stored in the dump) or a replay preset (bf16, fp32, stabilized, ...,
see ReplayConfig.preset) replayed with the chosen accumulation model on the stored q, k, v.
"""
from __future__ import annotations

from fa_forensics.fidelity.recipe import Recipe, UnknownPreset
from fa_forensics.commands.common import (
    AnalysisArgs, build_accumulation, build_backend, build_workers, ensure_out_dir, progress_bar, run_cli, show_result,
)
from fa_forensics.errors import UserError
from fa_forensics.layers.fanout import WORKER_WAIT_SECONDS
from fa_forensics.enums import Accumulation
from fa_forensics.replay.config import PRESETS


def side(name: str, accumulation: Accumulation):
    """None for the stored O ('dump'), else the recipe of that preset; one line for anything else."""
    if name == "dump":
        return None
    try:
        return Recipe(name, accumulation)
    except UnknownPreset:
        raise UserError(f"--a/--b {name!r} is not 'dump' or a preset; choose one of: dump, auto, "
                        f"{', '.join(PRESETS)}") from None


def _run(dump_path, a, b, step, layer, head, accumulation, backend, out, json_path, workers, scheduler, rank=None,
         worker_wait=WORKER_WAIT_SECONDS):
    from fa_forensics.analyses.bitdiff import compute as bitdiff
    from fa_forensics.layers.fanout import n_items
    from fa_forensics.analyses.bitdiff.figure import draw
    from fa_forensics.analyses.bitdiff.table import tables

    if not a or not b:
        raise UserError("bitdiff tensor mode needs both --a and --b (each 'dump' or a preset such as bf16, fp32, "
                        "stabilized)")
    if a == b:
        raise UserError(f"--a and --b are both {a!r}; choose two different sides")
    acc = build_accumulation(accumulation)
    side_a, side_b = side(a, acc), side(b, acc)  # bad sides fail here, before any work
    args = AnalysisArgs(dump_path, step, layer, head, side_a or side_b or Recipe(), build_backend(backend),
                        ensure_out_dir(out), json_path, build_workers(workers, scheduler, worker_wait), rank)
    dump, sels, plan = args.open()  # the plan of the first replayed side; bitdiff.run plans the other from it
    side_a, side_b = (plan if s is args.recipe else s for s in (side_a, side_b))
    with progress_bar(f"replaying {a} and {b}", n_items(sels)) as advance:
        r = bitdiff.run(dump, sels, side_a, side_b, args.backend, progress=advance, workers=args.workers)
    show_result(args, r, bitdiff.payload(r), tables(r), draw)


def run_tensor_mode(dump, a, b, step, layer, head, accumulation, backend, out, json_path, debug, workers=1,
                    scheduler=None, rank=None, worker_wait=WORKER_WAIT_SECONDS):
    """Entry point called by the `bitdiff` command when --add is not given."""
    return run_cli(debug, lambda: _run(dump, a, b, step, layer, head, accumulation, backend, out, json_path, workers,
                                       scheduler, rank, worker_wait))
