"""The body of `fa-forensics pcast` (its options are registered in fa_forensics.analyses.registry): the FP8
P-cast study: sink-induced collapse, reverse iteration, S = 2^8.

Without a dump: the paper's kernel-faithful simulation (Table 1, Figs. 1-3, the S=1/S=256 MSE
ratio, the paired t-test). With a dump: the same metrics on each captured head's real scores,
its measured sink strength and a recommendation of S and KV order.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from fa_forensics.analyses.pcast import compute as pc
from fa_forensics.analyses.pcast import sim
from fa_forensics.analyses.pcast.e4m3 import dp_sawtooth
from fa_forensics.replay.config import KVOrder
from fa_forensics.commands.common import (
    console, ensure_out_dir, open_rank, phase, print_warnings, run_cli, write_json,
)
from fa_forensics.errors import ConfigError, InvalidSetting, UserError

OPTION_OF = {"n_sinks": "--sinks", "deltas": "--sink-strength", "seqs": "--seq", "block": "--block",
             "n_queries": "--queries", "head_dim": "--head-dim", "n_seeds": "--seeds", "scales": "--scales",
             "orders": "--order"}


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
        raise ConfigError(f"{option} expects a comma-separated list of numbers, got '{text}'; "
                          f"e.g. {option} {example}") from None
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


def run(dump: Optional[Path], sink_strength: str, seq: str, sinks: int, block: int, queries: int, head_dim: int,
        scales: str, order: str, seeds: int, seed: int, step: Optional[int], layer: Optional[int], head: Optional[int],
        rank: Optional[int], out: Optional[Path], json_path: Optional[Path], debug: bool) -> None:
    """The `pcast` command (options: the registry's): the simulation without a dump, the per-head study with one."""

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
            with phase("pcast: simulating the FP8 P-cast kernel"):
                res = sim.simulate(cfg)
            for renderable in sim_tables(res):
                console.print(renderable, highlight=False)
            if out_dir is not None:
                figures = [str(figs.fig_dp_sawtooth(dp_sawtooth(), out_dir / "pcast_dp_sawtooth.png")),
                           str(figs.fig_mse_vs_delta(res, out_dir / "pcast_mse_vs_delta.png")),
                           str(figs.fig_mse_vs_seq(res, out_dir / "pcast_mse_vs_seq.png"))]
            write_json(json_path, {**sim.payload(res), "figures": figures})
        else:
            from fa_forensics.layers.selection import select

            d = open_rank(dump, rank)
            sels = select(d, step if step is not None else (d.steps[-1] if d.steps else None), layer, head)
            with phase("pcast: casting each head's scores through the FP8 P-cast kernel"):
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
