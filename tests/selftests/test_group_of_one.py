"""A collective counts only as what it did between ranks (issue 45).

A rank can make a group of itself alone (``dist.new_group([rank])``) and run its collectives
there: the broker completes them at once, and what they carried never reached another rank.
Each attack below shows the messages a test looks for (the right gradients, partial sums,
updates or shards, at the right time) in a group of one, and does the real exchange by
another route; each must earn none of the points of the tests that judge the exchange,
while the reference, graded the same way, keeps all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from runner import Graded

DP, TP, FSDP = "data_parallel", "tensor_parallel", "fully_sharded"
BUCKETS = ("per_parameter", "few_buckets", "one_bucket", "cap_below_parameter")
FSDP_JUDGED = (
    *(f"memory_at_rest[{dtype}]" for dtype in ("float32", "bfloat16")),
    *(f"communication[{dtype}]" for dtype in ("float32", "float16")),
)


@dataclass(frozen=True)
class Attack:
    """A submission (``a+b``: ``a`` with ``b``'s overrides), what of its part is graded
    (``-k``), and the tests it must fail."""

    submission: str
    part: str
    k: str
    judged: tuple[str, ...]  # the tests of the exchange: each earns nothing
    says: str  # what the first of them tells the student


ATTACKS = [
    Attack(
        "dp_decoy_overlap+dp_solo_overlap",
        DP,
        "overlap",
        tuple(f"overlap[{b}]" for b in BUCKETS),
        "no all-reduce was called during backward and finish (of every rank",
    ),
    Attack(
        "tp_solo_mlp",
        TP,
        "parallel_mlp",
        ("parallel_mlp_communication",),
        "its forward made no communication",
    ),
    Attack(
        "zero_decoy_broadcasts+zero_solo_broadcasts",
        DP,
        "sharded_optimizer",
        ("sharded_optimizer_state",),
        "no rank sent parameter 0's updated value",
    ),
    Attack(
        "fsdp_solo_gathers",
        FSDP,
        "",
        FSDP_JUDGED,
        "embed computed its forward before embed.weight was gathered",
    ),
    Attack(  # the reference's gathers in the first step, whose weights every rank has
        "fsdp_solo_gathers+fsdp_solo_after_first_step",
        FSDP,
        "",
        FSDP_JUDGED,
        "step 2: embed computed its forward before embed.weight was gathered",
    ),
]


def graded_at_two(grade, submission: str, attack: Attack) -> Graded:
    return grade(submission, attack.part, k=attack.k or None, world_sizes=(2,))


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.submission)
def test_collectives_in_a_group_of_one_earn_nothing(grade, attack: Attack) -> None:
    honest = graded_at_two(grade, "reference", attack)
    graded = graded_at_two(grade, attack.submission, attack)
    for name in attack.judged:
        kept = honest.test(name, 2, attack.part)
        assert kept["max_score"] > 0 and kept["score"] == kept["max_score"], kept["output"]
        test = graded.test(name, 2, attack.part)
        assert test["score"] == 0, (name, test["output"])
    assert attack.says in graded.test(attack.judged[0], 2, attack.part)["output"]


# The class of these attacks: the reference's code, every collective it calls posted in a
# group of one and made by messages instead (``submissions/solo_route``). What judges the
# exchange itself earns nothing; what judges the answers keeps its points (the exchange by
# messages is real), as the reference, graded alike, keeps every point.
EXCHANGE_KINDS = ("communication", "schedule")
OWNERSHIP = ("sharded_optimizer_state",)  # a correctness test of who sent the updates


def test_collectives_re_issued_in_a_group_of_one_earn_no_exchange_point(grade) -> None:
    parts = (DP, TP, FSDP)
    graded = grade("solo_route", *parts, world_sizes=(2,))
    honest = grade("reference", *parts, world_sizes=(2,))
    judged: dict[str, int] = dict.fromkeys(parts, 0)
    assert graded.tests, graded.stdout + graded.stderr
    for entry in graded.tests:
        extra = entry["extra_data"]
        twin = honest.test(extra["test"], 2, extra["part"])
        assert twin["score"] == twin["max_score"] > 0, twin["output"]
        if extra["kind"] in EXCHANGE_KINDS or extra["test"] in OWNERSHIP:
            judged[extra["part"]] += 1
            assert entry["score"] == 0, (entry["name"], entry["output"])
        else:
            assert entry["score"] == entry["max_score"], (entry["name"], entry["output"])
    assert all(judged.values()), judged  # every part has tests of the exchange
