"""Judging: from what the ranks reported to a verdict and a message a student can act on."""
