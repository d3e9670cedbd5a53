"""`fa-forensics pcast`: FP8 P-cast study: sink-induced collapse, reverse iteration, S = 2^8.

Without a dump: the paper's kernel-faithful simulation (Table 1, Figs. 1-3, the S=1/S=256 MSE
ratio, the paired t-test). With a dump: the same metrics on each captured head's real scores,
its measured sink strength and a recommendation of S and KV order.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from fa_forensics.analyses.pcast import compute as pc
from fa_forensics.analyses.pcast import sim as sim
from fa_forensics.analyses.pcast.e4m3 import dp_sawtooth
from fa_forensics.replay.config import KVOrder
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
            from fa_forensics.analyses.pcast import figure as figs
            from fa_forensics.analyses.pcast.table import sim_tables, tables

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
                for renderable in sim_tables(res):
                    console.print(renderable, highlight=False)
                if out_dir is not None:
                    figures = [str(figs.fig_dp_sawtooth(dp_sawtooth(), out_dir / "pcast_dp_sawtooth.png")),
                               str(figs.fig_mse_vs_delta(res, out_dir / "pcast_mse_vs_delta.png")),
                               str(figs.fig_mse_vs_seq(res, out_dir / "pcast_mse_vs_seq.png"))]
                write_json(json_path, {**sim.payload(res), "figures": figures})
            else:
                from fa_forensics.analyses.selection import select
                from fa_forensics.dump import open_dump

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
