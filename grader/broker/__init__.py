"""The trusted broker: every message and collective between ranks passes through it."""
