"""Table of a rank1-sim result."""
from __future__ import annotations

from rich.table import Table

from fa_forensics.analyses.rank1_sim.compute import Rank1Result, two_places
from fa_forensics.analyses.wording import number, percent, place


def tables(r: Rank1Result) -> list[Table]:
    """The quantities of the focus head: cosines, stand-out features, spectrum, accumulation."""
    table = Table(title=f"rank1-sim: layer {r.focus_layer} head {r.focus_head}, {len(r.tokens)} tokens over steps "
                        f"{r.steps} (lp = preset {r.preset})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("mean pairwise cosine of (PK)[T]ᵀX[T]" if r.has_x else "mean pairwise cosine of (PK)[T] (no X)",
                  f"{r.cosine_offdiag_mean:+.3f}")
    if r.has_x:
        table.add_row("  of which: PK rows / X rows",
                      f"{r.pk_cosine_offdiag_mean:+.3f} / {r.x_cosine_offdiag_mean:+.3f}")
        table.add_row("input features that stand out (share)",
                      ", ".join(f"{c.feature} ({c.weight:.2f})" for c in r.top_columns[:5]))
        table.add_row("singular values of the gradient error Σ E", ", ".join(f"{s:.3g}" for s in r.singular_values[:5]))
        no_error = "n/a (no gradient error)"
        has_error = any(x > 0 for x in r.cumulative_norms)
        table.add_row("effective rank / top σ² share",
                      f"{two_places(r.effective_rank, 'n/a')} / {two_places(r.top_sv_ratio, 'n/a')}"
                      if has_error else no_error)
        table.add_row("cross-step alignment of top singular vectors",
                      two_places(r.cross_step_alignment, "needs ≥ 2 steps") if has_error else no_error)
        steps_short = "needs ≥ 3 steps" if len(r.cumulative_norms) < 3 else "n/a (zero error at some step)"
        table.add_row("accumulation exponent (1 compounds, 0.5 washes out)",
                      two_places(r.accumulation_exponent, steps_short) if has_error else no_error)
    return [table]


def finding(d: dict) -> str:
    """The report's sentence of this analysis, from its --json payload (keys read defensively)."""
    cols = [str(c.get("feature")) for c in (d.get("top_columns") or [])[:3] if isinstance(c, dict)]
    focus = d.get("focus") or {}
    claim = d.get("claim") if isinstance(d.get("claim"), dict) else {}
    why = ("the head with the significant Σδ bias" if claim.get("found") else
           "the most significant head, though not significantly biased: the exponent is not interpreted")
    return (f"rank1-sim: {place(focus, 'layer', 'head')} ({why}): mean off-diagonal cosine "
            f"{number(d.get('cosine_offdiag_mean'), '.2f')}, effective rank {number(d.get('effective_rank'), '.2f')}, "
            f"stand-out input features {', '.join(cols) or 'n/a'}, accumulation exponent "
            f"{number(d.get('accumulation_exponent'), '.2f')} over {len(d.get('steps') or [])} steps "
            "(≈ 1 compounds, ≈ 0.5 washes out).")


def key_numbers(d: dict) -> list[tuple[str, str]]:
    """Labelled numbers of the payload for the report (keys read defensively)."""
    focus = d.get("focus") if isinstance(d.get("focus"), dict) else {}
    claim = d.get("claim") if isinstance(d.get("claim"), dict) else {}
    cols = [str(c.get("feature")) for c in (d.get("top_columns") or [])[:3] if isinstance(c, dict)]
    expo = number(d.get("accumulation_exponent"), ".2f")
    return [
        ("head studied", place(focus, "layer", "head")),
        ("why this head", "its Σδ bias is significant" if claim.get("found") else
         "the most significant head; its Σδ is not significant"),
        ("mean pairwise cosine of the rank-1 matrices", number(d.get("cosine_offdiag_mean"), "+.2f")),
        ("stand-out input features of X", ", ".join(cols) or "n/a"),
        ("effective rank of the W_Q gradient error", number(d.get("effective_rank"), ".2f")),
        ("share of its energy in the top direction", percent(d.get("top_sv_ratio"))),
        ("accumulation exponent (1 compounds, 0.5 washes out)",
         expo if claim.get("found") or expo == "n/a" else f"{expo} (not interpreted: no significant bias)"),
        ("steps", str(len(d.get("steps") or []))),
    ]
