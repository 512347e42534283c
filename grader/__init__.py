"""An autograder for a course on the communication operations of distributed training.

Rooms: ``launch`` starts and supervises torchrun jobs; ``rank`` is what runs
inside each rank; ``judge`` turns the ranks' reports into verdicts; ``report``
shows them (terminal) and records them (results.json).
"""
