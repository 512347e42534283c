"""An autograder for a course on the communication operations of distributed training.

Rooms: ``commands`` are what a user types (``grader run``, ``batch``, ``bench``, ...);
``course`` is what is graded (grading.yaml, the graded tests, the submission, the secret);
``grading`` is one grading run from start to results; ``launch`` starts and ends torchrun
jobs of ranks, each in its ``sandbox`` (levels, what the ranks see, uids, seccomp filter),
and ``nodes`` spreads a job over several machines; ``rank`` is what
runs inside each rank; ``broker`` is the trusted end of every rank's connection, which
carries and counts every message; ``judge`` runs the graded tests in the grader's own
process and makes every verdict from what the trusted side computed and the broker saw;
``testkit`` is what a graded test imports, ``scenarios`` the rank-side steps of the
strategy tests; ``report`` shows the verdicts (terminal) and records them (results.json).
``protocol``, ``wire`` and ``failures`` are the floor both sides stand on: the frames
between a rank and the broker, and the failures a call can end in.
"""
