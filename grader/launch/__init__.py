"""Launching the torchrun jobs of sandboxed ranks that the graded tests drive from the
grader's process, and ending them whole. No verdict is made here (:mod:`grader.judge`)."""
