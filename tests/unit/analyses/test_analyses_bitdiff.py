"""bitdiff tensor mode: mismatch rate, ULP histogram, bias map and largest differences on built tensors."""
import torch

from fa_forensics.analyses.bitdiff.compute import compare_layer_step, coarser, summarize, ulp_bins


def _next_up(x: torch.Tensor) -> torch.Tensor:
    """bf16 values one ulp further from zero (positive values only here)."""
    return (x.view(torch.int16) + 1).view(torch.bfloat16)


def test_planted_one_ulp_bias_is_found_and_counted():
    g = torch.Generator().manual_seed(0)
    a = (torch.rand(2, 3, 64, 8, generator=g) + 0.5).bfloat16()  # (B, h, T, D) positive
    b = a.clone()
    b[:, 1, :, 4] = _next_up(a[:, 1, :, 4])  # b one ulp above a everywhere in head 1 feature 4: a − b < 0
    b[0, 0, 5, 2] = _next_up(_next_up(a[0, 0, 5, 2]))  # one isolated 2-ulp difference elsewhere
    part = compare_layer_step(a, b, step=7, layer=2, heads=[10, 11, 12])
    r = summarize([part], "dump", "bf16")
    n = a.numel()
    assert r.fmt == "bf16" and r.n_elements == n
    assert r.mismatch_rate == (2 * 64 + 1) / n
    hist = dict(zip(r.ulp_hist["bins"], r.ulp_hist["counts"]))
    assert hist["-1"] == 2 * 64 and hist["-2"] == 1 and hist["0"] == n - 2 * 64 - 1
    assert [(c.layer, c.head, c.feature) for c in r.biased_features] == [(2, 11, 4)]
    cell = r.biased_features[0]
    assert cell.mean < 0 and cell.frac_positive == 0.0 and cell.p_value < 1e-30 and cell.n == 128
    top = r.largest[0]
    assert (top.step, top.layer, top.head, top.batch, top.row, top.feature, top.ulp) == (7, 2, 10, 0, 5, 2, -2)
    assert len(top.a_bits) == 16 and top.a_bits != top.b_bits


def test_steps_pool_per_layer_head_and_mixed_formats_compare_in_the_coarser():
    g = torch.Generator().manual_seed(1)
    hp = torch.randn(1, 2, 32, 4, generator=g)  # fp32
    lp = hp.bfloat16()
    assert coarser("bf16", "fp32") == "bf16" and coarser("fp32", "fp8_e4m3") == "fp8_e4m3"
    parts = [compare_layer_step(lp, hp, step=s, layer=0, heads=[0, 1]) for s in (1, 2)]
    r = summarize(parts, "bf16", "fp32")
    assert r.fmt == "bf16" and r.steps == [1, 2]
    assert r.mismatch_rate == 0.0  # fp32 rounded to bf16 equals the bf16 cast bit for bit
    assert all(c.n == 64 for c in r.mean_signed_error)  # 32 rows × 2 steps pooled
    d = (lp.double() - hp.double())[0, 1, :, 3]
    cell = next(c for c in r.mean_signed_error if (c.head, c.feature) == (1, 3))
    assert abs(cell.mean - float(d.mean())) < 1e-15  # same values in both steps
    assert len(r.ulp_hist["counts"]) == len(ulp_bins())


def test_nan_errors_are_left_out_of_the_bias_map_not_counted_as_zero():
    """A side whose O is NaN in a feature must not read as 'unbiased, mean 0 ± 0'."""
    g = torch.Generator().manual_seed(2)
    b = torch.randn(1, 1, 40, 3, generator=g)  # fp32
    a = b.clone()
    a[..., 0] = float("nan")  # feature 0: every row NaN (e.g. an overflowing variant)
    a[0, 0, :10, 1] = float("nan")  # feature 1: 10 NaN rows, the other 30 one fixed offset above b
    a[0, 0, 10:, 1] = b[0, 0, 10:, 1] + 0.5
    r = summarize([compare_layer_step(a, b, step=0, layer=0, heads=[0])], "x", "fp32")
    cells = {c.feature: c for c in r.mean_signed_error}
    assert torch.isnan(torch.tensor(cells[0].mean)) and cells[0].n == 0 and cells[0].p_value == 1.0
    assert cells[1].n == 30 and abs(cells[1].mean - 0.5) < 1e-6 and cells[1].se < 1e-6
    assert cells[2].n == 40 and cells[2].mean == 0.0
