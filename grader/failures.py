"""How a call on the ranks can fail, as the graded tests and the grader see it.

:meth:`World.call` raises one of these when the submission did not simply
return: the grader turns it into the test's outcome and message. A test
never needs to catch them; a plain ``AssertionError`` of the test's own is
an outcome too (``failed``).
"""

from __future__ import annotations

from enum import Enum

from grader import protocol


class Cause(str, Enum):
    """What a failure is, for machines (results.json's ``extra_data.cause``, the class
    report): a closed vocabulary, set where the failure is raised, beside the message for
    people. The broker's faults (:class:`Fault`) are causes of their own name."""

    NOT_SUBMITTED = "not_submitted"  # no module for the part
    SYNTAX_ERROR = "syntax_error"  # the module does not compile
    NOT_IMPLEMENTED = "not_implemented"  # the stub still raises NotImplementedError
    RAISED = "raised"  # the student's code raised
    REFUSED = "refused"  # the sandbox refused a system call (a socket, a process, a lock)
    FORBIDDEN = "forbidden"  # a built-in collective where the part forbids them
    PROTOCOL = "protocol"
    LIMIT = "limit"
    MISMATCH = "mismatch"
    BAD_PEER = "bad_peer"
    DISAGREEMENT = "disagreement"
    DEADLOCK = "deadlock"
    UNRECEIVED = "unreceived"
    UNWAITED = "unwaited"
    TIMED_OUT = "timed_out"  # a rank never returned
    CRASHED = "crashed"  # a rank's process died
    WRONG_RESULT = "wrong_result"  # a value, shape or dtype the trusted side did not expect
    CHECK = "check"  # a graded test's own check of what the call did
    COST = "cost"  # partial credit: more bytes, rounds or time than the reference's
    SKIPPED = "skipped"  # a test that skipped itself earns nothing
    NOT_RUN = "not_run"  # interrupted, or the run stopped early
    GRADER = "grader"  # the grader's own machinery or the course's configuration


class RankFailure(Exception):
    """The submission failed a call; ``outcome`` is the test's outcome, ``cause`` what it is
    (:class:`Cause`), the text its message, ``case`` the input case the call ran on (its
    message names it: " (case: ...)"), ``check`` which failure of its cause it is where
    one cause has several (the exception and the line of the student's code that raised)."""

    outcome = protocol.ERROR
    cause = Cause.RAISED

    def __init__(
        self, message: str = "", case: str = "", cause: Cause | None = None, check: str = ""
    ) -> None:
        super().__init__(message)
        self.case = case
        self.check = check
        if cause is not None:
            self.cause = cause

    def with_hint(self, hint: str) -> RankFailure:
        """The same failure, with what the test knows of its cause after the message."""
        return type(self)(f"{self} ({hint})", self.case, self.cause, self.check)


class NotImplementedYet(RankFailure):
    outcome = protocol.FAILED
    cause = Cause.NOT_IMPLEMENTED


class StudentError(RankFailure):
    """The student's code raised on some rank."""


class ForbiddenCall(RankFailure):
    outcome = protocol.FORBIDDEN
    cause = Cause.FORBIDDEN


class Deadlock(RankFailure):
    outcome = protocol.TIMEOUT
    cause = Cause.DEADLOCK


class TimedOut(RankFailure):
    outcome = protocol.TIMEOUT
    cause = Cause.TIMED_OUT


class Crashed(RankFailure):
    outcome = protocol.CRASHED
    cause = Cause.CRASHED


class CommunicationError(RankFailure):
    """A fault the broker saw: a size mismatch, a bad peer, a message never received."""


class GraderFailure(Exception):
    """The grader's own machinery failed (a job that would not start): never the student's."""


class Fault(str, Enum):
    """What the broker saw go wrong in a call, in the order a test tells them: the first is the
    most telling (a broken protocol explains the deadlock that follows it, not the reverse)."""

    FORBIDDEN = "forbidden"  # a built-in collective where the part forbids them
    PROTOCOL = "protocol"  # a frame that breaks the format or lies about what it carries
    LIMIT = "limit"  # a rank that costs the trusted side more than it may
    MISMATCH = "mismatch"  # a send and its receive of another size or dtype
    BAD_PEER = "bad_peer"  # a message to itself or to a rank outside the group
    DISAGREEMENT = "disagreement"  # members of a collective that call different ones
    DEADLOCK = "deadlock"  # no rank can make progress
    UNRECEIVED = "unreceived"  # a message sent and never received, or the reverse
    UNWAITED = "unwaited"  # a request never waited

    @property
    def failure(self) -> type[RankFailure]:
        """The failure (and so the outcome) a test gets for it."""
        special = {Fault.FORBIDDEN: ForbiddenCall, Fault.DEADLOCK: Deadlock}
        return special.get(self, CommunicationError)

    @property
    def cause(self) -> Cause:
        return Cause(self.value)

    @property
    def precedence(self) -> int:
        return list(Fault).index(self)
