"""The CPU emulator: FlashAttention-2 forward and backward in PyTorch with explicit rounding.

It is the reference the GPU kernels are tested against. Every matrix product goes through
numerics.matmul (ieee or tensor-core accumulation), every rounding through numerics.round_to.
The order of every operation is written out in forward.py and backward.py.
"""
from fa_forensics.replay.emulate.run import emulate_replay  # noqa: F401
