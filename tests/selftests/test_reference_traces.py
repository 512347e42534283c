"""The shipped reference traces are what the reference does, rebuilt by the documented command.

The cost tests compare every submission's messages with
``grader/judge/reference_traces.json``: a reference changed without a
rebuild, or a size changed in grading.yaml, would grade against a pattern the
reference no longer makes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from runner import REPO

from grader.broker.traffic import Message
from grader.judge.reference_traces import TRACES_FILE, differences, graded_sizes, key
from grader.testkit.calls import COLLECTIVES


def test_the_shipped_traces_cover_exactly_the_graded_sizes() -> None:
    shipped = json.loads(TRACES_FILE.read_text())
    wanted = {
        key(function, world_size, n)
        for world_size, counts in graded_sizes().items()
        for n in counts
        for function in COLLECTIVES
    }
    assert set(shipped) == wanted


def test_the_rebuild_command_makes_the_shipped_traces(tmp_path) -> None:
    rebuilt = tmp_path / "traces.json"
    done = subprocess.run(
        [sys.executable, "-m", "grader.judge.reference_traces", "--output", str(rebuilt)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    stale = differences(json.loads(TRACES_FILE.read_text()), json.loads(rebuilt.read_text()))
    assert not stale, "\n".join(["rebuild with `python -m grader.judge.reference_traces`", *stale])
    assert rebuilt.read_bytes() == TRACES_FILE.read_bytes()


def test_a_stale_trace_is_named_with_its_first_wrong_message() -> None:
    send = {"op": "send", "peer": 1, "nbytes": 8, "tag": 0}
    recv = {"op": "recv", "peer": 0, "nbytes": 8, "tag": 0}
    rebuilt = {"broadcast/ws2/n2": [[send], [recv]], "reduce/ws2/n2": [[send], [recv]]}
    shipped = {
        "broadcast/ws2/n2": [[send], [recv]],
        "reduce/ws2/n2": [[{**send, "nbytes": 4}], [recv]],
        "gather/ws2/n2": [[], []],
    }
    assert differences(shipped, rebuilt) == [
        "gather/ws2/n2: not graded any more",
        f"reduce/ws2/n2: rank 0's message 0 is {shipped['reduce/ws2/n2'][0][0]} shipped, "
        f"{send} in the reference",
    ]
    assert differences({}, rebuilt) == ["broadcast/ws2/n2: missing", "reduce/ws2/n2: missing"]
    assert differences(rebuilt, rebuilt) == []


def test_every_shipped_entry_reads_as_a_message_and_a_malformed_one_is_refused() -> None:
    shipped = json.loads(TRACES_FILE.read_text())
    for ranks in shipped.values():
        for log in ranks:
            assert [Message.from_json(entry).to_json() for entry in log] == log
    send = {"op": "send", "peer": 1, "nbytes": 8, "tag": 0}
    for bad in [
        {**send, "nbytes": "8"},
        {**send, "tag": True},
        {**send, "op": "all_reduce"},
        {**send, "of": 0},
        {"op": "wait", "of": 0.5},
        [send],
    ]:
        with pytest.raises(ValueError):
            Message.from_json(bad)
