"""The attention-mask warning: said once for the run, rows without a key counted as the replay masks them."""
from __future__ import annotations

import torch

from fa_forensics.layers import checks
from fa_forensics.layers.selection import LayerTensors


def _layer(mask: torch.Tensor, causal: bool, step: int = 0, layer: int = 0) -> LayerTensors:
    B, H, T, D = 2, 3, 4, 8
    q = torch.zeros(B, H, T, D)
    return LayerTensors(step=step, layer=layer, heads=list(range(H)), q=q, k=q.clone(), v=q.clone(), o=None, do=None,
                        x=None, scale=1.0, causal=causal, source=None, mask=mask)


def test_rows_without_a_key_count_every_batch_entry_and_head_and_the_causal_rule():
    # one (1, 1, T, K) mask shared by the batch and heads: query 1 may attend only key 3
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 1, :3] = False
    assert len(list(checks.attention_mask(_layer(mask, causal=False), None, None))) == 1  # key 3 is allowed
    # causal: key 3 lies in query 1's future, so that row allows nothing: 1 row x 2 batch entries x 3 heads
    lines = list(checks.attention_mask(_layer(mask, causal=True), None, None))
    assert lines[-1].startswith("step 0: 6 of 24 ")
    mask[..., 2, :] = False  # a row the mask empties by itself
    lines = list(checks.attention_mask(_layer(mask, causal=False), None, None))
    assert lines[-1].startswith("step 0: 6 of 24 ")
    lines = list(checks.attention_mask(_layer(mask, causal=True), None, None))
    assert lines[-1].startswith("step 0: 12 of 24 ")


def test_the_mask_line_is_the_same_in_every_layer_step():
    mask = torch.zeros(1, 1, 4, 4)
    first = list(checks.attention_mask(_layer(mask, causal=True, step=0, layer=0), None, None))
    other = list(checks.attention_mask(_layer(mask, causal=True, step=5, layer=3), None, None))
    assert first == other and len(first) == 1  # no row is empty: one line, said once for the run
