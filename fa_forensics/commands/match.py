"""`fa-forensics match`: which recipe reproduces the stored O bit for bit (replay fidelity)."""
from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from fa_forensics.commands.common import (
    BackendOpt, DebugOpt, DumpArg, HeadOpt, JsonOpt, LayerOpt, SchedulerOpt, StepOpt, WorkersOpt, console, progress_bar, run_cli, write_json,
)

AllOpt = Annotated[bool, typer.Option("--all", help="Try every recipe, also after one reproduces the stored O 100 %.")]


def _pct(x: float) -> str:
    return "100 %" if x == 1.0 else f"{100 * x:.2f} %"


def verdict_line(layer) -> str:
    """'step S layer L: stored O reproduced 100 % by PRESET / ACCUMULATION' (or the best share)."""
    b = layer.best
    return f"step {layer.step} layer {layer.layer}: stored O reproduced {_pct(b.o_bits_equal)} by {b.preset} / {b.accumulation}"


def run(dump_path, step, layer, head, try_all: bool, backend: str, json_path, workers: int = 1, scheduler=None) -> None:
    from fa_forensics.analyses.match import candidate_recipes, match
    from fa_forensics.analyses.selection import select
    from fa_forensics.commands.common import build_backend, build_workers
    from fa_forensics.dump import open_dump

    backend = build_backend(backend).value
    fan_out = build_workers(workers, scheduler)
    dump = open_dump(dump_path)
    sels = select(dump, step, layer, head)
    with progress_bar("match", len(sels)) as advance:
        r = match(dump, sels, try_all=try_all, backend=backend, progress=advance, workers=fan_out)

    table = Table(title=f"match: share of stored-O elements (in {r.compared_in}) each recipe reproduces bit for bit"
                        + ("" if try_all else "; stops at the first 100 % (--all: try every recipe)"))
    for c in ("step", "layer", "best recipe", "o_bits_equal", "max |Δ|", "recipes tried", "runner-up"):
        table.add_column(c, justify="right")
    def n_candidates(lm) -> int:
        info = dump.layer_info(lm.step, lm.layer)
        return len(candidate_recipes(info.head_dim, info.arrays["k"][-2], info.dtype, dump.attrs.get("device")))

    for lm in r.layers:
        others = sorted((c for c in lm.candidates if c is not lm.best), key=lambda c: -c.o_bits_equal)
        runner = f"{others[0].preset} / {others[0].accumulation} {_pct(others[0].o_bits_equal)}" if others else "—"
        table.add_row(str(lm.step), str(lm.layer), f"{lm.best.preset} / {lm.best.accumulation}", _pct(lm.best.o_bits_equal),
                      f"{lm.best.max_abs_err:.3g}", f"{len(lm.candidates)} of {n_candidates(lm)}", runner)
    console.print(table)

    lines = [verdict_line(lm) for lm in r.layers]
    worst = min(r.layers, key=lambda lm: lm.best.o_bits_equal)
    recipes = sorted({(lm.best.preset, lm.best.accumulation) for lm in r.layers})
    named = ", ".join(f"{p} / {a}" for p, a in recipes)
    if worst.best.o_bits_equal == 1.0:
        verdict = f"stored O reproduced 100 % in every selected layer-step ({len(r.layers)}) by {named}"
    else:
        verdict = (f"no known recipe reproduces the stored O: at worst {_pct(worst.best.o_bits_equal)} (step {worst.step} layer "
                   f"{worst.layer}, best {worst.best.preset} / {worst.best.accumulation}); analyses describe the recipe they "
                   f"replay, not the kernel that trained")
    worst = worst.best.o_bits_equal
    warnings = [] if worst >= 0.99 else [
        f"stored O reproduced only {_pct(worst)} by the best known recipe: findings describe that recipe, not the kernel that trained"]
    payload = {
        "layers": [{"step": lm.step, "layer": lm.layer, "heads": lm.heads,
                    "best": {"preset": lm.best.preset, "accumulation": lm.best.accumulation, "o_bits_equal": lm.best.o_bits_equal},
                    "candidates": [{"preset": c.preset, "accumulation": c.accumulation, "o_bits_equal": c.o_bits_equal,
                                    "max_abs_err": c.max_abs_err} for c in lm.candidates]}
                   for lm in r.layers],
        "compared_in": r.compared_in, "all": try_all, "backend": backend, "warnings": warnings, "verdict": verdict,
    }
    write_json(json_path, payload)
    for line in (lines if len(lines) <= 8 else []):
        console.print(line, highlight=False)
    console.print(f"[bold]verdict:[/] {verdict}", highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("match", help="Which recipe reproduces the dump's stored O bit for bit: replays the stored Q, K, V under every "
                               "preset (its own tiling; the GPU kernels' recipes with each of their tiles) and "
                               "accumulation model; the share of O elements reproduced, per layer-step.")
    def command(
        dump: DumpArg,
        step: StepOpt = None,
        layer: LayerOpt = None,
        head: HeadOpt = None,
        try_all: AllOpt = False,
        backend: BackendOpt = "emulate",
        workers: WorkersOpt = 1,
        scheduler: SchedulerOpt = None,
        json_path: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        run_cli(debug, lambda: run(dump, step, layer, head, try_all, backend, json_path, workers, scheduler))
