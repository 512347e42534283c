"""`grader list` keeps its collection in the user's cache, and never shows a stale one.

The cache (grader/commands/listing.py) is used only while the content of what it was
collected from is the same: the graded tests and the grader's own sources. To make a stale
listing visible, each test plants a test that does not exist in the cache file: a listing
read from the cache shows it, a fresh collection does not. A changed file keeps its old
modification time, so that only its content can tell.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from runner import REPO, run_grader

PLANTED = "only_in_the_cache"


def _course(tmp_path: Path) -> dict[str, str]:
    """A copy of the course's graded tests in ``tmp_path``, and a cache of its own."""
    shutil.copytree(REPO / "tests" / "graded", tmp_path / "tests" / "graded")
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


def _list(tmp_path: Path, env: dict[str, str]) -> str:
    config = tmp_path / "tests" / "graded" / "grading.yaml"
    command = ["--config", str(config), "list", "collectives"]
    done = run_grader(command, timeout=300, cwd=tmp_path, env=env)  # not the checkout's grader
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _plant(tmp_path: Path) -> None:
    """A row in the one cache file that no collection would find."""
    (cached,) = (tmp_path / "cache" / "grader").glob("collected-*.json")
    kept = json.loads(cached.read_text())
    kept["rows"].append(["collectives", PLANTED, "collectives.broadcast", "correctness", 2])
    cached.write_text(json.dumps(kept))


def _edit_keeping_time(path: Path, old: str, new: str) -> None:
    before = path.stat()
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_the_cache_is_used_until_a_graded_test_changes(tmp_path: Path) -> None:
    env = _course(tmp_path)
    assert PLANTED not in _list(tmp_path, env)
    _plant(tmp_path)
    assert PLANTED in _list(tmp_path, env)  # nothing changed: the cache is read

    graded = tmp_path / "tests" / "graded" / "test_collectives.py"
    _edit_keeping_time(graded, "def test_broadcast(", "def test_broadcast_renamed(")
    listed = _list(tmp_path, env)
    assert PLANTED not in listed and "broadcast_renamed" in listed


def test_the_cache_is_not_used_once_the_grader_changes(tmp_path: Path) -> None:
    env = _course(tmp_path)
    sources = tmp_path / "src"
    shutil.copytree(REPO / "grader", sources / "grader", ignore=shutil.ignore_patterns("*.pyc"))
    env["PYTHONPATH"] = str(sources)  # the grader that lists is this copy
    _list(tmp_path, env)
    _plant(tmp_path)
    assert PLANTED in _list(tmp_path, env)

    catalog = sources / "grader" / "course" / "catalog.py"
    _edit_keeping_time(catalog, '"""', '"""A changed grader. ')
    assert PLANTED not in _list(tmp_path, env)
