"""Triton kernels that replay attention under a ReplayConfig, and the launch code around them.

Nothing here imports triton at package import time: the interpreter switch TRITON_INTERPRET=1
must be set before triton's first import, so `kernels` is only imported inside functions.

- `kernels.py`  the @triton.jit kernels (forward, δ, backward dK/dV, backward dQ), each with its
                numerics contract in a header comment.
- `launch.py`   ReplayConfig → constexprs (dtypes, softmax rule, P-scale mode), grids, launches.
- `backend.py`  `replay_triton(q, k, v, config, do=None, causal=..., scale=...) -> ReplayOut`,
                the adapter `replay(..., backend="triton")` dispatches to.
- `compile_check.py` compiles every kernel for a GPU target (sm_90) without a GPU.
"""
