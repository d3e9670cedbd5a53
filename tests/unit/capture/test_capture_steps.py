"""`--steps` as ranges: a selection of 10^18 steps costs a few numbers, never a set of them."""
from __future__ import annotations

import tracemalloc

import pytest

from fa_forensics.capture.selection import CaptureError, CaptureSelection, StepSet, parse_steps


def test_a_huge_range_is_kept_as_a_range():
    tracemalloc.start()
    try:
        selection = CaptureSelection.build("0:1000000000000000000")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200_000  # bytes: the range, not its 10^18 members
    steps = selection.steps
    assert 999_999_999_999_999_999 in steps and 10**18 not in steps and -1 not in steps
    assert selection.to_text()["steps"] == "0:1000000000000000000"
    assert selection.to_attrs()["steps"] == "0:1000000000000000000"  # too many to list in the store
    assert list(steps.below(3)) == [0, 1, 2] and steps.from_step(10**18 - 2).up_to(5) == [10**18 - 2, 10**18 - 1]


def test_the_text_form_reads_back_to_the_same_steps():
    for text in ("5,10:13,20:30:5", "3,1:5,4", "0:10:3", "7"):
        steps = parse_steps(text)
        assert parse_steps(steps.to_text()) == set(steps)
    assert list(parse_steps("3,1:5,4")) == [1, 2, 3, 4]
    assert parse_steps("0:10:3").from_step(4) == {6, 9}
    assert CaptureSelection.build([3, 1, 2]).to_attrs()["steps"] == [1, 2, 3]
    assert StepSet.of([1, 2, 3, 7]).to_text() == "1:4,7"


@pytest.mark.parametrize("bad", ["", "a", "5:", "-1", "3:1:0", "3:1", "0:-5"])
def test_a_selection_of_no_step_or_a_bad_one_is_refused(bad):
    with pytest.raises(CaptureError):
        parse_steps(bad)
