"""A helper module of the submission, imported by ``collectives``."""

calls = 0
