"""Monitor kernel inputs on a grid of 1/8: every q·k is exact in fp32 whatever the summation order."""
import torch


def grid_inputs(seed, B, H, T, Tk, D, spread):
    """bf16 q (B, H, T, D) with |q| ≤ spread and k (B, H, Tk, D) with |k| ≤ 2, multiples of 1/8; in head 1 keys 5
    and 9 are identical and the queries from 9 on aligned with them (a tie at the row maximum)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8 * spread, 8 * spread + 1, (B, H, T, D), generator=g) / 8.0
    k = torch.randint(-16, 17, (B, H, Tk, D), generator=g) / 8.0
    k[:, 1, 9] = k[:, 1, 5]
    q[:, 1, 9:] = k[:, 1, 5].unsqueeze(1)
    return q.bfloat16(), k.bfloat16()
