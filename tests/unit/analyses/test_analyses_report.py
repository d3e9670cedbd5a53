"""report: the findings paragraph and the page read the commands' JSON keys (built payloads here)."""
from fa_forensics.report.html import findings, render
from fa_forensics.report.run import SectionResult


def _sec(name, data, figures=(), note=""):
    return SectionResult(name=name, args=[name, "d.zarr"], exit_code=0 if data else 2, ok=data is not None, note=note,
                         data=data, figures=list(figures), text="table", seconds=1.0)


def test_findings_and_page_name_what_was_found_where():
    secs = [
        _sec("pv-trace", {"step": 1, "layer": 0, "head": 1, "row": 250, "feature": 44, "final_error": -5.3e-3,
                          "frac_error_from_p_one": 1.39, "p_one_positions": [43, 63]}, ["pv-trace/a.png"]),
        _sec("fix-check", {"verdict": "FIX REMOVES THE BIAS at layer 0 head 1 feature 44", "bias_reduction": 12.0}),
        _sec("bitdiff", {"mismatch_rate": 0.32, "biased_features": [{"layer": 0, "head": 1, "feature": 44,
                                                                     "mean": -1.9e-3, "se": 5e-5}]}),
        _sec("pcast", None, note="'pcast' is not available yet"),
    ]
    f = findings(secs)
    assert len(f) == 3
    assert "feature 44" in f[0] and "139% of it entered at the 2 terms where P̄ = 1" in f[0]
    assert f[1].startswith("fix-check: FIX REMOVES")
    assert "32.0% of O elements differ" in f[2] and "feature 44" in f[2]
    page = render("d.zarr", secs)
    assert page.index("FIX REMOVES") < page.index("<h2")  # the first paragraph says what was found
    assert "<img src='pv-trace/a.png'" in page and "not available yet" in page
    assert "Not available for this dump: pcast" in page


def test_missing_keys_never_raise():
    f = findings([_sec(n, {}) for n in ("isolate", "delta-bias", "rank1-sim", "pv-trace", "bitdiff", "fix-check",
                                        "pcast")])
    assert len(f) == 7 and all(isinstance(x, str) for x in f)
