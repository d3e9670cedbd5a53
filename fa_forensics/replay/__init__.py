"""Replay of attention forward/backward under a ReplayConfig (emulator on CPU, Triton on GPU).

    from fa_forensics.replay import replay, ReplayConfig
    out = replay(q, k, v, ReplayConfig.preset("bf16"), do=do)   # out.o, out.lse, out.stats, out.dq ...
    with use_engine(Engine.SPEC):                               # the torch specification: the same bits, slower
        ...

`fa_forensics.replay` is this package and, called, its function `replay` (`from fa_forensics import replay;
replay(q, k, v, config)` works whatever was imported before). The engine's names are imported on first
use, so that the light `replay.config` (the presets, which the CLI's help lists) is imported alone.
"""
from typing import TYPE_CHECKING

from fa_forensics import lazy_exports, make_callable
from fa_forensics.enums import (  # noqa: F401
    Accumulation,
    DeltaSource,
    Engine,
    GPUModel,
    KVOrder,
    Precision,
    PScaleMode,
    Rounding,
    Softmax,
)
from fa_forensics.replay.config import PRESETS, ReplayConfig  # noqa: F401

if TYPE_CHECKING:  # the same names, for readers of the source (type checkers, the API docs)
    from fa_forensics.numerics.engines import use_engine  # noqa: F401
    from fa_forensics.replay.api import BackendUnavailable, replay  # noqa: F401
    from fa_forensics.replay.out import PBarStats, ReplayOut  # noqa: F401

__getattr__ = lazy_exports(__name__, {
    "use_engine": "fa_forensics.numerics.engines",
    "PBarStats": "fa_forensics.replay.out",
    "ReplayOut": "fa_forensics.replay.out",
    "BackendUnavailable": "fa_forensics.replay.api",
    "replay": "fa_forensics.replay.api",
})

make_callable(__name__)
