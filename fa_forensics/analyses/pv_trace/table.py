"""Tables of a pv-trace result: the traced element, its largest jumps, and the bits of the largest one."""
from __future__ import annotations

from rich.table import Table

from fa_forensics.analyses.pv_trace.compute import PVTraceReport
from fa_forensics.analyses.wording import number, p_value, percent, place, pm, share_with_se, text, yes_no


def tables(r: PVTraceReport) -> list:
    """The quantities table, the largest-jumps table and the bit-level lines of the largest jump."""
    tr = r.trace
    table = Table(title=f"pv-trace ({r.preset} vs fp32): step {r.step} layer {r.layer} head {r.head} batch {r.batch} "
                        f"row {tr.row} feature {tr.feature}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row(f"O bias in this feature (mean ± se, t-test p over units; Holm p over {r.family.n_tests} tests)",
                  f"{r.cell.mean:+.3e} ± {r.cell.se:.1e} (p={r.cell.p_value:.2g}; {r.cell.adjusted_p:.2g}: "
                  f"{'significant' if r.cell.significant else 'not significant'})")
    for kind, label in (("repeated_max", "rows with a repeated maximum"), ("other", "other rows")):
        m = r.bias_split[kind]
        if m["n"]:
            table.add_row(f"  O bias in {label} (n={m['n']}; row t-test p, rows taken as independent: descriptive)",
                          f"{m['mean']:+.3e} ± {m['se']:.1e} (p={p_value(m['p_value'])})")
    table.add_row(f"O error of this row (replay; row chosen: {r.row_choice})", f"{r.o_error_replay:+.3e}")
    table.add_row("Ō error of the dot product (Eq. 4)", f"{tr.final_error:+.3e}")
    table.add_row("keys, P̄ = 1 positions",
                  f"{tr.error.numel()}, {tr.p_one_positions[:12]}{' …' if len(tr.p_one_positions) > 12 else ''}")
    table.add_row("jumps (terms with error_step ≠ 0)", str(len(tr.jumps)))
    share = tr.frac_error_from_p_one
    table.add_row("final rounding (A = Σ V at P̄ = 1, r = the rest)",
                  f"{tr.split.cls}: A = {tr.split.a:.8g}, r = {tr.split.r:+.3e}")
    table.add_row("share of the error the P̄ = 1 mechanism carries",
                  f"{share:.1%}" if share == share else "— (no error)")
    if tr.nudged_error is not None:
        table.add_row("Ō error with the P̄ = 1 terms nudged to 1 − 2⁻⁸", f"{tr.nudged_error:+.3e}")
    for c in r.class_shares:
        if c.rows:
            table.add_row(f"  signed contribution to the O bias ({r.rows_attributed} rows): {c.cls} (n={c.rows})",
                          share_with_se(c.share, c.se, 1, signed=True, missing="n/a (no O bias to share out)"))
    cf = r.counterfactual
    if cf is not None:
        table.add_row("O bias → with P̄ = 1 nudged (vs the part not attributed to P̄ = 1)",
                      f"{cf.o_bias:+.3e} → {cf.nudged_o_bias:+.3e} ± {cf.nudged_se:.1e} ({cf.unattributed:+.3e}): "
                      + ("consistent (within 3 se)" if cf.agrees else
                         "inconsistent (more than 3 se apart: the attribution misses part of the mechanism)"))
    table.caption = ("contributions are signed shares of the O bias: they add up to 100 %, so one class can carry "
                     "more than 100 % when another pulls the other way" + ("" if r.cell.significant else
                     "; this feature's O bias is not significant, so its split is noise"))
    out: list = [table]
    big = sorted(tr.jumps, key=lambda j: -abs(j.error_step))[:8]
    if big:
        jt = Table(title="largest jumps")
        for c in ("t", "P̄", "V", "error step", "cast part", "round part", "rounding"):
            jt.add_column(c, justify="right")
        for j in big:
            jt.add_row(str(j.t), f"{j.p_bar:.6g}", f"{j.v:.6g}", f"{j.error_step:+.3e}", f"{j.cast + 0.0:+.2e}",
                       f"{j.round + 0.0:+.2e}", j.direction)
        out.append(jt)
    ex = tr.explanation
    if ex is not None:
        out.append(f"[bold]largest jump at t={tr.largest_jump.t}[/]: accumulator {ex.a!r} + term {ex.b!r}")
        exact = (ex.exact_bits if ex.exact_bits is not None
                 else f"{ex.acc_sum_bits} (fp32-rounded; the exact sum needs more bits)")
        out.append(f"  exact   {exact}  ({float(ex.exact)!r})")
        out.append(f"  rounded {ex.rounded_bits}  ({float(ex.rounded)!r}) to {tr.pv_format}: guard {ex.guard} round "
                   f"{ex.round} sticky {ex.sticky} → rounded {ex.direction}, error {float(ex.error):+.6g}")
    return out


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    where = (f"pv-trace: at step {text(d.get('step'))}, layer {text(d.get('layer'))}, head {text(d.get('head'))}, "
             f"row {text(d.get('row'))}, feature {text(d.get('feature'))}")
    n_ones = len(d.get("p_one_positions") or [])
    share = percent(d.get("frac_error_from_p_one"), missing="")
    significant = bool((d.get("o_bias") or {}).get("significant"))
    caveat = "" if significant else " (this feature's O bias is not significant: an illustration, not evidence)"
    if d.get("final_error") == 0:
        return f"{where} the P̄V dot product has no error (low precision and fp32 agree){caveat}."
    if not share:
        return (f"{where} the P̄V error is {number(d.get('final_error'))}; no share of it could be attributed "
                f"to P̄ = 1 terms{caveat}.")
    return (f"{where} the P̄V error is {number(d.get('final_error'))}; {share} of it entered at the {n_ones} terms "
            f"where P̄ = 1{caveat}.")


def key_numbers(d: dict) -> list[tuple[str, str]]:
    """Labelled numbers of the payload for the report (units in the labels; keys read defensively)."""
    ob = d.get("o_bias") if isinstance(d.get("o_bias"), dict) else {}
    shares = d.get("class_shares") if isinstance(d.get("class_shares"), dict) else {}
    p_one = [v for k, v in shares.items()
             if k in ("tie", "near-tie", "carry") and isinstance(v, dict) and v.get("rows")]
    total = sum(v.get("share") or 0.0 for v in p_one) if p_one else None
    se = sum((v.get("se") or 0.0) ** 2 for v in p_one) ** 0.5 if p_one else None
    return [
        ("traced cell", place(d, "step", "layer", "head", "feature", "row")),
        ("O bias in that feature ± se (output units)", pm(ob.get("mean"), ob.get("se"), "+.3e", ".1e")),
        ("its p / Holm p", f"{p_value(ob.get('p_value'))} / {p_value(ob.get('adjusted_p'))}"),
        ("significant", yes_no(ob.get("significant"))),
        ("Ō error of the traced dot product", number(d.get("final_error"))),
        ("terms with P̄ = 1 in that row", str(len(d.get("p_one_positions") or []))),
        ("share of that error from the P̄ = 1 terms", percent(d.get("frac_error_from_p_one"))),
        (f"signed contribution of P̄ = 1 to the O bias over {text(d.get('rows_attributed'))} rows",
         share_with_se(total, se, signed=True) if ob.get("significant") else "n/a (no significant bias to split)"),
    ]
