"""Bit views, ulp, ulp distance, and the paper's worked example through explain_add."""
import torch

from fa_forensics.numerics import bit_string, bits_of, explain_add, from_bits, ulp, ulp_distance


def test_bit_strings_of_the_paper_operands():
    assert bit_string(-2.4071154594421387, "fp32") == "11000000000110100000111000101110"
    assert bit_string(-2.296875, "fp32") == "11000000000100110000000000000000"
    assert bit_string(-4.71875, "bf16") == "1100000010010111"
    assert bit_string(448.0, "fp8_e4m3") == "01111110"
    assert len(bit_string(1.0, "fp16")) == 16


def test_bits_roundtrip_every_fp8_and_fp16_code():
    for fmt, n in (("fp8_e4m3", 256), ("fp8_e5m2", 256), ("fp16", 65536)):
        codes = torch.arange(n)
        values = from_bits(codes, fmt)
        finite = torch.isfinite(values)
        back = bits_of(values[finite], fmt)
        # -0 and +0 keep their own patterns; every finite code maps back to itself
        assert torch.equal(back, codes[finite])


def test_ulp_and_ulp_distance():
    x = torch.tensor([1.0, 1.5, 2.0, 0.0])
    assert ulp(x, "bf16").tolist() == [2.0**-7, 2.0**-7, 2.0**-6, 2.0**-133]
    a = torch.tensor([1.0078125, -1.0, 2.0, 0.0])
    b = torch.tensor([1.0, 1.0, 1.9921875, -0.0])
    assert ulp_distance(a, b, "bf16").tolist() == [1, -2 * 16256, 1, 0]


def test_explain_add_reproduces_the_paper_worked_example_exactly():
    ex = explain_add(-2.4071154594421387, -2.296875, into="bf16")
    assert ex.a_bits == "11000000000110100000111000101110"
    assert ex.b_bits == "11000000000100110000000000000000"
    assert ex.exact == -4.703990459442139
    assert ex.exact_bits == "11000000100101101000011100010111"
    assert ex.rounded == -4.71875
    assert ex.rounded_bits == "1100000010010111"
    assert ex.error == -0.014759540557861328
    assert (ex.guard, ex.round, ex.sticky, ex.direction) == (0, 1, 1, "up")
    assert ex.sum_aligned == "-10.01011010000111000101110" and ex.shift == 1
    assert ex.kept == "1.0010110" and ex.round_and_rest.startswith("1")


def test_explain_add_rounding_down_tie_and_inexact_accumulator():
    down = explain_add(1.0, 2.0**-9, into="bf16")  # round bit 0, sticky 1 -> toward zero
    assert (down.round, down.sticky, down.direction, down.rounded) == (0, 1, "down", 1.0)
    tie = explain_add(1.0, 2.0**-8, into="bf16")  # exactly half an ulp: ties to even (1.0)
    assert (tie.round, tie.sticky, tie.rounded, tie.direction) == (1, 0, 1.0, "down")
    lossy = explain_add(1.0, 2.0**-24 + 2.0**-30, into="fp32")  # the fp32 addition itself rounds
    assert lossy.exact_bits is None and lossy.guard == 1 and lossy.direction == "up"
    assert lossy.error == (1.0 + 2.0**-23) - (1.0 + 2.0**-24 + 2.0**-30)
