"""The scores, P̄ and P the analyses form themselves apply a recorded attn_mask as the replay and SDPA do."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fa_forensics.analyses.fix_check.compute import max_p_bar_in_repeated_rows
from fa_forensics.analyses.primitives import attention_probs, scores_fp32
from fa_forensics.analyses.pv_trace.compute import p_bar_rows, repeated_max_rows
from fa_forensics.layers.selection import mask_of
from fa_forensics.replay.config import ReplayConfig

B, H, T, D = 2, 2, 12, 8


def _inputs():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, T, D, generator=g).bfloat16().float() for _ in range(3))
    k[:, :, 1] = k[:, :, 0]  # keys 0 and 1 identical: every row that sees both has a repeated maximum...
    q[:, :, :, :] = q[:, :, :, :].abs()
    k[:, :, 0] = k[:, :, 1] = 4.0  # ...and it is the maximum (q > 0)
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    allowed[1, :, :, 1] = False  # batch 1: key 1 is padding
    allowed[1, :, 5] = False  # batch 1, row 5 sees no key at all
    return q, k, v, allowed


def _additive(allowed: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, fill)


@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_rank1_p_is_sdpa_under_the_mask(kind):
    q, k, v, allowed = _inputs()
    mask = allowed if kind == "bool" else _additive(allowed, -math.inf)
    p = attention_probs(q, k, 0.3, False, mask)
    seen = allowed.expand(B, H, T, T).any(-1)  # (B, H, T)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                         attn_mask=mask if kind == "bool" else mask.double(), scale=0.3)
    torch.testing.assert_close((p @ v.double())[seen], ref[seen])
    assert (p[~seen] == 0).all() and (p[1, :, :, 1] == 0).all()  # padding and a row with no key: P = 0


def test_hugging_face_style_additive_mask_is_added_like_sdpa():
    q, k, v, allowed = _inputs()
    allowed[1, :, 5] = True  # finfo.min rows are not empty for SDPA: keep every row seeing a key
    mask = _additive(allowed, torch.finfo(torch.float32).min)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=0.3)
    torch.testing.assert_close(attention_probs(q, k, 0.3, False, mask) @ v.double(), ref)


@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_pv_trace_p_bar_rows_zero_where_masked_and_normalize_to_sdpa(kind):
    q, k, v, allowed = _inputs()
    mask = allowed if kind == "bool" else _additive(allowed, -math.inf)
    m = mask_of(mask, 1, 0)  # (T, T) of batch 1, head 0
    p_lp, p_hp = p_bar_rows(q[1, 0], k[1, 0], 0.3, causal=False, config=ReplayConfig(), mask=m)
    assert (p_lp[:, 1] == 0).all() and (p_hp[:, 1] == 0).all() and (p_hp[5] == 0).all() and (p_lp[5] == 0).all()
    o = (p_hp.double() / p_hp.double().sum(-1, keepdim=True)) @ v[1, 0].double()
    ref = F.scaled_dot_product_attention(q[1:2, :1].double(), k[1:2, :1].double(), v[1:2, :1].double(),
                                         attn_mask=mask[1:2] if kind == "bool" else mask[1:2].double(), scale=0.3)[0, 0]
    keep = torch.arange(T) != 5
    torch.testing.assert_close(o[keep], ref[keep], atol=1e-6, rtol=1e-6)


def test_a_masked_twin_key_is_no_repeated_maximum():
    q, k, _, allowed = _inputs()
    free = repeated_max_rows(q, k, 0.3, False)
    masked = repeated_max_rows(q, k, 0.3, False, "fp32", allowed)
    assert free.all()  # keys 0 and 1 tie at the maximum in every row
    assert masked[0].all() and not masked[1].any()  # batch 1 cannot see key 1: no tie left (row 5: no maximum)
    s = scores_fp32(q, k, 0.3, False, "fp32", allowed)
    assert torch.isneginf(s[1, :, :, 1]).all() and torch.isneginf(s[1, :, 5]).all()
    assert max_p_bar_in_repeated_rows(s, ReplayConfig()) == 1.0  # batch 0's tied rows still reach P̄ = 1
