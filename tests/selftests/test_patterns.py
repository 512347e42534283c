"""The patterns a wrong result is explained by, in-process: no job, no rank.

Each pattern is named when it accounts for every wrong element, and only then: a result
that fits none gets the numbers alone, never a guess.
"""

from __future__ import annotations

import re

import pytest
import torch

from grader.testkit.compare import WrongResult, check_close, named_cause, on_every_rank
from grader.testkit.patterns import Expected, Region
from grader.tolerances import EXACT, FLOAT32, FLOAT64_ORACLE, POLICIES


def reason(got: torch.Tensor, want: torch.Tensor, **kwargs: object) -> str:
    """The reason the message gives; a region's is not the result's cause (``.reason``)."""
    with pytest.raises(WrongResult) as raised:
        check_close(got, want, "x", **kwargs)  # type: ignore[arg-type]
    if raised.value.reason:
        assert str(raised.value).endswith(f" ({raised.value.reason})")
        return raised.value.reason
    given = re.search(r"\(([^()]*)\)$", str(raised.value))
    return given.group(1) if given and not given.group(1).startswith("and ") else ""


def peers(p: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=generator) for _ in range(p)]


def test_another_ranks_value_names_the_rank_and_the_neighbours_words() -> None:
    want = peers(4)
    words = {1: "the next rank's: the last hop home is missing", -1: "the previous rank's"}
    context = Expected(rank=1, peers=want, neighbours=words)
    assert reason(want[2], want[1], context=context) == (
        "it is rank 2's expected value: the next rank's: the last hop home is missing"
    )
    assert reason(want[0], want[1], context=context) == (
        "it is rank 0's expected value: the previous rank's"
    )
    assert reason(want[3], want[1], context=context) == "it is rank 3's expected value"


def test_rows_in_another_order_are_named_with_where_one_belongs() -> None:
    want = peers(1)[0]
    got = want[[0, 2, 1]]
    assert reason(got, want, context=Expected(rows_dim=0)) == (
        "the right values in another order: its row 1 holds what belongs at row 2 "
        "(2 of 3 rows moved)"
    )
    assert reason(got, want) == ""  # the caller did not say the order could be wrong


def test_a_uniform_factor_is_named_p_only_where_it_is_not_two() -> None:
    want = peers(1)[0]
    assert reason(want * 4, want, context=Expected(p=4)) == "it is p = 4 times the expected value"
    assert reason(want / 4, want, context=Expected(p=4)) == (
        "it is 1/p = 0.25 times the expected value"
    )
    assert reason(want * 2, want, context=Expected(p=2)) == "it is 2 times the expected value"
    assert reason(want * 3, want, context=Expected(p=2)) == ""


def test_regions_padding_within_merge_exactly_nan_rows() -> None:
    want = torch.zeros(4, 3)
    padding = torch.zeros(4, 3, dtype=torch.bool)
    padding[3, 1:] = True
    got = want.clone()
    got[3, 2] = 7.0
    only = Region(padding, "only the padding is wrong")
    assert reason(got, want, context=Expected(regions=[only])) == "only the padding is wrong"
    with pytest.raises(WrongResult) as raised:
        check_close(got, want, "x", context=Expected(regions=[only]))
    assert raised.value.reason == ""  # where, not what: a region does not account for values
    got[0, 0] = 1.0
    assert reason(got, want, context=Expected(regions=[only])) == ""
    several = torch.tensor([False, True, True, False])[:, None]
    merge = Region(several, "wrong exactly where several blocks merge", exact=True)
    got = want.clone()
    got[1:3] = 1.0
    assert reason(got, want, context=Expected(regions=[merge])) == merge.words
    got[2] = 0.0  # row 2 merges several blocks but is right: not this pattern
    assert reason(got, want, context=Expected(regions=[merge])) == ""
    first = torch.tensor([True, False, False, False])[:, None]
    nan = Region(first, "NaN where a row has nothing to attend to", nan=True)
    got = want.clone() + 1.0
    got[0] = float("nan")
    assert reason(got, want, context=Expected(regions=[nan])) == nan.words


def test_no_rounding_guess_unless_the_values_are_the_lower_dtypes() -> None:
    want = torch.full((8,), 1.0)
    got = want + 3.1e-3  # within bfloat16's bound of a 96-term sum, but no bfloat16 value
    with pytest.raises(WrongResult) as raised:
        check_close(got, want, "x", terms=96)
    message = str(raised.value)
    assert "bfloat16" not in message and "lower precision" not in message


def test_the_named_policies() -> None:
    want = torch.tensor([1.0, -2.0], dtype=torch.float64)
    assert EXACT.holds(want.clone(), want) and not EXACT.holds(want + 1e-15, want)
    assert FLOAT64_ORACLE.holds(want + 1e-12, want) and not FLOAT64_ORACLE.holds(want + 1e-7, want)
    assert FLOAT32.holds(want + 1e-6, want) and not FLOAT32.holds(want + 1e-4, want)
    assert not FLOAT32.holds(torch.tensor([float("nan"), 0.0]), want)
    assert {"exact", "float64 oracle", "float32", "float32 bucket"} <= set(POLICIES)
    assert all(name == policy.name for name, policy in POLICIES.items())


def test_a_communication_test_leaves_only_a_cause_that_accounts_for_every_value() -> None:
    """named_cause: a wrong result whose values a usual mistake accounts for, on every
    failing rank, is the correctness tests' deduction; a region (where, not what), or one
    rank unexplained, fails the communication test too."""
    want = peers(2)

    def check(got: list[torch.Tensor], context: Expected) -> None:
        on_every_rank(2, lambda r: check_close(got[r], want[r], "x", context=context))

    assert named_cause(lambda: check(want, Expected())) is None
    named = named_cause(lambda: check([2 * w for w in want], Expected()))
    assert named is not None and "(it is 2 times the expected value)" in named
    with pytest.raises(WrongResult):
        named_cause(lambda: check([2 * want[0], 3 * want[1]], Expected()))
    everywhere = Region(torch.ones(3, 4, dtype=torch.bool), "wrong somewhere")
    with pytest.raises(WrongResult):
        named_cause(lambda: check([w + 1 for w in want], Expected(regions=[everywhere])))
