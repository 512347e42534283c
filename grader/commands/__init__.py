"""The commands: ``grader run``, ``bench``, ``batch``, ``release``, ``gradescope`` and
``node`` (a node lending its ranks to node 0's jobs), with their options (:mod:`.cli`
parses them and hands each to its module)."""
