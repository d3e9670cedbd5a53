"""`fa-forensics pcast`: FP8 P-cast study: sink-induced collapse, reverse iteration, S = 2^8.

Without a dump: the paper's kernel-faithful simulation (Table 1, Figs. 1-3, the S=1/S=256 MSE
ratio, the paired t-test). With a dump: the same metrics on each captured head's real scores,
its measured sink strength and a recommendation of S and KV order.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from fa_forensics.analyses import pcast as pc
from fa_forensics.analyses import pcast_sim as sim
from fa_forensics.analyses.pcast_e4m3 import dp_sawtooth
from fa_forensics.replay.config import KVOrder
from fa_forensics.analyses.stats import format_p
from fa_forensics.commands.common import (
    DebugOpt,
    HeadOpt,
    JsonOpt,
    LayerOpt,
    OutOpt,
    console,
    ensure_out_dir,
    print_warnings,
    run_cli,
    to_jsonable,
    write_json,
)
from fa_forensics.errors import ConfigError, InvalidSetting, UserError

HELP = "FP8 P-cast study: sink-induced collapse, reverse iteration, S = 2^8 (simulation, or per head of a dump)."


OPTION_OF = {"n_sinks": "--sinks", "deltas": "--sink-strength", "seqs": "--seq", "block": "--block", "n_queries": "--queries",
             "head_dim": "--head-dim", "n_seeds": "--seeds", "scales": "--scales", "orders": "--order"}


def _worded(body) -> None:
    """Run `body`, rewording the library's InvalidSetting in terms of this command's options."""
    try:
        body()
    except InvalidSetting as exc:
        raise UserError(f"{OPTION_OF.get(exc.setting, exc.setting)}: {exc.reason}") from None


def _numbers(text: str, option: str, cast=float) -> tuple:
    """'1,256,448' -> (1.0, 256.0, 448.0); a one-line error naming the option otherwise."""
    example = {"--scales": "1,256,448", "--sink-strength": "4,5,6,7,8", "--seq": "1024,4096"}.get(option, "1,2,3")
    try:
        values = tuple(cast(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"{option} expects a comma-separated list of numbers, got '{text}'; e.g. {option} {example}")
    if not values:
        raise ConfigError(f"{option} is empty; give at least one value")
    if not all(math.isfinite(v) for v in values):  # nan / inf would fill the tables with nan and exit 0
        raise ConfigError(f"{option} values must be finite numbers, got '{text}'; e.g. {option} {example}")
    return values


def _orders(text: str) -> tuple[KVOrder, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    known = {o.value: o for o in KVOrder}
    if not names or any(n not in known for n in names):
        raise ConfigError(f"--order expects forward and/or reverse, got '{text}'; e.g. --order forward,reverse")
    return tuple(known[n] for n in names)


def _dp_table(points) -> Table:
    t = Table(title="dp(S): worst-case normalized E4M3 step of the P-cast (exhaustive enumeration)")
    for c in ("S", "dp(S)", "dp / 2^-4", "bit-exact"):
        t.add_column(c, justify="right")
    for p in points:
        t.add_row(f"{p.S:g}", f"{p.dp:.4f}", f"{p.dp / 2 ** -4:.3f}", "yes" if p.bit_exact else "no")
    return t


def _render_sim(res: sim.PcastSimResult) -> None:
    n = res.n_main
    t = Table(title=f"Table 1: P-collapse (N = {n}, k = {res.config.n_sinks}, B = {res.config.block}, "
                    f"δ_k = {res.delta_k:.4f} integrated; {res.config.n_seeds} seeds)")
    for c in ("Δ", "S", "order", "frac zeroed ± se", "closed form", "spread-avg", "non-sink mass", "info loss", "MSE ± se"):
        t.add_column(c, justify="right")
    for r in sorted((r for r in res.rows if r.seq == n), key=lambda r: (r.order, r.S, r.delta)):
        t.add_row(f"{r.delta:g}", f"{r.S:g}", r.order.value, f"{r.frac_zeroed:.3f} ± {r.frac_zeroed_se:.3f}",
                  f"{r.closed_form:.3f}", f"{r.closed_form_spread:.3f}", f"{r.nonsink_mass:.3f}", f"{r.info_loss:.3f}",
                  f"{r.mse:.3e} ± {r.mse_se:.1e}")
    console.print(t)
    seqs = sorted({r.seq for r in res.rows if r.delta == sim.DELTA_FIG3})
    if len(seqs) > 1:
        t = Table(title=f"Fig. 3 data: MSE vs N at Δ = {sim.DELTA_FIG3:g}")
        t.add_column("order, S")
        for s in seqs:
            t.add_column(f"N={s}", justify="right")
        for order in res.config.orders:
            for S in res.config.scales:
                cells = [res.row(sim.DELTA_FIG3, S, order, s) for s in seqs]
                t.add_row(f"{order.value} S={S:g}", *[f"{c.mse:.2e}" if c else "-" for c in cells])
        console.print(t)
    console.print(_dp_table(res.dp))
    for ratio in (res.ratio, res.ratio_448):
        if ratio is not None:
            console.print(f"MSE {ratio.numerator} / {ratio.denominator} at Δ = {ratio.delta:g}, N = {ratio.seq}: "
                          f"[bold]{ratio.value:.2f} ± {ratio.se:.2f}[/] (paired over {ratio.n} seeds)")
    if res.ttest:
        t = Table(title=f"Paired t-test: forward S=256 vs reverse S=256 (N = {n}, instances = seeds)")
        for c in ("Δ", "n", "MSE fwd", "MSE rev", "mean diff ± se", "t", "p", "verdict"):
            t.add_column(c, justify="right")
        for x in res.ttest:
            verdict = {"a better": "forward better", "b better": "reverse better"}.get(x.verdict, x.verdict)
            t.add_row(f"{x.delta:g}", str(x.n), f"{x.mse_a:.3e}", f"{x.mse_b:.3e}", f"{x.mean_diff:+.2e} ± {x.se_diff:.1e}",
                      f"{x.t:.2f}", format_p(x.p_value), verdict)
        console.print(t)
    explained = [r for r in res.rows if r.explanation and r.seq == n]
    if explained:
        console.print("[bold]Where measured and closed form differ by more than 0.02:[/]")
        for r in explained:
            console.print(f"  Δ={r.delta:g} S={r.S:g} {r.order.value}: measured {r.frac_zeroed:.3f} vs {r.closed_form:.3f}: {r.explanation}",
                          highlight=False)
    for note in res.notes:
        console.print(f"[dim]note: {note}[/]")


def _sim_payload(res: sim.PcastSimResult, figures: list[str]) -> dict[str, Any]:
    cfg = res.config
    return {
        "mode": "simulation",
        "config": {"deltas": list(cfg.deltas), "seqs": list(cfg.seqs), "n_sinks": cfg.n_sinks, "block": cfg.block,
                   "queries": cfg.n_queries, "head_dim": cfg.head_dim, "scales": list(cfg.scales),
                   "orders": list(cfg.orders), "seeds": cfg.n_seeds, "seed": cfg.seed},
        "delta_k": res.delta_k,
        "sigma_k": res.sigma_k,
        "n_main": res.n_main,
        "rows": to_jsonable(list(res.rows)),
        "dp": [{"S": p.S, "dp": p.dp, "lsb": p.lsb, "bit_exact": p.bit_exact} for p in res.dp],
        "ratio": to_jsonable(res.ratio),
        "ratio_448": to_jsonable(res.ratio_448),
        "ttest": {"a": "forward S=256", "b": "reverse S=256", "seq": res.n_main,
                  "tests": to_jsonable(list(res.ttest))},
        "notes": list(res.notes),
        "figures": figures,
    }


def register(app: typer.Typer) -> None:
    @app.command("pcast", help=HELP)
    def pcast(
        dump: Annotated[Optional[Path], typer.Argument(help="Optional dump store: analyse its real scores per head instead of simulating.", show_default=False)] = None,
        sink_strength: Annotated[str, typer.Option("--sink-strength", help="Sink strengths Δ of the simulation (comma list).", metavar="LIST")] = "4,5,6,7,8,9,10,11,12,13",
        seq: Annotated[str, typer.Option("--seq", help="Sequence lengths N: the Δ sweep runs at 4096 (or the largest N), Fig. 3 at Δ = 7 over all.", metavar="LIST")] = "512,1024,2048,4096,8192,16384",
        sinks: Annotated[int, typer.Option("--sinks", help="Number of sink tokens k (the first k keys).", metavar="K")] = 4,
        block: Annotated[int, typer.Option("--block", help="KV block size B of the kernel.", metavar="B")] = 64,
        queries: Annotated[int, typer.Option("--queries", help="Query rows per instance (simulation).", metavar="Q")] = 32,
        head_dim: Annotated[int, typer.Option("--head-dim", help="Head dimension d (simulation).", metavar="D")] = 128,
        scales: Annotated[str, typer.Option("--scales", help="Static P scales S (comma list).", metavar="LIST")] = "1,256,448",
        order: Annotated[str, typer.Option("--order", help="KV iteration orders (comma list of forward, reverse).", metavar="LIST")] = "forward,reverse",
        seeds: Annotated[int, typer.Option("--seeds", help="Independent instances (seeds) per cell of the simulation.", metavar="N")] = 16,
        seed: Annotated[int, typer.Option("--seed", help="Base random seed of the simulation.")] = 0,
        step: Annotated[Optional[int], typer.Option("--step", help="Training step to analyse in dump mode (default: the last complete step).")] = None,
        layer: LayerOpt = None,
        head: HeadOpt = None,
        out: OutOpt = None,
        json_path: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        def body() -> None:
            from fa_forensics.figures import pcast as figs

            S_list = _numbers(scales, "--scales")
            orders = _orders(order)
            out_dir = ensure_out_dir(out)
            figures: list[str] = []
            if dump is None:
                cfg = sim.SimConfig(deltas=_numbers(sink_strength, "--sink-strength"), seqs=_numbers(seq, "--seq", int),
                                   n_sinks=sinks, block=block, n_queries=queries, head_dim=head_dim, scales=S_list,
                                   orders=orders, n_seeds=seeds, seed=seed)
                with console.status("simulating the FP8 P-cast kernel..."):
                    res = sim.simulate(cfg)
                _render_sim(res)
                if out_dir is not None:
                    figures = [str(figs.fig_dp_sawtooth(dp_sawtooth(), out_dir / "pcast_dp_sawtooth.png")),
                               str(figs.fig_mse_vs_delta(res, out_dir / "pcast_mse_vs_delta.png")),
                               str(figs.fig_mse_vs_seq(res, out_dir / "pcast_mse_vs_seq.png"))]
                write_json(json_path, _sim_payload(res, figures))
            else:
                from fa_forensics.analyses.selection import select
                from fa_forensics.dump import open_dump
                from fa_forensics.tables.pcast import tables

                d = open_dump(dump)
                sels = select(d, step if step is not None else (d.steps[-1] if d.steps else None), layer, head)
                with console.status("casting each head's scores through the FP8 P-cast kernel..."):
                    res = pc.run(d, sels, n_sinks=sinks, block=block, scales=S_list, orders=orders)
                for renderable in tables(res):
                    console.print(renderable, highlight=False)
                if out_dir is not None:
                    figures = [str(p) for p in figs.draw(res, out_dir)]
                write_json(json_path, {**pc.payload(res), "figures": figures})
                print_warnings(res.warnings)
            for f in figures:
                console.print(f"wrote {f}", highlight=False)

        run_cli(debug, lambda: _worded(body))
