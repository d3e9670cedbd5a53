"""`fa-forensics bitdiff DUMP --a X --b Y`: the tensor mode of bitdiff (the command itself, with its
--add mode, lives in commands/bitdiff.py and calls `run_tensor_mode`).

Each side is "dump" (the O stored in the dump) or a replay preset (bf16, fp32, stabilized, ...,
see ReplayConfig.preset) replayed with the chosen accumulation model on the stored q, k, v.
"""
from __future__ import annotations

from rich.table import Table

from fa_forensics.commands.common import console, ensure_out_dir, run_cli, write_json
from fa_forensics.errors import UserError


def _side_config(name: str, accumulation: str):
    """None for the stored O, else the preset with the chosen accumulation."""
    from fa_forensics.replay.config import PRESETS, Accumulation, ReplayConfig

    if name == "dump":
        return None
    if name not in PRESETS:
        raise UserError(f"--a/--b {name!r} is not 'dump' or a preset; choose one of: dump, {', '.join(PRESETS)}")
    return ReplayConfig.preset(name).with_(accumulation=Accumulation(accumulation))


def bitdiff_dump(dump, a: str, b: str, step=None, layer=None, head=None, accumulation: str = "ieee",
                 backend: str = "emulate", on_progress=None):
    """Compare side a against side b on every selected layer-step (one batched replay per side)."""
    from fa_forensics.analyses.bitdiff import compare_layer_step, summarize
    from fa_forensics.analyses.selection import check_accumulation, check_backend, load, replay_layer, select

    check_accumulation(accumulation)
    check_backend(backend)
    configs = {name: _side_config(name, accumulation) for name in (a, b)}
    parts = []
    for sel in select(dump, step, layer, head):
        t = load(dump, sel)
        sides = {}
        for name, cfg in configs.items():
            if cfg is None:
                if t.o is None:
                    raise UserError(f"{dump.path}: step {sel.step} layer {sel.layer} has no stored 'o'; compare two presets instead of 'dump'")
                sides[name] = t.o
            else:
                sides[name] = replay_layer(t, cfg, backward=False, backend=backend).o
        parts.append(compare_layer_step(sides[a], sides[b], step=sel.step, layer=sel.layer, heads=sel.heads))
        if on_progress is not None:
            on_progress()
    return summarize(parts, a, b)


def payload_of(r) -> dict:
    """The --json payload (keys documented in the README)."""
    return {
        "a": r.a, "b": r.b, "format": r.fmt, "steps": r.steps, "n_elements": r.n_elements,
        "mismatch_rate": r.mismatch_rate,
        "ulp_hist": r.ulp_hist,
        "mean_signed_error": r.mean_signed_error,
        "biased_features": r.biased_features,
        "alpha": r.alpha, "n_cells": r.n_cells,
        "largest": r.largest,
    }


def _run(dump_path, a, b, step, layer, head, accumulation, backend, out, json_path):
    from fa_forensics.analyses.selection import select
    from fa_forensics.commands.common import progress_bar
    from fa_forensics.dump import open_dump

    if not a or not b:
        raise UserError("bitdiff tensor mode needs both --a and --b (each 'dump' or a preset such as bf16, fp32, stabilized)")
    if a == b:
        raise UserError(f"--a and --b are both {a!r}; choose two different sides")
    from fa_forensics.analyses.selection import check_accumulation, check_backend

    check_accumulation(accumulation)
    check_backend(backend)
    for side in (a, b):
        _side_config(side, accumulation)  # a bad --a/--b fails here, before the progress bar starts
    dump = open_dump(dump_path)
    out = ensure_out_dir(out)
    with progress_bar(f"replaying {a} and {b}", len(select(dump, step, layer, head))) as advance:
        r = bitdiff_dump(dump, a, b, step, layer, head, accumulation, backend, on_progress=advance)
    payload = payload_of(r)

    table = Table(title=f"bitdiff: {a} vs {b} (bits compared in {r.fmt}; {r.n_elements} elements)")
    table.add_column("ULP distance (a − b)", justify="right")
    table.add_column("count", justify="right")
    for label, count in zip(r.ulp_hist["bins"], r.ulp_hist["counts"]):
        if count:
            table.add_row(label, str(count))
    console.print(table)
    if r.biased_features:
        bt = Table(title=f"biased features (sign test p < {r.alpha:g}/{r.n_cells}, Bonferroni)")
        for c in ("layer", "head", "feature", "mean a − b ± se", "frac > 0", "p"):
            bt.add_column(c, justify="right")
        for c in r.biased_features[:12]:
            bt.add_row(str(c.layer), str(c.head), str(c.feature), f"{c.mean:+.3e} ± {c.se:.1e}", f"{c.frac_positive:.2f}", f"{c.p_value:.2g}")
        console.print(bt)
    if r.largest:
        lt = Table(title="largest differences")
        for c in ("step/layer/head", "b,row,feat", "a", "b", "ULP", "a bits", "b bits"):
            lt.add_column(c)
        for d in r.largest[:5]:
            lt.add_row(f"{d.step}/{d.layer}/{d.head}", f"{d.batch},{d.row},{d.feature}", f"{d.a:.7g}", f"{d.b:.7g}", str(d.ulp), d.a_bits, d.b_bits)
        console.print(lt)
    if out is not None:
        from fa_forensics.figures.bitdiff import plot_bitdiff

        payload["figures"] = [str(p) for p in plot_bitdiff(r, out)]
    write_json(json_path, payload)
    top = r.biased_features[0] if r.biased_features else None
    tail = (f"; most biased: layer {top.layer} head {top.head} feature {top.feature} mean {top.mean:+.3e} ± {top.se:.1e} (p={top.p_value:.2g})"
            if top else "; no feature is significantly biased")
    console.print(f"[bold]verdict:[/] {r.mismatch_rate:.1%} of elements differ in {r.fmt} bits; "
                  f"{len(r.biased_features)} biased feature(s){tail}")


def run_tensor_mode(dump, a, b, step, layer, head, accumulation, backend, out, json_path, debug):
    """Entry point called by the `bitdiff` command when --add is not given."""
    if dump is None:
        run_cli(debug, lambda: (_ for _ in ()).throw(UserError("bitdiff needs a DUMP (tensor mode: --a and --b) or --add A B")))
    return run_cli(debug, lambda: _run(dump, a, b, step, layer, head, accumulation, backend, out, json_path))
