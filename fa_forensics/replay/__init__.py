"""Replay of attention forward/backward under a ReplayConfig (emulator on CPU, Triton on GPU)."""
from fa_forensics.replay.config import (  # noqa: F401
    PRESETS,
    Accumulation,
    DeltaSource,
    GPUModel,
    KVOrder,
    Precision,
    PScaleMode,
    ReplayConfig,
    Rounding,
    Softmax,
)
