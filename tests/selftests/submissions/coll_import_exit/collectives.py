"""Ends the process as soon as it is imported."""

import os

os._exit(0)
