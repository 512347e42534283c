"""Reporting: the terminal for people, results.json (Gradescope's format) for machines."""
