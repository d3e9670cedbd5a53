"""`fa-forensics fix-check`: does the stabilized softmax remove the bias (paper §4, App. C)? Exit 0 yes, 1 no."""
from __future__ import annotations

import math
from typing import Annotated

import typer
from rich.table import Table

from fa_forensics.commands.common import (
    AccumulationOpt, BackendOpt, DebugOpt, DumpArg, HeadOpt, JsonOpt, LayerOpt, OutOpt, PresetOpt, StepOpt,
    console, ensure_out_dir, exit_code, run_cli, write_json,
)
from fa_forensics.errors import UserError

BetaOpt = Annotated[float, typer.Option("--beta", help="β of the stabilized softmax (m = β·r_m for a repeated positive maximum; paper: 2 to 8).")]
EpsOpt = Annotated[float, typer.Option("--eps", help="ε: scores within ε of the row maximum count as repeated maxima.")]
OffsetOpt = Annotated[float, typer.Option("--offset", help="Offset of App. C's fixed-offset alternative: m = rowmax + offset.")]


def _fmt(v, se=None, p=None) -> str:
    if v is None:
        return "—"
    s = f"{v:+.3e}"
    if se is not None and math.isfinite(se):
        s += f" ± {se:.1e}"
    if p is not None:
        s += f" (p={p:.2g})"
    return s


def run(dump_path, step, layer, head, beta, eps, offset, accumulation, backend, out, json_path, preset="bf16") -> int:
    from fa_forensics.analyses.fix_check import fix_check_dump, fix_variants
    from fa_forensics.analyses.selection import check_preset, select
    from fa_forensics.commands.common import progress_bar
    from fa_forensics.dump import open_dump

    if not beta > 1:
        raise UserError(f"--beta {beta} must be > 1 (the paper uses 2 to 8)")
    if not eps >= 0:
        raise UserError(f"--eps {eps} must be >= 0")
    if not (math.isfinite(offset) and offset > 0):
        raise UserError(f"--offset {offset} must be a finite number > 0 (the fixed shift m = rowmax + offset of App. C)")
    check_preset(preset)
    dump = open_dump(dump_path)
    out = ensure_out_dir(out)
    n = len(select(dump, step, layer, head)) * len(fix_variants())
    with progress_bar("replaying variants", n) as advance:
        r = fix_check_dump(dump, step, layer, head, beta=beta, eps=eps, offset=offset, accumulation=accumulation,
                           backend=backend, preset=preset, on_progress=advance)
    tg = r.target
    table = Table(title=f"fix-check of preset {r.preset} at layer {tg['layer']} head {tg['head']} feature {tg['feature']} (vs fp32 replay)")
    for c in ("variant", "what", "O bias ± se (sign p)", "Σδ error ± se (sign p)", "max |O − O_fp32|", "P̄=1", "fired rows", "underflow", "NaN", "still biased"):
        table.add_column(c, justify="right" if c not in ("variant", "what") else "left")
    for v in (r.baseline, r.fixed, *r.alternatives):
        table.add_row(v.name, v.what, _fmt(v.o_bias, v.o_bias_se, v.o_bias_p), _fmt(v.delta_err_sum, v.delta_err_se, v.delta_p),
                      f"{v.max_abs_err:.2e}", str(v.p_one_count), str(v.triggered_rows), str(v.underflow), str(v.nan_count),
                      "yes" if v.still_biased else "no")
    console.print(table)
    console.print(f"max P̄ in rows with a repeated maximum: baseline {r.baseline.max_p_bar:.6g}, fixed {r.max_p_bar:.6g}; "
                  f"rows where the fix fired: {r.triggered_rows}")
    payload = {
        "target": r.target, "baseline": r.baseline, "fixed": r.fixed, "alternatives": r.alternatives,
        "bias_reduction": r.bias_reduction, "max_p_bar": r.max_p_bar, "triggered_rows": r.triggered_rows,
        "nan_count": r.nan_count, "removed": r.removed, "verdict": r.verdict, "exit_code": r.exit_code,
        "beta": beta, "eps": eps, "offset": offset, "accumulation": accumulation, "preset": r.preset,
    }
    if out is not None:
        from fa_forensics.figures.fix_check import plot_fix_check

        payload["figures"] = [str(plot_fix_check(r, out / "fix_check.png"))]
    write_json(json_path, payload)
    colour = "green" if r.removed else "red"
    console.print(f"[bold {colour}]verdict:[/] {r.verdict}")
    return r.exit_code


def register(app: typer.Typer) -> None:
    @app.command("fix-check", help="Check that the stabilized softmax removes the bias and the alternatives do not "
                                   "(paper §4, App. C). Exit code 0: removed; 1: not removed; 2: bad input.")
    def fix_check(
        dump: DumpArg,
        step: StepOpt = None,
        layer: LayerOpt = None,
        head: HeadOpt = None,
        beta: BetaOpt = 2.0,
        eps: EpsOpt = 1e-3,
        offset: OffsetOpt = 1.0,
        preset: PresetOpt = "bf16",
        accumulation: AccumulationOpt = "ieee",
        backend: BackendOpt = "emulate",
        out: OutOpt = None,
        json_path: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        code = run_cli(debug, lambda: run(dump, step, layer, head, beta, eps, offset, accumulation, backend, out, json_path, preset))
        exit_code(code)
