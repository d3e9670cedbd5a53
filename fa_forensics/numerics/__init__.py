"""fa_forensics.numerics: float formats, rounding, bit views, accumulation models, one addition explained.

The bit-faithful arithmetic every replay rests on:
- `FORMATS`, `get_format`, `to_torch_dtype`: fp32, bf16, fp16, fp8_e4m3 (fn), fp8_e5m2;
- `round_to(x, fmt, mode)`: nearest-even, toward-zero, stochastic (seeded), with subnormals and saturation;
- `bits_of`, `from_bits`, `bit_string`, `ulp`, `ulp_distance`: bit-level views;
- `matmul`, `dot_trace`: the `ieee` and `tensor-core` accumulation models of a matrix product;
- `explain_add`: one addition bit by bit (guard / round / sticky), as in the paper's worked example;
- `exp_fp32`, `exp2_fp32`: exp and 2ˣ rounded once to fp32, the same bits on every machine.
"""
from fa_forensics.numerics.formats import FORMATS, FloatFormat, get_format, to_torch_dtype
from fa_forensics.numerics.rounding import ROUNDING_MODES, round_to
from fa_forensics.numerics.bits import bit_string, bits_of, from_bits, ordered_bits, ulp, ulp_distance
from fa_forensics.numerics.explain import AddExplanation, explain_add
from fa_forensics.numerics.elementary import exp2_fp32, exp_fp32
from fa_forensics.numerics.accumulate import ACCUMULATIONS, TensorCoreParams, dot_trace, matmul, tensor_core_params

__all__ = [
    "FORMATS", "FloatFormat", "get_format", "to_torch_dtype",
    "ROUNDING_MODES", "round_to",
    "bit_string", "bits_of", "from_bits", "ordered_bits", "ulp", "ulp_distance",
    "AddExplanation", "explain_add", "exp_fp32", "exp2_fp32",
    "ACCUMULATIONS", "TensorCoreParams", "dot_trace", "matmul", "tensor_core_params",
]
