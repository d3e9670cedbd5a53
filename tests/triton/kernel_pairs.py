"""The Triton kernels and the CPU emulator on the same inputs, and how much of two results agrees bit for bit."""
from fa_forensics.replay import replay


def triton_and_emulator(cfg, inputs, causal=True):
    """The replay of `inputs` (q, k, v, dO) under `cfg` by the kernels (interpreted) and by the emulator."""
    q, k, v, do = inputs
    tri = replay(q, k, v, cfg, do, backend="triton", causal=causal)
    emu = replay(q, k, v, cfg, do, backend="emulate", causal=causal)
    return tri, emu


def exact_fraction(a, b) -> float:
    """The fraction of elements of `a` and `b` equal bit for bit (as fp32)."""
    return (a.float() == b.float()).float().mean().item()
