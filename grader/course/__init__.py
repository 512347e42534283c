"""The course the grader grades: its configuration (``grading.yaml``, :mod:`.config`), the
graded tests it selects (:mod:`.catalog`), the submission as staged (:mod:`.submission`)
and the secret every input is seeded from (:mod:`.secret`)."""
