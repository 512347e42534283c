"""The commands: ``grader run``, ``list``, ``doctor``, ``bench``, ``batch``, ``release`` and
``gradescope``, with their options (:mod:`.cli` parses them and hands each to its module).
A node that lends its ranks to node 0's jobs is ``grader run`` with ``--node-rank`` > 0."""
