"""Assemble the report's index.html: a summary card first (the diagnosis: what is wrong and what to do; where,
every action, how sure; the technical verdict one click away), a table of the sections, one section per analysis
(its sentence, its labelled numbers, its figures and the command's own printed tables), and a glossary of the
symbols the page uses.

The card and the one-line CLI verdict render one object (`report.verdict.Verdict`), so they cannot disagree.
`findings` gathers each analysis's one sentence (`finding` in its room's table.py) and the sections' numbers come
from `key_numbers` in the same rooms, both made from the documented JSON keys read defensively (a command whose
JSON lacks a key gives a shorter sentence or "n/a", never an exception, "None" or "nan").
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Optional

from fa_forensics.analyses.registry import BY_NAME
from fa_forensics.analyses.significance import ALPHA, EFFECT_FLOOR
from fa_forensics.report.run import EXIT_CODES, exit_meaning
from fa_forensics.report.verdict import Verdict, build_verdict


def _title(name: str) -> str:
    """The registered title of an analysis's section (its name when it has none)."""
    analysis = BY_NAME.get(name)
    return analysis.section.title if analysis is not None and analysis.section is not None else name


def _finding(name: str, d: dict) -> Optional[str]:
    """One sentence per analysis from its JSON payload (the analysis's own `finding`, in its room)."""
    analysis = BY_NAME.get(name)
    return analysis.finding(d) if analysis is not None and analysis.section is not None else None


def _key_numbers(name: str, d: dict) -> list[tuple[str, str]]:
    analysis = BY_NAME.get(name)
    return analysis.key_numbers(d) if analysis is not None else []


def findings(sections) -> list[str]:
    """One sentence per analysis that produced JSON."""
    out = []
    for s in sections:
        if s.data is not None:
            sentence = _finding(s.name, s.data)
            if sentence:
                out.append(sentence)
    return out


# The symbols the page uses, in the order a reader meets them; the card links here.
GLOSSARY: tuple[tuple[str, str, str], ...] = (
    ("lp-hp", "lp / hp", "low precision: the recipe that reproduces the stored output (e.g. bf16 attention, or a GPU "
     "kernel's model); high precision: the same attention in fp32 on the same stored inputs. Every bias here is "
     "lp − hp."),
    ("o", "O, O_lp − O_hp", "the attention output softmax(α·QKᵀ)·V of one head, a vector of features per token; "
     "its error is the low-precision output minus the fp32 one."),
    ("feature", "feature", "one of the D coordinates of a head's output (index i of the head dimension)."),
    ("p-bar", "P̄", "the unnormalised probabilities exp(S − m) that flash attention multiplies V by, rounded to the "
     "low-precision format before the product P̄V. A repeated row maximum gives P̄ = 1 several times: the carry of "
     "their sum is what makes the rounding biased (paper §3.3.2)."),
    ("delta", "δ, Σδ", "δ = rowsum(dO ∘ O), the per-token term of the attention backward; Σδ = Σ over tokens of "
     "(δ_lp − δ_hp) in one (step, layer, head). A one-signed Σδ can accumulate in the W_Q gradient over steps; "
     "rank1-sim measures whether it compounds (its norm grows like the number of steps) or washes out."),
    ("signs", "O −, Σδ +", "the sign of a bias: O − means O_lp is below O_hp on average, Σδ + means "
     "Σ(δ_lp − δ_hp) > 0."),
    ("do", "dO", "the gradient of the loss with respect to O, recorded by the capture."),
    ("rounding-unit", "rounding unit", "the spacing of the low-precision format at |O_hp| (one ulp); for Σδ the same "
     f"units carried through dO. A bias's size is given in these units; below {EFFECT_FLOOR:.0%} of one it is not a "
     "finding."),
    ("significant", "significant, Holm, α", f"a p-value below α = {ALPHA:g} after Holm's correction over every test "
     f"the selection makes (Σδ items and O cells), and a bias of at least {EFFECT_FLOOR:.0%} of a rounding unit: the "
     f"chance that the page makes any false claim is at most {ALPHA:.0%}. The tests count units, not rows: rows of "
     "one step and batch row that attend mostly to the same key, or the same tied keys, err together and count "
     "once (docs/statistics.md)."),
    ("fidelity", "replay fidelity", "the share of the stored O bits the replayed recipe reproduces exactly; below "
     "100 % a sign test of the mismatches says whether they could bias the findings."),
    ("beta-eps", "β, ε", "the stabilized softmax (Algorithm 3): in a row whose maximum r_m repeats within ε, shift by "
     "m = β·r_m (r_m > 0) or 0 instead of r_m, so that no P̄ is exactly 1."),
    ("stable-attention", "stable_attention", "fa_forensics.stable_attention(q, k, v, beta, eps): the fix as a drop-in "
     "attention (Triton kernels on GPU, a torch reference on CPU); plain_attention is the same kernels without it."),
    ("fp8-s", "S (FP8 P scale)", "an FP8 kernel multiplies P̄ by S before casting it to E4M3, whose smallest value "
     "is 2⁻⁹: S = 1 zeroes every P̄ at or below 2⁻¹⁰, S = 256 (a power of two, so the scaling itself rounds nothing) "
     "only those at or below 2⁻¹⁸ (the FP8 paper's fix)."),
    ("p-collapse", "P-collapse", "a strong attention sink raises the running maximum, so most other P̄ fall below "
     "E4M3's smallest value and are silently zeroed: the probability mass they carried is lost."),
    ("logit-growth", "attention-logit growth", "a head's largest attention logit (max logit, q·k scaled) grows to "
     "many times its value early in the run, until its softmax puts all weight on one key (mean top-1 probability → "
     "1: attention-entropy collapse) and the loss diverges; a LayerNorm on queries and keys (qk-layernorm) bounds the "
     "logits, a lower learning rate or a longer warm-up slows their growth (Wortsman et al. 2023)."),
    ("output-divergence", "output-logit divergence, z-loss", "the log-sum-exp of the language-model head's logits "
     "drifts away from its early value; a z-loss (about 1e-4 · log-sum-exp², added to the loss) pulls it back to 0."),
    ("blow-up", "optimizer / learning-rate blow-up", "the loss jumps in one step with W_Q's norm or every head's max "
     "logit, and no attention precursor before it: the update was too large (learning rate, warm-up, Adam's ε or "
     "β₂); clipping the gradient norm bounds it."),
    ("cannot-tell", "cannot tell", "the evidence does not decide: the replay reproduces too few of the stored O bits "
     "for its rounding findings to describe the kernel that trained, or the analyses could not run."),
    ("kv-order", "KV order", "the order in which a kernel visits the key blocks (forward or reverse); reverse visits "
     "the sink last, so the running maximum stays low longer."),
)

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.4em} h2{font-size:1.15em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
.card{border:1px solid #ccc;border-left:8px solid #888;border-radius:4px;padding:.8em 1.2em;background:#fafafa}
.card.affected,.card.disagree{border-left-color:#D55E00;background:#fdf6e3}
.card.unstable{border-left-color:#CC79A7;background:#fdf3f8}
.card.fp8-only,.card.cannot-tell{border-left-color:#E69F00;background:#fffaf0}
.card.not-affected,.card.healthy{border-left-color:#009E73;background:#f3fbf7}
.card .answer{font-size:1.3em;font-weight:600;margin:.2em 0 .3em} .card .because{margin:0 0 .6em}
.card dt{font-weight:600;margin-top:.6em} .card dd{margin-left:1.2em} .card ul,.card ol{margin:.2em 0;padding-left:1.2em}
.note{color:#a33} table{border-collapse:collapse;font-size:.88em;margin:.5em 0}
td,th{border:1px solid #ddd;padding:3px 9px;text-align:left;vertical-align:top} th{background:#f0f0f0}
img{max-width:100%;border:1px solid #eee;margin:.5em 0} pre{background:#fafafa;font-size:.75em;overflow-x:auto;padding:.5em}
.meta{color:#555;font-size:.88em} details{margin:.5em 0} summary{cursor:pointer;color:#0072B2}
dl.glossary dt{font-weight:600;margin-top:.5em} dl.glossary dd{margin-left:1.2em}
"""  # noqa: E501 - the page's style sheet


def _card(v: Verdict, e) -> list[str]:
    """The summary card: the diagnosis (what is wrong, what to do), where, what was found, every action, how sure,
    the technical sentence."""
    out = [f"<section class='card {e(v.status.replace(' ', '-'))}' id='summary'>",
           f"<p class='answer'>{e(v.lead or v.answer)}</p>"]
    if v.because:
        out.append(f"<p class='because'>{e(v.because)}</p>")
    out.append("<dl>")
    if v.precision:
        out.append(f"<dt>The run's precision</dt><dd>{e(v.precision[:1].upper() + v.precision[1:])}.</dd>")
    if v.where:
        out.append(f"<dt>Where</dt><dd>{e(v.where)}</dd>")
    if v.findings:
        out.append("<dt>What was found</dt><dd><ul>" + "".join(f"<li>{e(f)}</li>" for f in v.findings)
                   + "</ul></dd>")
    if v.actions:
        out.append("<dt>What to do</dt><dd><ol>" + "".join(
            f"<li><strong>{e(a.what)}</strong>: {e(a.effect)}.</li>" for a in v.actions) + "</ol></dd>")
    elif v.status == "cannot tell":
        out.append("<dt>What to do</dt><dd>Nothing the evidence supports yet: the first line says what is missing."
                   "</dd>")
    elif v.untested:
        out.append("<dt>What to do</dt><dd>Nothing for what was tested: no analysis that ran found a bias, an FP8 "
                   f"collapse or an instability; {e(', '.join(v.untested))} could not run (their notes below say why "
                   "and what a dump needs for them).</dd>")
    else:
        out.append("<dt>What to do</dt><dd>Nothing: no analysis found a bias, an FP8 collapse or an instability."
                   "</dd>")
    if v.disagreements:
        out.append("<dt>Where the analyses disagree, and why</dt><dd><ul>"
                   + "".join(f"<li>{e(d)}</li>" for d in v.disagreements) + "</ul></dd>")
    out.append("<dt>How sure</dt><dd><ul>" + "".join(f"<li>{e(c)}</li>" for c in v.confidence)
               + f"<li>{e(v.rule[:1].upper() + v.rule[1:])} (<a href='#g-significant'>what this means</a>).</li>"
               + "</ul></dd>")
    out.append("</dl>")
    out.append(f"<details><summary>The technical verdict</summary><p>{e(v.technical)}</p></details>")
    out.append("<p class='meta'>Symbols (lp/hp, P̄, δ, Σδ, O −/Σδ +, S, β, ε, rounding unit): see the "
               "<a href='#glossary'>glossary</a> at the end of the page, with the instabilities the diagnosis "
               "names.</p></section>")
    return out


def _sections_table(sections, e) -> list[str]:
    rows = []
    for s in sections:
        sentence = (_finding(s.name, s.data) if s.data is not None else None) or s.note or "no result"
        rows.append(f"<tr><td><a href='#{e(s.name)}'>{e(s.name)}</a></td><td>{e(sentence)}</td>"
                    f"<td>{s.exit_code}: {e(exit_meaning(s))}</td><td>{s.seconds:.1f}</td></tr>")
    return ["<h2 id='sections'>What each analysis says</h2>",
            "<table><tr><th>analysis</th><th>its finding</th><th>exit code: meaning</th><th>time (s)</th></tr>"
            + "".join(rows) + "</table>", f"<p class='meta'>{e(EXIT_CODES[:1].upper() + EXIT_CODES[1:])}.</p>"]


def render(dump: str, sections, *, info: Optional[dict] = None, seconds: float = 0.0) -> str:
    """The whole page as a string."""
    e = html.escape
    verdict = build_verdict(sections)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>fa-forensics report: {e(dump)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>fa-forensics report: {e(dump)}</h1>"]
    parts += _card(verdict, e)
    missing = [s.name for s in sections if s.data is None]
    if missing:
        note = f"Not available for this dump: {', '.join(missing)} (see the notes below)."
        parts.append(f"<p class='note'>{e(note)}</p>")
    if info:
        parts.append("<p class='meta'>" + e(", ".join(f"{k}: {v}" for k, v in info.items())) + "</p>")
    parts += _sections_table(sections, e)
    parts.append(f"<p class='meta'>{len(sections)} analyses in {seconds:.0f} s. Each section's figures and JSON are in "
                 "the folder of the same name beside this page.</p>")
    for s in sections:
        parts.append(f"<h2 id='{e(s.name)}'>{e(_title(s.name))}</h2>")
        parts.append(f"<p class='meta'>command: <code>fa-forensics {e(' '.join(s.args))}</code> · exit code "
                     f"{s.exit_code} ({e(exit_meaning(s))}) · {s.seconds:.1f} s</p>")
        if s.data is None:
            parts.append(f"<p class='note'>{e(s.note or 'no result')}</p>")
            continue
        sentence = _finding(s.name, s.data)
        if sentence:
            parts.append(f"<p>{e(sentence)}</p>")
        rows = _key_numbers(s.name, s.data)
        if rows:
            parts.append("<table><tr><th>quantity (unit)</th><th>value</th></tr>" +
                         "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in rows) + "</table>")
        for fig in s.figures:
            parts.append(f"<div><img src='{e(fig)}' alt='{e(fig)}'></div>")
        if s.text.strip():
            parts.append(f"<details><summary>the command's printed output</summary><pre>{e(s.text)}</pre></details>")
    parts.append("<h2 id='glossary'>Glossary</h2><dl class='glossary'>")
    for anchor, term, meaning in GLOSSARY:
        parts.append(f"<dt id='g-{e(anchor)}'>{e(term)}</dt><dd>{e(meaning)}</dd>")
    parts.append("</dl></body></html>")
    return "\n".join(parts)


def write_report(out_dir: Path, dump: str, sections, *, info: Optional[dict] = None, seconds: float = 0.0) -> Path:
    """Write out_dir/index.html and return its path."""
    from fa_forensics.dump.safe_files import atomic_write

    path = Path(out_dir) / "index.html"
    atomic_write(path, render(dump, sections, info=info, seconds=seconds), "out")
    return path
