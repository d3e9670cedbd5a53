"""Max logit and top-1 from a forward's row maxima and log-sum-exp (monitor/lse_stats.py), and the side stream's
CPU path (monitor/side_stream.py)."""
import math

import torch

from fa_forensics.monitor import head_statistics
from fa_forensics.monitor.lse_stats import head_stats_from_lse
from fa_forensics.monitor.side_stream import SideStream


def test_top1_and_max_logit_from_row_max_and_lse_equal_head_statistics():
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 3, 40, 16
    q, k = torch.randn(B, H, T, D, generator=g) * 2, torch.randn(B, H, T, D, generator=g)
    scale = D ** -0.5
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf)
    row_max, lse = s.amax(dim=-1), torch.logsumexp(s, dim=-1)  # what a FlashAttention-style forward keeps
    full = head_statistics(q, k, scale=scale, causal=True, score_dtype=torch.float32)
    for units in ("natural", "log2"):
        f = 1.0 if units == "natural" else 1.0 / math.log(2.0)
        max_logit, top1 = head_stats_from_lse(row_max * f, lse * f, log2_units=units == "log2")
        torch.testing.assert_close(max_logit, full.max_logit, rtol=1e-6, atol=0)
        torch.testing.assert_close(top1, full.top1_prob, rtol=1e-5, atol=0)
    # a row with no visible key has no top-1 (NaN), as in head_statistics
    row_max[0, 0, 3], lse[0, 0, 3] = -torch.inf, -torch.inf
    assert torch.isnan(head_stats_from_lse(row_max, lse, log2_units=False)[1][0])


def test_side_stream_runs_work_inline_on_the_cpu():
    side = SideStream(torch.device("cpu"))
    x = torch.arange(4.0)
    assert side.stream is None and torch.equal(side.run(lambda: x * 2, x), x * 2)
    side.join()  # nothing queued: returns at once
