"""pv-trace: Eq. 5 along t, its jumps and where they enter, on hand-built rows with a plain-torch reference."""
import math

import pytest
import torch

from fa_forensics.analyses.pv_trace.compute import pick_cell, trace_pv


def _bf16(xs):
    return torch.tensor(xs, dtype=torch.float32).bfloat16().float()


def _reference(p_lp, p_hp, v):
    """Plain fp64 loop: fp32 accumulator with one rounding per term; lp = bf16 of it, hp = fp32 chain."""
    acc_lp = acc_hp = 0.0
    errors = []
    for a, b, c in zip(p_lp.tolist(), p_hp.tolist(), v.tolist()):
        acc_lp = float(torch.tensor(acc_lp + a * c, dtype=torch.float64).float())
        prod_hp = float(torch.tensor(b, dtype=torch.float64) * torch.tensor(c, dtype=torch.float64))
        acc_hp = float(torch.tensor(acc_hp + prod_hp, dtype=torch.float64).float())
        lp = float(torch.tensor(acc_lp).bfloat16().double())
        errors.append(lp - acc_hp)
    return errors


def _two_big_one_small():
    """The paper's worked example as a row: P̄ = 1 at t = 0 and t = 6 with negative V (−2.40625,
    −2.296875), small negative residue in between that sets the sticky bit."""
    v = _bf16([-2.40625, -1.0, -1.5, -1.25, -1.75, -1.125, -2.296875, -1.0])
    p_hp = torch.tensor([1.0, 1.3e-4, 1.1e-4, 1.7e-4, 1.9e-4, 1.2e-4, 1.0, 1.4e-4], dtype=torch.float32)
    p_lp = p_hp.bfloat16().float()
    return p_lp, p_hp, v


def test_trace_matches_plain_reference_and_telescopes():
    p_lp, p_hp, v = _two_big_one_small()
    tr = trace_pv(p_lp, p_hp, v, row=7, feature=3)
    ref = _reference(p_lp, p_hp, v)
    assert tr.error.tolist() == pytest.approx(ref, abs=1e-12)
    assert float(tr.error_step.sum()) == pytest.approx(tr.final_error, abs=1e-12)
    parts = torch.tensor([[j.cast + j.acc + j.round, j.error_step] for j in tr.jumps], dtype=torch.float64)
    assert torch.allclose(parts[:, 0], parts[:, 1], atol=1e-12)
    assert (tr.row, tr.feature) == (7, 3)


def test_error_enters_at_p_one_terms_rounded_up():
    p_lp, p_hp, v = _two_big_one_small()
    tr = trace_pv(p_lp, p_hp, v)
    assert tr.p_one_positions == [0, 6]
    assert tr.largest_jump.t == 6
    assert tr.largest_jump.error_step < -0.01  # ≈ −0.0148: the paper's error of this addition
    assert tr.largest_jump.direction == "up"  # more negative: away from zero
    assert tr.final_error < 0
    assert tr.frac_error_from_p_one > 0.9


def test_no_error_when_pv_kept_in_fp32_and_p_exact():
    v = _bf16([-1.5, -1.25, 0.75])
    p = torch.tensor([1.0, 0.5, 0.25])
    tr = trace_pv(p, p, v, pv_format="fp32")
    assert tr.final_error == 0.0 and tr.jumps == [] and math.isnan(tr.frac_error_from_p_one)


def test_tensor_core_trace_runs_and_telescopes():
    p_lp, p_hp, v = _two_big_one_small()
    tr = trace_pv(p_lp, p_hp, v, accumulation="tensor-core")
    assert tr.accumulation == "tensor-core"
    assert float(tr.error_step.sum()) == pytest.approx(tr.final_error, abs=1e-12)


def test_pick_cell_finds_planted_feature_and_worst_row():
    g = torch.Generator().manual_seed(0)
    err = 1e-4 * torch.randn(2, 3, 200, 8, generator=g, dtype=torch.float64)
    err[1, 2, :, 5] -= 3e-4  # planted negative bias
    err[1, 2, 17, 5] = -5e-3  # the worst row in it
    err[0, 0, 3, 1] = 1e-2  # a large error in an unbiased feature: must not be picked
    cell = pick_cell(err)
    assert (cell.batch, cell.head_index, cell.feature, cell.row) == (1, 2, 5, 17)
    assert cell.mean < 0 and cell.p_value < 1e-6
    fixed = pick_cell(err, feature=1, row=3)
    assert (fixed.feature, fixed.row) == (1, 3)


def test_stabilized_trace_compares_at_one_shift():
    """Under a stabilized / fixed-offset shift m the fp32 P̄ uses the same m, so Ō_lp − Ō_hp is the
    rounding error (≈ ℓ · O error), not the gap between two shifts (review2: Ō error was +2.5)."""
    from fa_forensics.analyses.pv_trace.compute import p_bar_row
    from fa_forensics.replay.config import ReplayConfig

    g = torch.Generator().manual_seed(0)
    k = _bf16(torch.randn(48, 16, generator=g).tolist()).reshape(48, 16)  # (T, D)
    q = k[7] * 3  # row max at key 7, positive scores
    v = _bf16(torch.randn(48, generator=g).tolist())  # (T,)
    for name in ("stabilized", "bf16"):
        cfg = ReplayConfig.preset(name)
        cfg = cfg.with_(eps=1e9) if name == "stabilized" else cfg  # force the shift to fire
        p_lp, p_hp = p_bar_row(q, k, 0.25, 48, config=cfg)
        tr = trace_pv(p_lp, p_hp, v)
        l_hp = float(p_hp.double().sum())
        assert 0 < abs(tr.final_error) / l_hp < 2e-2, name  # bf16 rounding of P̄ and Ō, relative to ℓ
        if name == "stabilized":
            assert float(p_hp.max()) < 1e-3  # the fp32 side shifted by β·r_m too


def _tied_row(positions):
    """A row of 64 keys: two P̄ = 1 terms at `positions` whose V sum to a bf16 midpoint whose even
    neighbour lies toward zero (−208.5 · 2⁻⁶), small same-signed terms elsewhere."""
    g = torch.Generator().manual_seed(0)
    v = -(1 + torch.rand(64, generator=g)).bfloat16().float()
    p = (torch.rand(64, generator=g) * 1e-5).bfloat16().float()
    v[positions[0]], v[positions[1]] = -1.6328125, -1.625
    p[positions] = 1.0
    return p, v


def test_attribution_does_not_depend_on_where_the_tied_keys_sit():
    (p_last, v_last), (p_first, v_first) = _tied_row([62, 63]), _tied_row([0, 1])
    last, first = trace_pv(p_last, p_last, v_last), trace_pv(p_first, p_first, v_first)
    for tr in (last, first):
        assert tr.split.cls == "tie" and tr.frac_error_from_p_one > 0.99
        assert tr.split.a == -3.2578125 and tr.split.r < 0  # the tie and the sign that breaks it
    # the Eq. 5 jumps at the P̄ = 1 terms do depend on the order: first, the midpoint rounds to even
    # (toward zero) and the small terms later carry the sum across it, so those jumps point the other way
    jumps_first = float(first.error_step[first.p_one_positions].sum()) / first.final_error
    assert jumps_first < 0
    assert abs(first.final_error - last.final_error) < 2**-12  # the same error either way


def test_nudging_p_one_removes_the_tie():
    p, v = _tied_row([0, 1])
    tr = trace_pv(p, p, v)
    assert tr.nudged_error is not None and abs(tr.nudged_error) < abs(tr.final_error)
    no_tie = trace_pv(torch.where(p == 1, torch.full_like(p, 0.5), p), p, v)
    assert no_tie.split.cls == "no-p-one" and no_tie.frac_error_from_p_one == 0.0 and no_tie.nudged_error is None
