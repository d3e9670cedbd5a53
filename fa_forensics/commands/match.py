"""`fa-forensics match`: which recipe reproduces the stored O bit for bit (replay fidelity)."""
from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fa_forensics.commands.common import (
    ALL_RANKS, BackendOpt, DebugOpt, DumpArg, HeadOpt, JsonOpt, LayerOpt, MatchCacheOpt, RanksOpt, SchedulerOpt,
    StepOpt, WorkersOpt, WorkerWaitOpt, console, open_rank, parse_ranks, print_warnings, progress_bar, run_cli,
    use_match_cache, write_json,
)
from fa_forensics.enums import Backend
from fa_forensics.layers.fanout import WORKER_WAIT_SECONDS

AllOpt = Annotated[bool, typer.Option("--all", help="Try every recipe, also after one reproduces the stored O 100 %.")]


def _pct(x: float, *, floor: bool = False) -> str:
    """"100 %" only for every bit; otherwise `wording.bit_share` with two decimals (floor: a lower bound, cut)."""
    from fa_forensics.analyses.wording import bit_share

    return "100 %" if x == 1.0 else bit_share(x, 2, floor=floor, max_digits=12)


KERNEL_MODEL_REPRODUCES = 0.9999  # from this share on, a GPU kernel's model is called that, not "no known recipe"


def _is_kernel_model(preset: str) -> bool:
    """True for a GPU kernel's preset (its exp, row sum or MMA model set), whose last bits may stay unmodelled; the
    other presets are expected to reproduce their code exactly."""
    from fa_forensics.replay.config import ReplayConfig

    return ReplayConfig.preset(preset).is_kernel_model


def verdict_line(layer, why=None) -> str:
    """'step S layer L: stored O reproduced 100 % by PRESET / ACCUMULATION' (or the best share), or why
    the stored O cannot be reproduced there."""
    b = layer.best
    if why:
        return (f"step {layer.step} layer {layer.layer}: fidelity unverifiable ({why}); best by chance "
                f"{b.preset} / {b.accumulation}")
    return (f"step {layer.step} layer {layer.layer}: stored O reproduced {_pct(b.o_bits_equal)} by {b.preset} / "
            f"{b.accumulation}")


def runner_up(lm):
    """The best candidate other than the best recipe (compared by name: a cached match has equal copies)."""
    best = (lm.best.preset, lm.best.accumulation)
    others = [c for c in lm.candidates if (c.preset, c.accumulation) != best]
    return max(others, key=lambda c: c.o_bits_equal) if others else None


def _verdict(r, facts: dict) -> tuple[str, list[str]]:
    """(the verdict, its warnings): led by the run's precision where it is fp32; layers whose O cannot be
    reproduced (attention dropout) are named, not ranked."""
    from fa_forensics.fidelity.candidates import implied
    from fa_forensics.analyses.contract import FIDELITY_WARN_BELOW, MISMATCH_TEST_ABOVE
    from fa_forensics.fidelity.match import unverifiable_reason
    from fa_forensics.fidelity.recipe import FALLBACK_PRESET

    blind = [lm for lm in r.layers if facts[(lm.step, lm.layer)].has_dropout]
    seen = [lm for lm in r.layers if lm not in blind]
    lead = ""
    if r.layers and all(facts[(lm.step, lm.layer)].is_fp32_run for lm in r.layers):
        lead = ("trained in fp32: no low-precision rounding to analyse (the analyses show what bf16 would do on these "
                "inputs); ")
    parts, warnings = [], []
    if blind:
        first = facts[(blind[0].step, blind[0].layer)]
        preset, acc, _ = implied(first, FALLBACK_PRESET)
        where = ", ".join(f"step {lm.step} layer {lm.layer}" for lm in blind[:4]) + (" …" if len(blind) > 4 else "")
        parts.append(f"fidelity unverifiable at {where}: {unverifiable_reason(first)}; the analyses replay {preset} / "
                     f"{acc.value}, the recipe the recorded settings imply")
        warnings.append(parts[-1])
    if seen and lead:
        worst = min(seen, key=lambda lm: lm.best.o_bits_equal)
        parts.append(f"the fp32 replay reproduces {_pct(worst.best.o_bits_equal)} of the stored O at worst (step "
                     f"{worst.step} layer {worst.layer}; an fp32 kernel that sums in another order differs in the last "
                     "bits)")
    elif seen:
        worst = min(seen, key=lambda lm: lm.best.o_bits_equal)
        named = ", ".join(f"{p} / {a}" for p, a in sorted({(lm.best.preset, lm.best.accumulation) for lm in seen}))
        if worst.best.o_bits_equal == 1.0:
            parts.append(f"stored O reproduced 100 % in every selected layer-step ({len(seen)}) by {named}")
        elif (worst.best.o_bits_equal >= KERNEL_MODEL_REPRODUCES
              and all(_is_kernel_model(lm.best.preset) for lm in seen)):
            at_least = _pct(worst.best.o_bits_equal, floor=True)
            parts.append(f"stored O reproduced to at least {at_least} in every selected layer-step ({len(seen)}) by "
                         f"{named} (worst: step {worst.step} layer {worst.layer}; the remaining bits are what the "
                         "kernel's model does not capture, docs/gpu-fidelity.md)")
        else:
            parts.append(f"no known recipe reproduces the stored O: at worst {_pct(worst.best.o_bits_equal)} "
                         f"(step {worst.step} layer {worst.layer}, best {worst.best.preset} / "
                         f"{worst.best.accumulation}); analyses describe the recipe they replay, not the kernel "
                         "that trained")
        if MISMATCH_TEST_ABOVE <= worst.best.o_bits_equal < FIDELITY_WARN_BELOW:
            warnings.append(f"stored O reproduced only {_pct(worst.best.o_bits_equal)} by the best known recipe: every "
                            f"analysis tests whether the mismatches are biased (replay_fidelity.mismatch)")
        elif worst.best.o_bits_equal < FIDELITY_WARN_BELOW:
            warnings.append(f"stored O reproduced only {_pct(worst.best.o_bits_equal)} by the best known recipe: "
                            f"findings describe that recipe, not the kernel that trained")
    return lead + "; ".join(parts), warnings


def run(dump_path, step, layer, head, try_all: bool, backend: str, json_path, workers: int = 1, scheduler=None,
        rank=None, worker_wait: float = WORKER_WAIT_SECONDS) -> None:
    import contextlib

    from fa_forensics.commands.common import build_backend, build_workers
    from fa_forensics.dump import open_dump
    from fa_forensics.layers.fanout import connected

    backend = build_backend(backend).value
    fan_out = build_workers(workers, scheduler, worker_wait)
    asked = parse_ranks(rank)
    if asked != ALL_RANKS:
        dump = open_rank(dump_path, asked, "--rank R matches another, --rank all every rank")
        several = len(dump.ranks) > 1 or dump.world_size > 1
        payload, lines = _match_rank(dump, step, layer, head, try_all, backend, fan_out, several)
        write_json(json_path, {**payload, "rank": dump.rank, "ranks": dump.ranks})
        print_warnings(payload["warnings"])
        _print_verdict(payload, lines)
        return
    ranks = open_dump(dump_path).ranks
    with contextlib.ExitStack() as stack:
        if not fan_out.in_process:
            stack.enter_context(connected(fan_out))  # one cluster for every rank
        matched = [_match_rank(open_dump(dump_path, rank=r), step, layer, head, try_all, backend, fan_out, True)
                   for r in ranks]
    payloads = [payload for payload, _ in matched]
    warnings = [w for p in payloads for w in p["warnings"]]
    verdict = "; ".join(p["verdict"] for p in payloads)
    write_json(json_path, {"rank": ALL_RANKS, "ranks": ranks, "per_rank": payloads, "all": try_all,
                           "backend": backend, "warnings": warnings, "verdict": verdict})
    print_warnings(warnings)
    for payload, lines in matched:
        _print_verdict(payload, lines)


def _print_verdict(payload: dict, lines: list[str]) -> None:
    for line in (lines if len(lines) <= 8 else []):
        console.print(line, highlight=False)
    console.print(f"[bold]verdict:[/] {escape(payload['verdict'])}", highlight=False)


def _match_rank(dump, step, layer, head, try_all: bool, backend: str, fan_out, several: bool) -> tuple[dict, list]:
    """Match the selected layer-steps of one rank's tree: print its table, return its JSON payload and its verdict
    lines (lines, verdict and warnings name the rank when the store holds several)."""
    from fa_forensics.fidelity.candidates import admissible
    from fa_forensics.fidelity.match import candidate_recipes, match, unverifiable_reason
    from fa_forensics.fidelity.run_facts import facts_at
    from fa_forensics.layers.selection import select

    who = f"rank {dump.rank}: " if several else ""
    sels = select(dump, step, layer, head)
    with progress_bar(f"match {who.rstrip(': ')}".rstrip(), len(sels)) as advance:
        r = match(dump, sels, try_all=try_all, backend=backend, progress=advance, workers=fan_out)

    table = Table(title=f"{who}match: share of stored-O elements (in {r.compared_in}) each recipe reproduces bit for "
                        "bit" + ("" if try_all else "; stops at the first 100 % (--all: try every recipe)"))
    for c in ("step", "layer", "best recipe", "o_bits_equal", "max |Δ|", "recipes tried", "runner-up"):
        table.add_column(c, justify="right")

    def n_candidates(lm) -> int:
        """How many recipes the search may try at this layer-step: those the recorded facts admit."""
        info = dump.layer_info(lm.step, lm.layer)
        every = candidate_recipes(info.head_dim, info.arrays["k"][-2], info.dtype, dump.attrs.get("device"))
        return len(admissible(every, facts_at(dump, lm.step, lm.layer)))

    for lm in r.layers:
        second = runner_up(lm)
        runner = f"{second.preset} / {second.accumulation} {_pct(second.o_bits_equal)}" if second else "—"
        table.add_row(str(lm.step), str(lm.layer), f"{lm.best.preset} / {lm.best.accumulation}",
                      _pct(lm.best.o_bits_equal),
                      f"{lm.best.max_abs_err:.3g}", f"{len(lm.candidates)} of {n_candidates(lm)}", runner)
    console.print(table)

    facts = {(lm.step, lm.layer): facts_at(dump, lm.step, lm.layer) for lm in r.layers}
    why = {key: unverifiable_reason(f) if f.has_dropout else None for key, f in facts.items()}
    lines = [who + verdict_line(lm, why[(lm.step, lm.layer)]) for lm in r.layers]
    verdict, warnings = _verdict(r, facts)
    payload = {
        "layers": [{"step": lm.step, "layer": lm.layer, "heads": lm.heads,
                    "best": {"preset": lm.best.preset, "accumulation": lm.best.accumulation,
                             "o_bits_equal": lm.best.o_bits_equal},
                    "run_precision": facts[(lm.step, lm.layer)].precision, "unverifiable": why[(lm.step, lm.layer)],
                    "candidates": [{"preset": c.preset, "accumulation": c.accumulation, "o_bits_equal": c.o_bits_equal,
                                    "max_abs_err": c.max_abs_err} for c in lm.candidates]}
                   for lm in r.layers],
        "compared_in": r.compared_in, "all": try_all, "backend": backend,
        "warnings": [who + w for w in warnings], "verdict": who + verdict,
    }
    return ({"rank": dump.rank, **payload} if several else payload), lines


def register(app: typer.Typer) -> None:
    @app.command("match",
                 help="Which recipe reproduces the dump's stored O bit for bit: replays the stored Q, K, V under every "
                               "preset (its own tiling; the GPU kernels' recipes with each of their tiles) and "
                               "accumulation model; the share of O elements reproduced, per layer-step.")
    def command(
        dump: DumpArg,
        step: StepOpt = None,
        layer: LayerOpt = None,
        head: HeadOpt = None,
        rank: RanksOpt = None,
        try_all: AllOpt = False,
        backend: BackendOpt = Backend.EMULATE,
        match_cache: MatchCacheOpt = None,
        workers: WorkersOpt = 1,
        scheduler: SchedulerOpt = None,
        worker_wait: WorkerWaitOpt = WORKER_WAIT_SECONDS,
        json_path: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        def body():
            use_match_cache(match_cache)
            return run(dump, step, layer, head, try_all, backend, json_path, workers, scheduler, rank, worker_wait)

        run_cli(debug, body)
