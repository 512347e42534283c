"""An autograder for a course on the communication operations of distributed training.

Rooms: ``launch`` starts and ends torchrun jobs of sandboxed ranks; ``rank`` is
what runs inside each rank; ``broker`` is the trusted end of every rank's
connection, which carries and counts every message; ``judge`` runs the graded
tests in the grader's own process and makes every verdict from what the
trusted side computed and the broker saw; ``report`` shows the verdicts
(terminal) and records them (results.json).
"""
