"""`fa-forensics info`: describe a dump: steps, layers, heads, shapes, dtypes, capture settings."""
from __future__ import annotations

import itertools
import reprlib
import warnings
from typing import Any

import typer
from rich.table import Table

from fa_forensics.commands.common import (
    add_warning, console, err_console, exit_code, open_rank, run_cli, write_json,
)
from fa_forensics.commands.options import DebugOpt, DumpArg, JsonOpt, LayerOpt, RankOpt, StepOpt
from fa_forensics.dump.terminal_text import shown



def _stored_dtype(info: dict) -> str:
    """'bfloat16', or 'bfloat16 (from float32)' when autocast cast fp32 inputs for the kernel."""
    given = info.get("input_dtype")
    return str(info["dtype"]) + (f" (from {given})" if given and given != info["dtype"] else "")


def _unknown(value) -> str:
    return "?" if value is None else str(value)


def layout_text(info: dict) -> str:
    """How the call laid out Q, K, V (its `layout` fact; every store holds (B, H, T, D)): 'BHTD', or e.g.
    'HBTD → BHTD' where the capture transposed them, with O's own layout where it differed."""
    call = info.get("call") or {}
    layout = call.get("layout")
    if not layout:
        return "-"
    text = str(layout) if layout == "BHTD" else f"{layout} → BHTD"
    if call.get("o_layout") and call["o_layout"] != layout:
        text += f" (o {call['o_layout']})"
    return text

def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    if not values:
        return "none"
    parts, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(parts)


_BRIEF = reprlib.Repr()
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = _BRIEF.maxdict = 16
_BRIEF.maxstring = _BRIEF.maxother = _BRIEF.maxlong = 200
_BRIEF.maxlevel = 4


def _brief(value: Any) -> str:
    """A value from a dump as a short cell: at most 16 items of a list or object, 200 characters of a text (a
    hostile attribute of a million values costs what its first few cost to show)."""
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + f"... ({len(value)} characters)"
    return _BRIEF.repr(value)


def _kv(d: dict[str, Any]) -> str:
    """'k=v, ...' as text for a table cell (metadata from a dump is never read as rich markup)."""
    if not d:
        return "-"
    items = list(itertools.islice(d.items(), 32))
    more = f", ... ({len(d)} keys)" if len(d) > len(items) else ""
    return shown(", ".join(f"{k}={_brief(v)}" for k, v in items) + more)


def render(summary: dict[str, Any]) -> None:
    """Print a dump summary as rich tables."""
    run = Table(title=f"dump {shown(str(summary['path']))}", show_header=False, title_justify="left")
    run.add_column("field", style="bold")
    run.add_column("value")
    for key in ("format_version", "tool_version", "torch_version", "device", "amp_dtype", "world_size", "rank",
                "ranks"):
        run.add_row(key, shown(_brief(summary.get(key))))
    run.add_row("model", _kv(summary.get("model") or {}))
    run.add_row("capture", _kv(summary.get("capture") or {}))
    run.add_row("steps", f"{_ranges(summary['steps'])} ({len(summary['steps'])} complete)")
    damaged = sorted(int(s) for s in summary.get("damage") or {})
    cut = [s for s in summary["incomplete_steps"] if s not in damaged]
    if cut:
        run.add_row("incomplete steps", f"[yellow]{_ranges(cut)} (cut off while writing; skipped)[/]")
    if damaged:
        run.add_row("damaged steps", f"[yellow]{_ranges(damaged)} (skipped; `fa-forensics verify` lists the "
                                     "problems)[/]")
    losses = {s: a.get("loss") for s, a in summary.get("step_attrs", {}).items() if a.get("loss") is not None}
    if losses:
        run.add_row("loss", ", ".join(f"{s}: {v:.4g}" for s, v in list(losses.items())[:8])
                    + (" ..." if len(losses) > 8 else ""))
    if summary.get("timeline"):
        run.add_row("timeline", _kv({k: tuple(v) for k, v in summary["timeline"].items()}))
    from fa_forensics.monitor.drops import dropped_steps, dropped_text

    drops = dropped_steps({"capture": summary.get("capture") or {}})
    if drops:
        run.add_row("dropped after alarms", "[yellow]" + shown(dropped_text(drops)) + "[/]")
    if summary.get("do_missing"):
        run.add_row("dO missing", "[yellow]" + shown(do_missing_text(summary["do_missing"]))
                    + " (no gradient of O reached the capture; backward analyses skip them)[/]")
    console.print(run)

    layers = Table(title="layers", title_justify="left")
    for col in ("layer", "module", "heads", "head_dim", "scale", "causal", "dtype", "autocast", "dropout_p", "mask",
                "layout"):
        layers.add_column(col)
    arrays = Table(title="arrays", title_justify="left")
    for col in ("layer", "array", "shape", "dtype", "chunks"):
        arrays.add_column(col)
    for l in summary["layers"]:
        info = summary["layer_info"][str(l)]
        layers.add_row(str(l), shown(str(info["module"] or "-")), _ranges(summary["heads"][str(l)]),
                       str(info["head_dim"]), f"{info['scale']:.6g}", str(info["causal"]), shown(_stored_dtype(info)),
                       shown(_unknown(info.get("autocast"))), f"{info.get('dropout_p') or 0:g}",
                       shown(str(info.get("mask") or "-")), shown(layout_text(info)))
        for n, a in summary["arrays"][str(l)].items():
            arrays.add_row(str(l), n, "×".join(str(x) for x in a["shape"]), str(a["dtype"]),
                           "×".join(str(x) for x in a["chunks"]))
    console.print(layers)
    console.print(arrays)

    truth = summary.get("ground_truth")
    if truth:
        gt = Table(title="ground truth (planted by synth)", show_header=False, title_justify="left")
        gt.add_column("field", style="bold")
        gt.add_column("value")
        for key in ("planted_heads", "planted_feature", "ties", "v_skew", "standout_x_features", "sink_strength",
                    "sink_heads", "seed"):
            gt.add_row(key, shown(_brief(truth.get(key))))
        gt.add_row("tied rows",
                   f"{sum(v['n_tied_rows'] for v in truth.get('ties_layout', {}).values())} in "
                   f"{len(truth.get('ties_layout', {}))} (step, layer, batch, head) slices")
        console.print(gt)


def do_missing(d) -> dict[str, list[int]]:
    """{layer: [complete steps whose recorded layer has no dO]} (the layers a capture saw no gradient of)."""
    return d.do_missing()


def do_missing_text(missing: dict[str, list[int]]) -> str:
    """'layer 1 (steps 3-5); layer 2 (step 4)'."""
    return "; ".join(f"layer {l} (step{'s' if len(s) > 1 else ''} {_ranges(s)})" for l, s in missing.items())


def info(dump: DumpArg, step: StepOpt = None, layer: LayerOpt = None, rank: RankOpt = None, json_out: JsonOpt = None,
         debug: DebugOpt = False) -> None:
    """Describe a dump: steps (incomplete ones apart), layers, heads, shapes, dtypes, capture settings."""

    def body() -> None:
        from fa_forensics.dump import IncompleteStepWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IncompleteStepWarning)  # shown in the table instead
            d = open_rank(dump, rank)
        summary = d.summary(step=step, layer=layer)
        summary["do_missing"] = do_missing(d)
        summary["warnings"] = ([f"no dO recorded for {do_missing_text(summary['do_missing'])}: no gradient of O "
                                "reached the capture; backward analyses skip these layer-steps"]
                               if summary["do_missing"] else [])
        rank_lines = [f"{problem.line(d.path)}; it is not read as a rank of this run" for problem in d.rank_damage]
        summary["warnings"] += rank_lines
        render(summary)
        for line in rank_lines:
            add_warning(line)
        write_json(json_out, summary)
        return empty_dump_code(d)

    code = run_cli(debug, body)
    if code:
        exit_code(code)


def empty_dump_code(d) -> int:
    """1 with one line on stderr when the dump holds no step and no timeline (a capture that saw no
    attention call), else 0."""
    if d.steps or d.incomplete_steps or d.timeline_shapes():
        return 0
    err_console.print(f"[bold yellow]empty:[/] {shown(d.path)} holds no recorded step (its capture saw no attention "
                      "call, or reached no selected step); "
                      "re-capture naming the attention (fa-forensics capture --attention MODULE:QUALNAME ...)",
                      highlight=False, soft_wrap=True)
    return 1


def register(app: typer.Typer) -> None:
    app.command("info")(info)
