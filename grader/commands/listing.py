"""``grader list`` and ``grader bench``: what the course grades, and what a collective costs.

Neither grades: ``grader list`` starts no rank, and says what it found from pytest's
collection of the graded tests, which imports torch (the tests' modules do): seconds.
So the collection is kept, for the next ``grader list``, in the user's cache
(``$XDG_CACHE_HOME/grader``, else ``~/.cache/grader``; one file for each configuration),
beside a digest of the content of everything it depends on: the graded tests' folder, the
configuration, the grader's own sources and the versions of Python, pytest and torch. It
is used only while that digest is the same (a file's time is never asked), so a stale
listing is never shown; a cache file that is unreadable or not a listing is ignored.
Grading never reads this cache: it collects the tests itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

import grader
from grader.commands import interrupts
from grader.commands.options import UsageError
from grader.course import config as course
from grader.course.config import ConfigError, GradingConfig
from grader.course.submission import resolve

EXIT_PASSED, EXIT_FAILED, EXIT_CANNOT_GRADE, EXIT_INTERRUPTED = 0, 1, 2, 130
BENCHED = ("collectives",)  # the parts `grader bench` measures

# One graded test at one world size, as listed: part, name, target, kind, world size.
Row = tuple[str, str, str, str, int]


def list_tests(console: Console, config: GradingConfig, parts: list[str]) -> int:
    """Each part's tests, with their world sizes, points and visibility."""
    try:
        rows = collected(config)
    except ConfigError as err:
        print(f"grader: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    for part in parts:
        console.print(_table(config, part, [r for r in rows if r[0] == part]))
    return EXIT_PASSED


def collected(config: GradingConfig) -> list[Row]:
    """Every part's graded tests: from the cache if it holds this course's, else collected."""
    where = hashlib.sha256(str(config.path.resolve()).encode()).hexdigest()[:16]
    cached, digest = _cache_dir() / f"collected-{where}.json", _digest(config)
    try:
        kept = json.loads(cached.read_text())
        rows = [tuple(row) for row in kept["rows"]]
        if kept["digest"] == digest and all(_is_row(row) for row in rows):
            return rows  # type: ignore[return-value]
    except (OSError, ValueError, TypeError, KeyError):
        pass
    from grader.course.catalog import collect

    with interrupts.after():  # the tests' modules import torch
        tests = collect(config, list(config.parts))
    found = [(t.part, t.name, t.target, t.kind, t.world_size) for t in tests]
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        temporary = cached.with_name(f".{cached.name}.{os.getpid()}")
        temporary.write_text(json.dumps({"digest": digest, "rows": found}))
        os.replace(temporary, cached)
    except OSError:  # a read-only home lists as fast as before, no faster
        pass
    return found


def _is_row(row: tuple) -> bool:
    types = (str, str, str, str, int)
    return len(row) == len(types) and all(type(v) is t for v, t in zip(row, types, strict=True))


def _table(config: GradingConfig, part: str, rows: list[Row]) -> Table:
    table = Table(title=Text(part, style="bold"), title_justify="left")
    for column in ("test", "target", "kind", "world sizes", "points each", "visibility"):
        table.add_column(column)
    sizes: dict[str, list[int]] = {}
    first: dict[str, Row] = {}
    for row in rows:
        sizes.setdefault(row[1], []).append(row[4])
        first.setdefault(row[1], row)
    total = 0.0
    for name, (_, _, target, kind, _) in first.items():
        settings = config.part(part).settings_for(name.split("[")[0])
        total += settings.points * len(sizes[name])
        world_sizes = ", ".join(map(str, sizes[name]))
        points = f"{settings.points:g}"
        table.add_row(Text(name), Text(target), kind, world_sizes, points, settings.visibility)
    table.caption = f"{total:g} points in all"
    return table


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "grader"


def _digest(config: GradingConfig) -> str:
    """Of all a collection depends on (the module's docstring)."""
    digest = hashlib.sha256()
    for name in ("torch", "pytest"):
        try:
            digest.update(f"{name} {metadata.version(name)}\n".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name} absent\n".encode())
    digest.update(f"{sys.version}\n{config.path.resolve()}\n".encode())
    digest.update(config.path.read_bytes())
    sources = Path(grader.__file__).parent
    for root in (course.GRADED_DIR, sources):
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".yaml", ".ini", ".json") and path.is_file():
                digest.update(f"\0{path.relative_to(root)}\0".encode() + path.read_bytes())
    return digest.hexdigest()


def bench(console: Console, args: argparse.Namespace, modules: list[str]) -> int:
    """``grader bench``: sweep message and world sizes of the collectives."""
    other = [part for part in args.parts if part not in BENCHED]
    if other:
        raise UsageError(
            f"grader bench measures the {', '.join(BENCHED)} part only, not {', '.join(other)}"
        )
    submission = resolve(args.submission, modules)
    world_sizes, iterations = args.world_sizes or [2, 4], max(1, args.iterations)
    console.print(
        f"Benchmarking the collectives of {submission} at world sizes "
        f"{', '.join(map(str, world_sizes))}, up to {args.max_bytes} bytes",
        highlight=False,
    )
    with interrupts.after():  # torch's import
        from grader.bench.runner import DEFAULT_SIZES, plot, print_tables, run_bench
        from grader.testkit.calls import COLLECTIVES

    functions = [f for f in COLLECTIVES if args.keyword is None or args.keyword in f]
    if not functions:
        raise UsageError(f"no collective matches -k {args.keyword}")
    sizes = [s for s in DEFAULT_SIZES if s <= args.max_bytes] or [args.max_bytes]
    try:
        results = run_bench(console, submission, functions, world_sizes, sizes, iterations)
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]: every worker was stopped")
        return EXIT_INTERRUPTED
    print_tables(console, results)
    if any(r.records for r in results):
        console.print(f"bus bandwidth plotted in {plot(results, args.output)}", highlight=False)
    return EXIT_PASSED if not any(r.problem for r in results) else EXIT_FAILED
