"""The course's secret: the key the inputs are drawn from, and the proof between nodes.

Set by the instructor in ``$GRADER_SECRET`` (the same on every node of a
multi-node run), else made once per machine in ``~/.config/grader/secret``
(mode 0600). The ranks never see it: its folder is hidden from the sandbox.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_ENV = "GRADER_SECRET"


def secret_path() -> Path:
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "grader" / "secret"


def secret() -> bytes:
    """The key: set by the instructor, or made once per machine."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV].encode()
    path = secret_path()
    try:
        return path.read_bytes()
    except OSError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        value = secrets.token_bytes(32)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as f:
            f.write(value)
        return value


def derive(purpose: str) -> bytes:
    """A key for one purpose, made from the secret: the secret itself never travels."""
    return hmac.new(secret(), purpose.encode(), hashlib.sha256).digest()
