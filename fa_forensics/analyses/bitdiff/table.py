"""Tables of a bitdiff (tensor mode) result."""
from __future__ import annotations

from rich.table import Table

from fa_forensics.analyses.bitdiff.compute import BitdiffResult
from fa_forensics.analyses.significance import EFFECT_FLOOR
from fa_forensics.analyses.wording import number, p_value, percent, place, pm, text


def tables(r: BitdiffResult) -> list[Table]:
    """The ULP histogram, the biased features (when any) and the largest differences (when any)."""
    table = Table(title=f"bitdiff: {r.a} vs {r.b} (bits compared in {r.fmt}; {r.n_elements} elements)")
    table.add_column("ULP distance (a − b)", justify="right")
    table.add_column("count", justify="right")
    for label, count in zip(r.ulp_hist["bins"], r.ulp_hist["counts"]):
        if count:
            table.add_row(label, str(count))
    out = [table]
    if r.biased_features:
        bt = Table(title=f"significantly biased features ({r.family.describe()} at α = {r.alpha:g}; at least "
                         f"{EFFECT_FLOOR:.0%} of a rounding unit)")
        for c in ("layer", "head", "feature", "rows (units)", "mean a − b ± se", "rounding units", "units > 0",
                  "t-test p", "Holm p"):
            bt.add_column(c, justify="right")
        for c in r.biased_features[:12]:
            bt.add_row(str(c.layer), str(c.head), str(c.feature), f"{c.subset} ({c.n_units})",
                       f"{c.mean:+.3e} ± {c.se:.1e}",
                       number(c.effect, ".3f"), f"{c.frac_positive:.2f}", p_value(c.t_p_value),
                       p_value(c.adjusted_p))
        out.append(bt)
    if r.largest:
        lt = Table(title="largest differences")
        for c in ("step/layer/head", "b,row,feat", "a", "b", "ULP", "a bits", "b bits"):
            lt.add_column(c)
        for d in r.largest[:5]:
            lt.add_row(f"{d.step}/{d.layer}/{d.head}", f"{d.batch},{d.row},{d.feature}", f"{d.a:.7g}", f"{d.b:.7g}",
                       str(d.ulp), d.a_bits, d.b_bits)
        out.append(lt)
    if r.input_cast is not None:
        ic = r.input_cast
        out.append(f"input-cast (not a kernel error): rounding the stored inputs to the recipe's format alone changes "
                   f"{ic['mismatch_rate']:.1%} of the fp32 O elements and biases {ic['n_biased_features']} feature(s)")
    return out


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    feats = d.get("biased_features") or []
    top = feats[0] if feats else None
    tail = (f"; most biased: {place(top, 'layer', 'head', 'feature')} "
            f"({number(top.get('mean'))} ± {number(top.get('se'), '.1e')})") if isinstance(top, dict) else ""
    return (f"bitdiff: {percent(d.get('mismatch_rate'), 1, missing='an unknown share')} "
            f"of O elements differ between the {d.get('a', 'bf16')} and {d.get('b', 'fp32')} replays; "
            f"{len(feats)} significantly biased feature{'s' if len(feats) != 1 else ''}{tail}.")


def key_numbers(d: dict) -> list[tuple[str, str]]:
    """Labelled numbers of the payload for the report (units in the labels; keys read defensively)."""
    feats = [f for f in (d.get("biased_features") or []) if isinstance(f, dict)]
    bias = d.get("bias") if isinstance(d.get("bias"), dict) else {}
    family = d.get("family") if isinstance(d.get("family"), dict) else {}
    return [
        ("compared", f"{text(d.get('a'))} vs {text(d.get('b'))}, bits in {text(d.get('format'))}"),
        ("elements that differ", f"{percent(d.get('mismatch_rate'), 1)} of {text(d.get('n_elements'))}"),
        ("significantly biased features", f"{len(feats)} of {text(d.get('n_cells'))} (layer, head, feature) cells"),
        ("most significant cell", place(bias, "layer", "head", "feature")),
        ("its mean a − b ± se (output units)", pm(bias.get("value"), bias.get("se"), "+.3e", ".1e")),
        ("its size (rounding units)", number(bias.get("effect"), ".3f")),
        ("its p / Holm p", f"{p_value(bias.get('p_value'))} / {p_value(bias.get('adjusted_p'))}"),
        ("tests corrected over", str(family.get("text") or "n/a")),
    ]
