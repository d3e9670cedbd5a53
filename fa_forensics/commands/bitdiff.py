"""The body of `fa-forensics bitdiff` (its options are registered in fa_forensics.analyses.registry): explain
one addition bit by bit (--add), or compare two O tensors bit by bit.

The --add mode is self-contained (fa_forensics.numerics.explain_add). The tensor mode (a DUMP
and no --add) lives in fa_forensics/commands/bitdiff_tensor.py.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from rich.panel import Panel
from rich.table import Table

from fa_forensics.analyses.registry import INTO_CHOICES
from fa_forensics.commands.common import console, run_cli, write_json
from fa_forensics.errors import UserError



def parse_operand(text: str, name: str) -> float:
    """A decimal number, a 32-character binary fp32 bit pattern, or a 0x hex fp32 bit pattern."""
    import struct

    raw = text.strip()
    compact = raw.replace("_", "").replace(" ", "")
    if re.fullmatch(r"[01]{32}", compact):
        return struct.unpack(">f", int(compact, 2).to_bytes(4, "big"))[0]
    if re.fullmatch(r"0[xX][0-9a-fA-F]{1,8}", compact):
        return struct.unpack(">f", int(compact, 16).to_bytes(4, "big"))[0]
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or value != value or value in (float("inf"), float("-inf")):
        raise UserError(
            f"--add: operand {name} {text!r} is not a finite number; give a decimal (-2.4071154594421387), "
            "a 32-character fp32 bit pattern (11000000000110100000111000101110) or 0x hex (0xc01a0e2e)"
        )
    return value


def _fields(bits: str, exp_bits: int) -> str:
    return f"{bits[0]} {bits[1:1 + exp_bits]} {bits[1 + exp_bits:]}"


def render_add(ex) -> Panel:
    """A paper-style printout of an AddExplanation."""
    from fa_forensics.numerics import get_format

    acc, into = get_format(ex.acc), get_format(ex.into)
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True, min_width=13)
    t.add_column(no_wrap=True)
    dim = lambda text: f"[dim]{text}[/]"  # noqa: E731
    t.add_row("A", f"{_fields(ex.a_bits, acc.exp_bits)}  {ex.a!r}")
    t.add_row("B", f"{_fields(ex.b_bits, acc.exp_bits)}  {ex.b!r}")
    if not ex.operands_exact:
        t.add_row("", f"[yellow](inputs rounded to {acc.name} first)[/]")
    exp = f" × 2^{ex.exponent}" if ex.exponent is not None else ""
    t.add_row("aligned", f"  {ex.a_aligned}  " + dim(f"A{exp}"))
    t.add_row("", f"+ {ex.b_aligned}  " + dim(f"B{exp}"))
    t.add_row("", f"= {ex.sum_aligned}  " + dim(f"exact sum{exp}"))
    if ex.shift > 0:
        note = f"carry: shift right {ex.shift}, 2^{ex.exponent} → 2^{ex.sum_exponent}"
    elif ex.shift < 0:
        note = f"cancellation: shift left {-ex.shift}, 2^{ex.exponent} → 2^{ex.sum_exponent}"
    else:
        note = "no normalization shift"
    t.add_row("normalize", f"  {ex.normalized}  " + dim(note))
    fits = "exact" if ex.exact_fits_acc else f"rounded, guard bit {ex.guard}"
    t.add_row(f"{acc.name} sum", f"{_fields(ex.acc_sum_bits, acc.exp_bits)}  {ex.acc_sum!r} " + dim(fits))
    t.add_row(f"into {into.name}",
              f"  {ex.kept} | [bold]{ex.round_and_rest[:1] or '-'}[/] | {ex.round_and_rest[1:] or '-'}  "
              + dim("kept | round | sticky bits"))
    verdict = {"up": "up (away from 0)", "down": "down (toward 0)", "exact": "exact"}[ex.direction]
    t.add_row("", f"round {ex.round}, sticky {ex.sticky}, guard {ex.guard} → nearest-even rounds {verdict}")
    t.add_row(f"{into.name} result", f"{_fields(ex.rounded_bits, into.exp_bits)}  [bold]{ex.rounded!r}[/]")
    t.add_row("error", f"rounded − exact = [bold]{ex.error!r}[/]")
    return Panel(t, title=f"{ex.a!r} + {ex.b!r} in {acc.name}, stored as {into.name}", expand=False)


def run(dump: Optional[Path], add: Optional[tuple[str, str]], into: str, acc: str, a: str, b: str, step, layer, head,
        rank: Optional[int], accumulation: str, backend: str, workers: int, scheduler: Optional[str],
        worker_wait: float, out: Optional[Path], json_path: Optional[Path], debug: bool) -> None:
    """The `bitdiff` command (options: the registry's): --add mode, or tensor mode with a DUMP."""

    def body() -> None:
        if add is not None and dump is not None:
            raise UserError(f"bitdiff takes either a DUMP (tensor mode) or --add A B, not both; drop {dump} or --add")
        if add is not None:
            run_add(add[0], add[1], into, acc, json_path)
            return
        if dump is None:
            raise UserError("bitdiff needs a DUMP (tensor mode) or --add A B (explain one addition); "
                            "see fa-forensics bitdiff --help")
        from fa_forensics.commands.bitdiff_tensor import run_tensor_mode

        run_tensor_mode(dump=dump, a=a, b=b, step=step, layer=layer, head=head, accumulation=accumulation,
                        backend=backend, out=out, json_path=json_path, debug=debug, workers=workers,
                        scheduler=scheduler, rank=rank, worker_wait=worker_wait)

    run_cli(debug, body)


def run_add(text_a: str, text_b: str, into: str, acc: str, json_path: Optional[Path]) -> None:
    """--add mode: parse, explain, print, write JSON."""
    from fa_forensics.numerics import explain_add, get_format

    if into.strip().lower() not in INTO_CHOICES:
        raise UserError(f"--into {into!r} is not a format; use one of {', '.join(INTO_CHOICES)}")
    get_format(acc)  # a clear error for a bad --acc
    x, y = parse_operand(text_a, "A"), parse_operand(text_b, "B")
    ex = explain_add(x, y, into=into.strip().lower(), acc=acc)
    console.print(render_add(ex))
    write_json(json_path, {"input_a": text_a, "input_b": text_b, **_as_dict(ex)})


def _as_dict(ex) -> dict:
    import dataclasses

    return dataclasses.asdict(ex)
