"""`fa-forensics import` / `export`: convert between safetensors files and dump stores."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fa_forensics.commands.common import console, open_rank, ranks_line, run_cli, write_json
from fa_forensics.commands.options import DebugOpt, DumpArg, JsonOpt, LayerOpt, RankOpt, StepOpt

OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace the destination if it exists.")]


def _fact_option(name: str, what: str):
    return Annotated[Optional[str], typer.Option(f"--{name}", help=f"{what} Default: what the file's metadata says, "
                                                                   "else unknown.", show_default=False)]


DeviceOpt = _fact_option("device", "The device the run computed on (cuda, cuda:0, cpu), for every layer.")
KernelOpt = _fact_option("kernel", "The kernel or entry point that computed O: sdpa (any SDPA backend), sdpa-cudnn, "
                                   "sdpa-flash, sdpa-efficient, flash_attn, xformers, flex_attention, or a function's "
                                   "name (custom code).")
AutocastOpt = _fact_option("autocast-dtype", "Autocast's dtype in the run (bfloat16, float16), or none (no "
                                             "autocast).")
SoftmaxOpt = _fact_option("softmax", "The softmax variant the attention computed: standard or stabilized (the "
                                     "paper's fix).")
CausalOpt = Annotated[Optional[str], typer.Option("--causal", help="Whether the attention was causal: true or false. "
                                                  "Default: the file's metadata, else true (recorded as assumed).",
                                                  show_default=False)]
ScaleOpt = Annotated[Optional[float], typer.Option("--scale", help="The softmax scale. Default: the file's metadata, "
                                                   "else 1/sqrt(D) (recorded as assumed).", show_default=False)]


def _report(verb: str, result, rank_text: str = "") -> None:
    facts = ", ".join(f"{k}={v}" for k, v in result.facts.items())
    assumed = f"; assumed {', '.join(result.assumed)}" if result.assumed else ""
    console.print(
        f"{verb} {result.n_tensors} tensors ({len(result.steps)} steps, layers {result.layers}) "
        f"{result.source}{rank_text} -> {result.destination} (causal={result.causal}, "
        f"scale={'1/sqrt(D)' if result.scale is None else result.scale}"
        + (f", {facts}" if facts else "") + f"{assumed})", highlight=False,
        soft_wrap=True,
    )


def import_cmd(
    file: Annotated[Path, typer.Argument(help="safetensors file with tensors named step{S}.layer{L}.{q,k,v,o,do,x}.",
                                         show_default=False)],
    to: Annotated[Path, typer.Option("--to", help="Dump store (.zarr) to create.", show_default=False)],
    device: DeviceOpt = None,
    kernel: KernelOpt = None,
    autocast_dtype: AutocastOpt = None,
    softmax: SoftmaxOpt = None,
    causal: CausalOpt = None,
    scale: ScaleOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Import a safetensors file (names step{S}.layer{L}.{q,k,v,o,do,x}; metadata causal, scale, device, kernel,
    autocast_dtype, softmax) into a dump store. The run's facts come from the file or these options, never from
    this machine; a fact neither gives is recorded as unknown."""

    def body() -> None:
        from fa_forensics.dump.safetensors_io import import_safetensors

        facts = {"device": device, "kernel": kernel, "autocast_dtype": autocast_dtype, "softmax": softmax,
                 "causal": causal, "scale": scale}
        result = import_safetensors(file, to, overwrite=overwrite,
                                    facts={k: v for k, v in facts.items() if v is not None})
        _report("imported", result)
        write_json(json_out, result)

    run_cli(debug, body)


def export_cmd(
    dump: DumpArg,
    to: Annotated[Path, typer.Option("--to", help="safetensors file to write.", show_default=False)],
    step: StepOpt = None,
    layer: LayerOpt = None,
    rank: RankOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Export a dump store's complete steps to a safetensors file with the same tensor names, dtypes kept."""

    def body() -> None:
        from fa_forensics.analyses.jsonable import to_jsonable
        from fa_forensics.dump.safetensors_io import export_safetensors

        d = open_rank(dump, rank, "--rank R exports another")
        result = export_safetensors(d.path, to, steps=step, layers=layer, overwrite=overwrite, rank=d.rank)
        _report("exported", result, f" (rank {d.rank})" if ranks_line(d) else "")
        write_json(json_out, {**to_jsonable(result), "rank": d.rank})

    run_cli(debug, body)


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)
    app.command("export")(export_cmd)
