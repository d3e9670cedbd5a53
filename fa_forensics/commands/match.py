"""`fa-forensics match`: which recipe reproduces the stored O bit for bit (replay fidelity)."""
from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from fa_forensics.commands.common import (
    console, open_rank, parse_ranks, print_warnings, progress_bar, run_cli, use_match_cache, write_json,
)
from fa_forensics.commands.options import ALL_RANKS, RanksOpt, shared, signature
from fa_forensics.layers.cluster_wait import WORKER_WAIT_SECONDS

AllOpt = Annotated[bool, typer.Option("--all", help="Try every recipe, whatever the recorded facts, on every element, "
                                                    "also after one reproduces the stored O 100 %.")]

NAMED_FROM = 0.9999  # from this share on, the best recipe is called the run's model, on any device
LAST_BITS_ULPS = 4  # differences of at most this many ulps are "the last bits"


def _pct(x: float, *, floor: bool = False) -> str:
    """"100 %" only for every bit; otherwise `wording.bit_share` with two decimals (floor: a lower bound, cut)."""
    from fa_forensics.analyses.wording import bit_share

    return "100 %" if x == 1.0 else bit_share(x, 2, floor=floor, max_digits=12)


def _ulps(n) -> str:
    return f"{n} ulp" + ("" if n == 1 else "s")


def verdict_line(layer, why=None) -> str:
    """'step S layer L: stored O reproduced 100 % by PRESET / ACCUMULATION' (or the best share), or why
    the stored O cannot be reproduced there."""
    b = layer.best
    if why:
        return (f"step {layer.step} layer {layer.layer}: fidelity unverifiable ({why}); best by chance "
                f"{b.preset} / {b.accumulation}")
    return (f"step {layer.step} layer {layer.layer}: stored O reproduced {_pct(b.o_bits_equal)} by {b.preset} / "
            f"{b.accumulation}")


def _sample_share(lm, c) -> float:
    """The share of the layer's row sample `c` reproduces (its share where it was not measured on a sample)."""
    sampled = next((x for x in lm.candidates if x.sampled), None)
    if c.sample_equal is None or sampled is None:
        return c.o_bits_equal
    return c.sample_equal / sampled.n_elements


def runner_up(lm):
    """The best candidate other than the best recipe (compared by name: a cached match has equal copies): of those
    replayed on every element, else of those screened on the row sample."""
    best = (lm.best.preset, lm.best.accumulation)
    others = [c for c in lm.candidates if (c.preset, c.accumulation) != best]
    whole = [c for c in others if not c.sampled]
    if whole:
        return max(whole, key=lambda c: c.o_bits_equal)
    return max(others, key=lambda c: c.sample_equal or 0) if others else None


def outranked(lm, facts) -> str | None:
    """Why the runner-up, where it reproduces more than the best, is not the one named (one line), else None."""
    from fa_forensics.fidelity.candidates import why_not_named

    second = runner_up(lm)
    if second is None:
        return None
    if second.sampled:
        second_share, best_share = _sample_share(lm, second), _sample_share(lm, lm.best)
        measure = "of the row sample"
    else:
        second_share, best_share, measure = second.o_bits_equal, lm.best.o_bits_equal, "of the stored O"
    if second_share <= best_share:
        return None
    why = why_not_named(lm.best, second, facts) or "it was not replayed on every element"
    return (f"step {lm.step} layer {lm.layer}: the runner-up {second.preset} / {second.accumulation} reproduces "
            f"{_pct(second_share)} {measure}, more than {lm.best.preset} / {lm.best.accumulation} "
            f"({_pct(best_share)}): {why}")


def _runner_cell(lm) -> str:
    second = runner_up(lm)
    if second is None:
        return "—"
    if second.sampled:
        return f"{second.preset} / {second.accumulation} {_pct(second.o_bits_equal)} (row sample)"
    return f"{second.preset} / {second.accumulation} {_pct(second.o_bits_equal)}"


def _why(lm, facts) -> str | None:
    """Why the layer-step's stored O cannot be compared: a recorded fact, else the layout check."""
    return facts.unverifiable() or lm.unverifiable


def _reproduction(seen: list, fp32: bool) -> str:
    """The part of the verdict on the layer-steps whose stored O can be compared: one wording on every device."""
    worst = min(seen, key=lambda lm: lm.best.o_bits_equal)
    b = worst.best
    named = ", ".join(f"{p} / {a}" for p, a in sorted({(lm.best.preset, lm.best.accumulation) for lm in seen}))
    where = f"step {worst.step} layer {worst.layer}"
    if b.o_bits_equal == 1.0:
        return f"stored O reproduced 100 % in every selected layer-step ({len(seen)}) by {named}"
    rest = f"; the other elements differ by at most {_ulps(b.max_ulp)}" if b.max_ulp is not None else ""
    if b.o_bits_equal >= NAMED_FROM:
        return (f"stored O reproduced to at least {_pct(b.o_bits_equal, floor=True)} in every selected layer-step "
                f"({len(seen)}) by {named} (worst: {where}{rest}: what the recipe does not model, "
                "docs/gpu-fidelity.md)")
    if b.max_ulp is not None and b.max_ulp <= LAST_BITS_ULPS:
        why = "an fp32 kernel that sums in another order" if fp32 else "a kernel that sums in another order"
        return (f"no known recipe reproduces every bit of the stored O: at worst {_pct(b.o_bits_equal)} ({where}, "
                f"best {b.preset} / {b.accumulation}), the other elements differ in the last bits (at most "
                f"{_ulps(b.max_ulp)}: {why})")
    ulps = f", differences up to {_ulps(b.max_ulp)}" if b.max_ulp is not None else ""
    return (f"no known recipe reproduces the stored O: at worst {_pct(b.o_bits_equal)} ({where}, best {b.preset} / "
            f"{b.accumulation}{ulps}); analyses describe the recipe they replay, not the kernel that trained")


def _verdict(r, facts: dict) -> tuple[str, list[str]]:
    """(the verdict, its warnings): led by the run's precision where it is fp32; layers whose O cannot be
    reproduced (attention dropout, a score_mod, a layout that does not fit) are named, not ranked."""
    from fa_forensics.analyses.contract import FIDELITY_WARN_BELOW, MISMATCH_TEST_ABOVE
    from fa_forensics.fidelity.candidates import implied
    from fa_forensics.fidelity.recipe import FALLBACK_PRESET

    why = {(lm.step, lm.layer): _why(lm, facts[(lm.step, lm.layer)]) for lm in r.layers}
    blind = [lm for lm in r.layers if why[(lm.step, lm.layer)]]
    seen = [lm for lm in r.layers if lm not in blind]
    fp32 = bool(r.layers) and all(facts[(lm.step, lm.layer)].is_fp32_run for lm in r.layers)
    lead = ("trained in fp32: no low-precision rounding to analyse (the analyses show what bf16 would do on these "
            "inputs); " if fp32 else "")
    parts, warnings = [], []
    if blind:
        first = facts[(blind[0].step, blind[0].layer)]
        preset, acc, _ = implied(first, FALLBACK_PRESET)
        where = ", ".join(f"step {lm.step} layer {lm.layer}" for lm in blind[:4]) + (" …" if len(blind) > 4 else "")
        parts.append(f"fidelity unverifiable at {where}: {why[(blind[0].step, blind[0].layer)]}; the analyses replay "
                     f"{preset} / {acc.value}, the recipe the recorded settings imply")
        warnings.append(parts[-1])
    if seen:
        worst = min(seen, key=lambda lm: lm.best.o_bits_equal)
        parts.append(_reproduction(seen, fp32))
        share = worst.best.o_bits_equal
        if not fp32 and MISMATCH_TEST_ABOVE <= share < FIDELITY_WARN_BELOW:
            warnings.append(f"stored O reproduced only {_pct(share)} by the best known recipe: every "
                            f"analysis tests whether the mismatches are biased (replay_fidelity.mismatch)")
        elif not fp32 and share < FIDELITY_WARN_BELOW:
            warnings.append(f"stored O reproduced only {_pct(share)} by the best known recipe: "
                            f"findings describe that recipe, not the kernel that trained")
    excluded = [lm for lm in r.layers if lm.excluded_winner is not None]
    if excluded:
        def said(lm) -> str:
            w = lm.excluded_winner
            beyond = "" if w.discordant is None else (
                f" ({w.discordant[0]} elements only it reproduces, {w.discordant[1]} only the best does: McNemar "
                f"p = {w.p_value:.2g})")
            return (f"step {lm.step} layer {lm.layer}: the recorded {' and '.join(w.facts)} excluded {w.preset} / "
                    f"{w.accumulation}, which reproduces {_pct(w.o_bits_equal)} of the stored O against "
                    f"{_pct(lm.best.o_bits_equal)} for the best allowed{beyond}")

        more = f"; and {len(excluded) - 3} more layer-steps" if len(excluded) > 3 else ""
        warnings.append("; ".join(said(lm) for lm in excluded[:3]) + more
                        + ": if the record is wrong, correct it (capture or import again), or run match --all")
    return lead + "; ".join(parts), warnings


def _notes(r, facts: dict) -> list[str]:
    """What the reader should know about the facts the search used: facts set aside, facts `--all` overrode,
    facts not recorded, and a runner-up that reproduces more than the best."""
    notes = []
    for lm in r.layers:
        if lm.relaxed:
            notes.append(f"step {lm.step} layer {lm.layer}: no recipe models the recorded "
                         f"{' and '.join(lm.relaxed)} together with the other facts; they were set aside")
        line = outranked(lm, facts[(lm.step, lm.layer)])
        if line:
            notes.append(line)
    if r.overridden:
        counts: dict[str, int] = {}
        for over in r.overridden.values():
            for fact, n in over.items():
                counts[fact] = max(counts.get(fact, 0), n)
        notes.append("--all tried every recipe, also those the recorded facts exclude ("
                     + ", ".join(f"{fact}: {n}" for fact, n in sorted(counts.items())) + " recipes)")
    unknown = [lm for lm in r.layers if facts[(lm.step, lm.layer)].softmax is None]
    if unknown:
        notes.append(f"the softmax variant is not recorded ({len(unknown)} layer-step(s)): both were tried; record it "
                     "with --softmax at capture (standard, stabilized or ENV=VALUE) or with import --softmax")
    imperfect = [lm for lm in r.layers if lm.best.o_bits_equal < 1.0]
    assumed = sorted({a for lm in imperfect for a in facts[(lm.step, lm.layer)].assumed})
    if assumed:
        notes.append(f"the import assumed {' and '.join(assumed)} (the file did not say): if the run differed, "
                     f"import again with " + " ".join(f"--{a}" for a in assumed))
    return notes


def _layer_json(lm, facts, why, over) -> dict:
    w = lm.excluded_winner
    return {"step": lm.step, "layer": lm.layer, "heads": lm.heads,
            "best": {"preset": lm.best.preset, "accumulation": lm.best.accumulation,
                     "o_bits_equal": lm.best.o_bits_equal, "max_ulp": lm.best.max_ulp},
            "run_precision": facts.precision, "unverifiable": why, "recipes_admitted": lm.n_admitted,
            "relaxed": list(lm.relaxed), "overridden": over,
            "excluded_winner": None if w is None else {"preset": w.preset, "accumulation": w.accumulation,
                                                       "o_bits_equal": w.o_bits_equal, "facts": w.facts,
                                                       "p_value": w.p_value,
                                                       "discordant": None if w.discordant is None
                                                       else list(w.discordant)},
            "candidates": [{"preset": c.preset, "accumulation": c.accumulation, "o_bits_equal": c.o_bits_equal,
                            "max_abs_err": c.max_abs_err, "max_ulp": c.max_ulp, "sampled": c.sampled,
                            "n_elements": c.n_elements} for c in lm.candidates]}


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
    from fa_forensics.dump.terminal_text import shown

    for line in (lines if len(lines) <= 8 else []):
        console.print(shown(line), highlight=False)
    for note in payload["notes"]:
        console.print(f"note: {shown(note)}", highlight=False, soft_wrap=True)
    console.print(f"[bold]verdict:[/] {shown(payload['verdict'])}", highlight=False)


def _match_rank(dump, step, layer, head, try_all: bool, backend: str, fan_out, several: bool) -> tuple[dict, list]:
    """Match the selected layer-steps of one rank's tree: print its table, return its JSON payload and its verdict
    lines (lines, verdict and warnings name the rank when the store holds several)."""
    from fa_forensics.fidelity.match import match
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
    for lm in r.layers:
        admitted = len(lm.candidates) if try_all else lm.n_admitted
        screened = sum(c.sampled for c in lm.candidates)
        tried = f"{len(lm.candidates)} of {admitted}" + (f" ({screened} on a row sample)" if screened else "")
        table.add_row(str(lm.step), str(lm.layer), f"{lm.best.preset} / {lm.best.accumulation}",
                      _pct(lm.best.o_bits_equal), f"{lm.best.max_abs_err:.3g}", tried, _runner_cell(lm))
    console.print(table)

    facts = {(lm.step, lm.layer): facts_at(dump, lm.step, lm.layer) for lm in r.layers}
    why = {(lm.step, lm.layer): _why(lm, facts[(lm.step, lm.layer)]) for lm in r.layers}
    lines = [who + verdict_line(lm, why[(lm.step, lm.layer)]) for lm in r.layers]
    verdict, warnings = _verdict(r, facts)
    notes = _notes(r, facts)
    payload = {
        "layers": [_layer_json(lm, facts[(lm.step, lm.layer)], why[(lm.step, lm.layer)],
                               r.overridden.get((lm.step, lm.layer), {})) for lm in r.layers],
        "compared_in": r.compared_in, "all": try_all, "backend": backend, "warnings": [who + w for w in warnings],
        "notes": [who + n for n in notes], "verdict": who + verdict,
    }
    return ({"rank": dump.rank, **payload} if several else payload), lines


def register(app: typer.Typer) -> None:
    def command(**options: Any) -> None:
        debug = options.pop("debug")

        def body():
            use_match_cache(options.pop("match_cache"))
            return run(options.pop("dump"), **options)

        run_cli(debug, body)

    command.__signature__ = signature(["dump", "step", "layer", "head", shared("rank", RanksOpt),
                                       ("try_all", AllOpt, False), "backend", "match_cache", "workers", "scheduler",
                                       "worker_wait", "json_path", "debug"])
    app.command("match",
                help="Which recipe reproduces the dump's stored O bit for bit: replays the stored Q, K, V under the "
                     "recipes the recorded facts admit (precision, softmax, device and kernel; each preset with its "
                     "own tiling, the GPU kernels' recipes with each of their tiles, every accumulation model), "
                     "screened on a row sample and confirmed on every element; the share of O elements reproduced, "
                     "per layer-step.")(command)
