from xformers.ops.fmha import LowerTriangularMask, memory_efficient_attention  # noqa: F401
from xformers.ops import fmha  # noqa: F401
