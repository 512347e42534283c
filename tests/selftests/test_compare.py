"""check_close's messages, in-process and fast: no job, no rank.

Each message must lead to the fix: a tensor that came back as it went in is
named as such, and a rounding failure shows numbers that differ, the error
against the tolerance, and a lower precision when that explains it.
"""

from __future__ import annotations

import re

import pytest
import torch

from grader.testkit.compare import check_close, check_unchanged, format_pair, sums_in_float64


def failure(*args: object, **kwargs: object) -> str:
    with pytest.raises(AssertionError) as raised:
        check_close(*args, **kwargs)  # type: ignore[arg-type]
    return str(raised.value)


def shown_numbers(message: str) -> tuple[str, str]:
    found = re.search(r"expected (\S+), got (\S+?)[ ,(]", message + " ")
    assert found, message
    return found.group(1), found.group(2)


def test_close_values_pass() -> None:
    x = torch.tensor([1.0, -2.5, 3.25])
    check_close(x.clone(), x, "same")
    check_close(torch.tensor([3, 4]), torch.tensor([3, 4]), "integers")


def test_unchanged_output_names_both_causes_and_the_fix() -> None:
    mine = torch.tensor([0.25, 0.5, 0.75])
    message = failure(mine.clone(), torch.tensor([1.0, 2.0, 3.0]), "rank 1: bcast", before=mine)
    assert "came back unchanged: nothing was received into it, or the result was never " in message
    assert message.endswith("copied back into it with copy_)")
    assert "not written" not in message


def test_explanation_that_fits_every_wrong_element_is_given() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    message = failure(a.clone(), a + b, "sum", explanations={"rank 1's contribution is missing": a})
    assert message.endswith("(rank 1's contribution is missing)")
    assert "tolerance" not in message  # a wrong value, not a rounding question


def test_precision_failure_never_prints_identical_numbers() -> None:
    want = torch.tensor([-1.50163], dtype=torch.float64)
    got = want + 3e-7  # well beyond float64's tolerance, invisible at 6 digits
    message = failure(got, want, "rank 0: all_reduce of float64[1]")
    expected, actual = shown_numbers(message)
    assert expected != actual, message
    assert "off by 3e-07" in message and "relative 2e-07" in message
    assert ", tolerance 1.3e-15" in message


def test_float64_off_by_float32_rounding_names_the_lower_precision() -> None:
    inputs = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = inputs.sum(0)
    got = inputs.float().sum(0).double()  # accumulated in float32
    message = failure(got, want, "rank 0: all_reduce", magnitude=inputs.abs().sum(0), terms=3)
    assert "likely accumulated in a lower precision (float32) than the float64 input" in message
    expected, actual = shown_numbers(message)
    assert expected != actual, message


def test_float32_off_by_bfloat16_rounding_names_the_lower_precision() -> None:
    inputs = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    want = inputs.double().sum(0).float()
    got = inputs.bfloat16().sum(0).float()
    message = failure(got, want, "sum", magnitude=inputs.double().abs().sum(0), terms=4)
    assert "lower precision (bfloat16) than the float32 input" in message


def test_error_beyond_the_lower_precision_gives_figures_only() -> None:
    want = torch.tensor([1.0, 2.0], dtype=torch.float64)
    got = want * (1 + 1e-4)  # far above float32's rounding, still a near miss
    message = failure(got, want, "x")
    assert ", tolerance " in message
    assert "lower precision" not in message


def test_integers_and_nans_are_plain() -> None:
    message = failure(torch.tensor([1, 7]), torch.tensor([1, 8]), "ints")
    assert message == "ints: element 1: expected 8, got 7"
    message = failure(torch.tensor([float("nan")]), torch.tensor([1.5]), "nan")
    assert message == "nan: element 0: expected 1.5, got nan"


def test_format_pair_adds_digits_until_values_differ() -> None:
    assert format_pair(0.5, 0.25) == ("0.5", "0.25")
    shown = format_pair(-1.5016300001, -1.5016300002)
    assert shown[0] != shown[1]
    assert format_pair(2.0, 2.0) == ("2", "2")


def test_check_unchanged_shows_distinct_numbers() -> None:
    original = torch.tensor([1.0000001], dtype=torch.float64)
    with pytest.raises(AssertionError) as raised:
        check_unchanged(original + 1e-12, original, "input")
    was, now = re.search(r"was (\S+), now (\S+)$", str(raised.value)).groups()  # type: ignore[union-attr]
    assert was != now


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_sums_in_float64_leave_the_terms_as_they_are(dtype: torch.dtype) -> None:
    terms = [torch.tensor([1, -2, 3]).to(dtype), torch.tensor([4, 5, -6]).to(dtype)]
    before = [t.clone() for t in terms]
    total, magnitude = sums_in_float64(terms)
    assert total.tolist() == [5.0, 3.0, -3.0] and magnitude.tolist() == [5.0, 7.0, 9.0]
    assert total.dtype == magnitude.dtype == torch.float64
    for term, original in zip(terms, before, strict=True):
        assert torch.equal(term, original)  # a float64 term is no copy of itself


def test_equal_values_pass_but_a_nan_never_does() -> None:
    check_close(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]), "signed zero")
    nan = torch.tensor([float("nan")])
    assert "nan" in failure(nan.clone(), nan, "nan").lower()
