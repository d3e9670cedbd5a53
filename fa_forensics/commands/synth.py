"""`fa-forensics synth`: plant a synthetic dump with known ties, sign skew and stand-out features."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from fa_forensics.commands.common import console, run_cli, write_json
from fa_forensics.commands.options import DebugOpt, JsonOpt
from fa_forensics.errors import ConfigError


def _heads(text: str, flag: str = "--planted-heads") -> tuple[int, ...]:
    try:
        return tuple(int(h) for h in text.split(",") if h.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r} must be comma-separated head indices, e.g. 1 or 0,2") from None


def synth(
    out: Annotated[Path, typer.Option("--out", help="Dump store (.zarr) to create.", show_default=False)],
    seq: Annotated[int, typer.Option("--seq", help="Sequence length T.")] = 256,
    heads: Annotated[int, typer.Option("--heads", help="Number of heads H.")] = 4,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head dimension D.")] = 64,
    batch: Annotated[int, typer.Option("--batch", help="Batch size B.")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Number of steps (0..S-1).")] = 4,
    layers: Annotated[int, typer.Option("--layers", help="Number of layers.")] = 1,
    ties: Annotated[int, typer.Option("--ties",
                                      help="K: how many times the row maximum is attained in planted rows.")] = 2,
    sink_strength: Annotated[Optional[float],
                             typer.Option("--sink-strength",
                                          help="Δ: plant sinks (first 4 keys score Δ above N(0,1) noise) in the other "
                                               "heads.")] = None,
    v_skew: Annotated[float, typer.Option("--v-skew",
                                          help="Fraction of tokens whose planted V feature is negative.")] = 1.0,
    planted_heads: Annotated[str,
                             typer.Option("--planted-heads",
                                          help="Comma-separated heads that get the planted mechanism.")] = "1",
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    tie_groups: Annotated[int, typer.Option("--tie-groups",
                                            help="Tie groups per (step, layer, batch row, planted head).")] = 8,
    tie_start: Annotated[float, typer.Option("--tie-start",
                                             help="Fraction of T from which the tie groups' keys are drawn: rows "
                                                  "before their keys have no tie.")] = 0.0,
    previous_token_heads: Annotated[str, typer.Option(
        "--previous-token-heads",
        help="Comma-separated heads (not planted) whose every query attends mostly to the key before it.")] = "",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out if it is an existing dump.")] = False,
    json_out: JsonOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Plant a synthetic dump with known ties, sign skew and stand-out features; verify the planted bias."""

    def body() -> None:
        from fa_forensics.dump import open_dump
        from fa_forensics.planted import SynthSpec, check_planted
        from fa_forensics.planted import synth as make

        spec = SynthSpec(
            seq=seq, heads=heads, head_dim=head_dim, batch=batch, steps=steps, layers=layers, ties=ties,
            sink_strength=sink_strength, v_skew=v_skew, planted_heads=_heads(planted_heads), seed=seed,
            tie_groups=tie_groups, tie_start=tie_start,
            previous_token_heads=_heads(previous_token_heads, "--previous-token-heads"),
        )
        truth = make(out, spec, overwrite=overwrite)
        check = check_planted(open_dump(out))
        table = Table(title=f"planted dump {out}", show_header=False, title_justify="left")
        table.add_column("field", style="bold")
        table.add_column("value")
        for key in ("planted_heads", "planted_feature", "ties", "v_skew", "standout_x_features", "sink_strength",
                    "previous_token_heads", "seed"):
            table.add_row(key, str(truth[key]))
        table.add_row("O_lp - O_hp, planted feature",
                      f"{check.o_bias_mean:+.3e} ± {check.o_bias_se:.1e} (negative in "
                      f"{check.o_bias_negative_fraction:.0%} of {check.rows} rows, sign test p = "
                      f"{check.o_bias_sign_p:.1e})")
        table.add_row("Σ (δ_lp - δ_hp)",
                      f"{check.delta_sum:+.3e} ± {check.delta_se_of_sum:.1e} (positive in "
                      f"{check.delta_positive_fraction:.0%} of rows, sign test p = {check.delta_sign_p:.1e})")
        table.add_row("planted feature's rank by Σ dO·(O_lp - O_hp)", str(check.feature_rank))
        console.print(table)
        write_json(json_out, {"out": str(out), "ground_truth": truth, "check": check})

    run_cli(debug, body)


def register(app: typer.Typer) -> None:
    app.command("synth")(synth)
