"""`fa-forensics pv-trace`: trace the error of one P̄V dot product down to the bits (paper Fig. 6)."""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from fa_forensics.commands.common import (
    AccumulationOpt, BackendOpt, DebugOpt, DumpArg, HeadOpt, JsonOpt, LayerOpt, OutOpt, PresetOpt, StepOpt,
    console, ensure_out_dir, progress_bar, run_cli, write_json,
)

RowOpt = Annotated[Optional[int], typer.Option("--row", help="Query row T to trace (default: the row with the largest error in the chosen feature).")]
FeatureOpt = Annotated[Optional[int], typer.Option("--feature", help="Feature i of V / O to trace (default: the feature with the largest mean O bias).")]


def run(dump_path, step, layer, head, row, feature, accumulation, backend, out, json_path, preset="bf16"):
    from fa_forensics.analyses.pv_trace import pv_trace_dump, report_payload
    from fa_forensics.analyses.selection import check_preset, select
    from fa_forensics.dump import open_dump

    check_preset(preset)
    dump = open_dump(dump_path)
    out = ensure_out_dir(out)
    n = len(select(dump, step, layer, head))
    with progress_bar(f"replaying ({preset} vs fp32)", n) as advance:
        r = pv_trace_dump(dump, step, layer, head, row=row, feature=feature, accumulation=accumulation,
                          backend=backend, preset=preset, on_progress=advance)
    payload = report_payload(r)
    tr = r.trace
    table = Table(title=f"pv-trace ({r.preset} vs fp32): step {r.step} layer {r.layer} head {r.head} batch {r.batch} "
                        f"row {tr.row} feature {tr.feature}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("O bias in this feature (mean ± se, sign p)", f"{r.cell.mean:+.3e} ± {r.cell.se:.1e} (p={r.cell.p_value:.2g})")
    for kind, label in (("repeated_max", "rows with a repeated maximum"), ("other", "other rows")):
        m = r.bias_split[kind]
        if m["n"]:
            table.add_row(f"  O bias in {label} (n={m['n']})", f"{m['mean']:+.3e} ± {m['se']:.1e} (p={m['p_value']:.2g})")
    table.add_row(f"O error of this row (replay; row chosen: {r.row_choice})", f"{r.o_error_replay:+.3e}")
    table.add_row("Ō error of the dot product (Eq. 4)", f"{tr.final_error:+.3e}")
    table.add_row("keys, P̄ = 1 positions", f"{tr.error.numel()}, {tr.p_one_positions[:12]}{' …' if len(tr.p_one_positions) > 12 else ''}")
    table.add_row("jumps (terms with error_step ≠ 0)", str(len(tr.jumps)))
    share = tr.frac_error_from_p_one
    table.add_row("share of the error entering at P̄ = 1", f"{share:.1%}" if share == share else "— (no error)")
    console.print(table)

    big = sorted(tr.jumps, key=lambda j: -abs(j.error_step))[:8]
    if big:
        jt = Table(title="largest jumps")
        for c in ("t", "P̄", "V", "error step", "cast part", "round part", "rounding"):
            jt.add_column(c, justify="right")
        for j in big:
            jt.add_row(str(j.t), f"{j.p_bar:.6g}", f"{j.v:.6g}", f"{j.error_step:+.3e}", f"{j.cast:+.2e}", f"{j.round:+.2e}", j.direction)
        console.print(jt)
    ex = tr.explanation
    if ex is not None:
        console.print(f"[bold]largest jump at t={tr.largest_jump.t}[/]: accumulator {ex.a!r} + term {ex.b!r}")
        console.print(f"  exact   {getattr(ex, 'exact_bits', '')}  ({float(ex.exact)!r})")
        console.print(f"  rounded {ex.rounded_bits}  ({float(ex.rounded)!r}) to {tr.pv_format}: guard {ex.guard} round {ex.round} "
                      f"sticky {ex.sticky} → rounded {ex.direction}, error {float(ex.error):+.6g}")
    if out is not None:
        from fa_forensics.figures.pv_trace import plot_pv_trace

        path = plot_pv_trace(r, out / f"pv_trace_s{r.step}_l{r.layer}_h{r.head}_r{tr.row}_f{tr.feature}.png")
        payload["figures"] = [str(path)]
    write_json(json_path, payload)
    frac = tr.frac_error_from_p_one
    where = "at P̄ = 1 terms" if tr.p_one_positions else "with no P̄ = 1 term in this row"
    console.print(f"[bold]verdict:[/] Ō error {tr.final_error:+.3e}; {frac:.0%} of it entered {where} "
                  f"({len(tr.p_one_positions)} of {tr.error.numel()} terms)" if frac == frac else
                  "[bold]verdict:[/] no error in this dot product (Ō_lp = Ō_hp)")


def register(app: typer.Typer) -> None:
    @app.command("pv-trace", help="Trace the error of one P̄V dot product down to the bits (paper Eq. 4-5, Fig. 6).")
    def pv_trace(
        dump: DumpArg,
        step: StepOpt = None,
        layer: LayerOpt = None,
        head: HeadOpt = None,
        row: RowOpt = None,
        feature: FeatureOpt = None,
        preset: PresetOpt = "bf16",
        accumulation: AccumulationOpt = "ieee",
        backend: BackendOpt = "emulate",
        out: OutOpt = None,
        json_path: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        run_cli(debug, lambda: run(dump, step, layer, head, row, feature, accumulation, backend, out, json_path, preset))
