"""How a call on the ranks can fail, as the graded tests and the grader see it.

:meth:`World.call` raises one of these when the submission did not simply
return: the grader turns it into the test's outcome and message. A test
never needs to catch them; a plain ``AssertionError`` of the test's own is
an outcome too (``failed``).
"""

from __future__ import annotations

from grader import protocol


class RankFailure(Exception):
    """The submission failed a call; ``outcome`` is the test's outcome, the text its message."""

    outcome = protocol.ERROR


class NotImplementedYet(RankFailure):
    outcome = protocol.FAILED


class StudentError(RankFailure):
    """The student's code raised on some rank."""


class ForbiddenCall(RankFailure):
    outcome = protocol.FORBIDDEN


class Deadlock(RankFailure):
    outcome = protocol.TIMEOUT


class TimedOut(RankFailure):
    outcome = protocol.TIMEOUT


class Crashed(RankFailure):
    outcome = protocol.CRASHED


class CommunicationError(RankFailure):
    """A fault the broker saw: a size mismatch, a bad peer, a message never received."""


class GraderFailure(Exception):
    """The grader's own machinery failed (a job that would not start): never the student's."""


BY_PROBLEM = {
    "deadlock": Deadlock,
    "forbidden": ForbiddenCall,
    "mismatch": CommunicationError,
    "bad_peer": CommunicationError,
    "disagreement": CommunicationError,
    "unreceived": CommunicationError,
    "unwaited": CommunicationError,
    "limit": CommunicationError,
    "protocol": CommunicationError,
}
