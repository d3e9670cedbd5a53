"""`fa-forensics import` / `export`: convert between safetensors files and dump stores."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fa_forensics.analyses.contract import to_jsonable
from fa_forensics.commands.common import (
    DebugOpt, DumpArg, JsonOpt, LayerOpt, RankOpt, StepOpt, console, open_rank, ranks_line, run_cli, write_json,
)

OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace the destination if it exists.")]


def _report(verb: str, result, rank_text: str = "") -> None:
    console.print(
        f"{verb} {result.n_tensors} tensors ({len(result.steps)} steps, layers {result.layers}) "
        f"{result.source}{rank_text} -> {result.destination} (causal={result.causal}, "
        f"scale={'1/sqrt(D)' if result.scale is None else result.scale})", highlight=False,
        soft_wrap=True,
    )


def import_cmd(
    file: Annotated[Path, typer.Argument(help="safetensors file with tensors named step{S}.layer{L}.{q,k,v,o,do,x}.",
                                         show_default=False)],
    to: Annotated[Path, typer.Option("--to", help="Dump store (.zarr) to create.", show_default=False)],
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Import a safetensors file (names step{S}.layer{L}.{q,k,v,o,do,x}; metadata causal, scale) into a dump store."""

    def body() -> None:
        from fa_forensics.dump.safetensors_io import import_safetensors

        result = import_safetensors(file, to, overwrite=overwrite)
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
        from fa_forensics.dump.safetensors_io import export_safetensors

        d = open_rank(dump, rank, "--rank R exports another")
        result = export_safetensors(d.path, to, steps=step, layers=layer, overwrite=overwrite, rank=d.rank)
        _report("exported", result, f" (rank {d.rank})" if ranks_line(d) else "")
        write_json(json_out, {**to_jsonable(result), "rank": d.rank})

    run_cli(debug, body)


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)
    app.command("export")(export_cmd)
