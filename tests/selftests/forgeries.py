"""The checks every scenario's observation record earns (``grader/testkit/observed.py``): a
rank's return forged in its own process fails in one line, charged to the submission as a
broken protocol, and never quotes the rank's text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from grader.failures import Cause, CommunicationError

Forge = Callable[[dict], Any]


def setting(**fields: object) -> Forge:
    """A forgery that sets ``fields`` in the return."""
    return lambda tree: {**tree, **fields}


def without(name: str) -> Forge:
    """A forgery that drops field ``name``."""
    return lambda tree: {k: v for k, v in tree.items() if k != name}


def assert_broken_protocol(
    observations: Callable[[list, str], Any],
    honest: Callable[[], Any],
    forgery: tuple[Forge, str],
    scenario: str,
) -> None:
    """``observations`` of an ``honest()`` rank 0 and ranks 1 and 2 that returned its forgery:
    one line naming rank 1 (and rank 2 as the same), which says what the forgery says, a
    protocol fault."""
    forge, said = forgery
    bad = forge(honest())
    case = "a case"
    with pytest.raises(CommunicationError) as caught:
        observations([honest(), bad, bad], case)
    message = str(caught.value)
    assert message.startswith(f"rank 1: {scenario} returned a malformed observation: "), message
    assert said in message and message.endswith(f"(the same on rank 2) (case: {case})")
    assert caught.value.cause is Cause.PROTOCOL and "\n" not in message
    assert "full marks" not in message  # the rank's text is never quoted


def assert_earns_nothing(test: dict[str, Any], said: str) -> None:
    """A graded test of a forged return: an error in one line that starts with ``said``."""
    assert test["extra_data"]["outcome"] == "error", test["name"]
    assert test["output"].startswith(said), test["output"]
    assert test["score"] == 0 and test["extra_data"]["cause"] == "protocol"
    assert "\n" not in test["output"].strip() and "Error" not in test["output"]
