"""`fa-forensics rank1-sim`: similar rank-1 matrices behind the biased W_Q update (paper §3.3.1, Eq. 2-3, Fig. 4)."""
from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from fa_forensics.commands.common import (
    AccumulationOpt, BackendOpt, DebugOpt, DumpArg, HeadOpt, JsonOpt, LayerOpt, OutOpt, PresetOpt, StepOpt,
    console, ensure_out_dir, run_cli, write_json,
)
from fa_forensics.commands.common import progress_bar
from fa_forensics.commands.isolate import open_selection

TokensOpt = Annotated[int, typer.Option("--tokens", min=1, help="Tokens per step whose rank-1 matrices are compared (largest |δ error| first).")]


def run(dump_path, step, layer, head, tokens, accumulation, backend, out, json_path, preset="bf16"):
    from fa_forensics.analyses.rank1_sim import rank1_sim

    dump, sels = open_selection(dump_path, step, layer, head, accumulation, backend, preset)
    out = ensure_out_dir(out)
    with progress_bar("rank1-sim", len(sels)) as advance:
        r = rank1_sim(dump, sels, accumulation=accumulation, backend=backend, preset=preset, tokens_per_step=tokens, progress=advance)

    table = Table(title=f"rank1-sim: layer {r.focus_layer} head {r.focus_head}, {len(r.tokens)} tokens over steps {r.steps} "
                        f"(lp = preset {r.preset})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("mean pairwise cosine of (PK)[T]ᵀX[T]" if r.has_x else "mean pairwise cosine of (PK)[T] (no X)", f"{r.cosine_offdiag_mean:+.3f}")
    if r.has_x:
        table.add_row("  of which: PK rows / X rows", f"{r.pk_cosine_offdiag_mean:+.3f} / {r.x_cosine_offdiag_mean:+.3f}")
        table.add_row("input features that stand out (share)", ", ".join(f"{c.feature} ({c.weight:.2f})" for c in r.top_columns[:5]))
        table.add_row("singular values of the gradient error Σ E", ", ".join(f"{s:.3g}" for s in r.singular_values[:5]))
        table.add_row("effective rank / top σ² share", f"{r.effective_rank:.2f} / {r.top_sv_ratio:.2f}")
        table.add_row("cross-step alignment of top singular vectors", _fmt(r.cross_step_alignment, "needs ≥ 2 steps"))
        table.add_row("accumulation exponent (1 compounds, 0.5 washes out)", _fmt(r.accumulation_exponent, "needs ≥ 3 steps"))
    console.print(table)

    figures = []
    if out is not None and r.has_x:
        from fa_forensics.figures.rank1_sim import plot_rank1

        figures.append(str(plot_rank1(r, out / f"rank1_sim_l{r.focus_layer}_h{r.focus_head}.png")))
    if not r.has_x:
        verdict = ("the dump stores no X (attention input), so the rank-1 matrices (PK)[T]ᵀX[T] and the W_Q gradient error "
                   f"cannot be formed; PK rows alone have mean cosine {r.cosine_offdiag_mean:+.2f}. Capture with X to run this analysis")
    else:
        expo = r.accumulation_exponent
        trend = "n/a (fewer than 3 steps)" if expo != expo else ("compounds" if expo > 0.75 else "washes out" if expo < 0.65 else "in between")
        verdict = (f"rank-1 matrices have mean cosine {r.cosine_offdiag_mean:+.2f}, dominated by input features "
                   f"{[c.feature for c in r.top_columns[:3]]}; gradient error effective rank {r.effective_rank:.2f}, "
                   f"accumulation exponent {_fmt(expo, 'n/a')} ({trend})")
    payload = {
        "has_x": r.has_x, "focus": {"layer": r.focus_layer, "head": r.focus_head}, "tokens": r.tokens,
        "cosine_offdiag_mean": r.cosine_offdiag_mean, "pk_cosine_offdiag_mean": r.pk_cosine_offdiag_mean,
        "x_cosine_offdiag_mean": r.x_cosine_offdiag_mean, "cosine": r.cosine, "top_columns": r.top_columns,
        "singular_values": r.singular_values, "effective_rank": r.effective_rank, "top_sv_ratio": r.top_sv_ratio,
        "cross_step_alignment": r.cross_step_alignment, "steps": r.steps, "step_norms": r.step_norms,
        "cumulative_norms": r.cumulative_norms, "accumulation_exponent": r.accumulation_exponent,
        "preset": r.preset, "accumulation": r.accumulation, "backend": r.backend, "figures": figures, "verdict": verdict,
    }
    write_json(json_path, payload)
    console.print(f"[bold]verdict:[/] {verdict}")


def _fmt(x: float, missing: str) -> str:
    return missing if x != x else f"{x:.2f}"


def register(app: typer.Typer) -> None:
    @app.command("rank1-sim", help="Similar rank-1 matrices (PK)[T]ᵀX[T] and the accumulation of the W_Q gradient error (paper §3.3.1, Fig. 4).")
    def rank1_cmd(
        dump: DumpArg,
        step: StepOpt = None,
        layer: LayerOpt = None,
        head: HeadOpt = None,
        tokens: TokensOpt = 4,
        preset: PresetOpt = "bf16",
        accumulation: AccumulationOpt = "ieee",
        backend: BackendOpt = "emulate",
        out: OutOpt = None,
        json_path: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        run_cli(debug, lambda: run(dump, step, layer, head, tokens, accumulation, backend, out, json_path, preset))
