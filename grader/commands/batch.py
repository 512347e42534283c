"""``grader batch``: a folder of submissions graded into one gradebook (CONTRACT section 3).

Each student is graded as a ``grader run`` of its own would grade it, by one of the batch's
workers (:mod:`grader.commands.pool`): a submission that hangs, crashes the grader or
fills the log costs its own row and nothing else, and can be killed whole. Results are
promoted to ``results.json`` only once that grading has ended with a verdict, so a file
that exists is complete and a rerun of the same command grades exactly the students still
missing: an interrupted batch, a preempted SLURM task or a failed CI job is finished by
running it again. Shards split the sorted students by index modulo N, so that
``sbatch --array`` tasks or CI matrix jobs need no shared state, and ``--merge``
joins their outputs.

A student's name is a folder name, which anyone can choose: it is shown only
encoded for what shows it. Each student's folder in the output is
:func:`folder_of` its name, never one of the batch's own files; a gradebook
cell that a spreadsheet would run as a formula starts with a quote (OWASP's
advice on CSV injection, undone by ``--merge``); and the terminal and
failures.txt get it without control characters.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grader.commands import listing, pool
from grader.commands.options import UsageError
from grader.course.config import GradingConfig
from grader.protocol import clean
from grader.report import gradebook
from grader.report.gradebook import from_cell

GRADEBOOK, FAILURES, SETTINGS = "gradebook.csv", "failures.txt", "batch.json"
REPORT = "report.html"  # the class at a glance (grader.report.classreport)
RESULTS, PARTIAL, LOG = "results.json", ".results.partial.json", "grader.log"
RANKS_PER_RUN = 4  # the largest world size a grader run launches
EXIT_COMPLETE, EXIT_INCOMPLETE, EXIT_INTERRUPTED = 0, 1, 130


_OWN = (GRADEBOOK, FAILURES, SETTINGS, REPORT)  # what the batch writes beside the students' folders
_ESCAPE = "~"


class BatchError(Exception):
    """The batch cannot start at all; the message is one line for the user."""


@dataclass(frozen=True)
class Batch:
    """One ``grader batch`` invocation: which students, where to, and how each is graded."""

    submissions: Path
    out: Path
    parts: list[str]  # the gradebook's part columns
    run_args: list[str]  # appended to every ``grader run``: the selection, passed through
    grader_args: list[str]  # put before ``run``, e.g. a non-default --config
    jobs: int = 1
    shard: tuple[int, int] = (0, 1)
    timeout: float = 1800.0


@dataclass
class _Running:
    student: str
    process: subprocess.Popen
    started: float


def command(args: argparse.Namespace, config: GradingConfig, parts: list[str]) -> int:
    """``grader batch``: check the whole selection once, here, rather than fail it once per
    student; then grade, or merge."""
    if args.merge:
        if args.submissions is not None or args.parts or args.shard:
            raise UsageError("--merge takes only shard folders and --out")
        return merge(args.merge, args.out)
    if args.submissions is None:
        raise UsageError("grader batch needs SUBMISSIONS_DIR (or --merge DIR ...)")
    shard = parse_shard(args.shard or "0/1")
    if not args.submissions.is_dir():
        raise UsageError(f"no such directory: {args.submissions}")
    if not any(
        part in parts
        and (args.keyword is None or args.keyword in name)
        and (not args.world_sizes or size in args.world_sizes)
        for part, name, _, _, size in listing.collected(config)
    ):
        raise UsageError("no graded test matches the selection (-k / --world-size)")
    run_args = [*args.parts, *(["-k", args.keyword] if args.keyword else [])]
    run_args += [f"--world-size={n}" for n in args.world_sizes or []]
    run_args += [f"--sandbox={args.sandbox}"] if args.sandbox != "auto" else []
    grader_args = ["--config", str(config.path.resolve())]  # every student graded by this course
    batch = Batch(
        args.submissions,
        args.out,
        parts,
        run_args,
        grader_args,
        jobs=usable_jobs(args.jobs),
        shard=shard,
        timeout=args.timeout,
    )
    return run_batch(batch)


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` with 0 <= I < N, 0-based as ``sbatch --array=0-(N-1)`` and CI matrices count."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise BatchError(f"--shard must be I/N with 0 <= I < N (e.g. 0/3), got {text!r}")
    return int(index), int(count)


def usable_jobs(requested: int) -> int:
    """At most one grading per two CPUs: each runs up to four ranks, and starved ranks time out."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cap = max(1, (cpus or 1) // 2)
    if requested > cap:
        print(
            f"grader batch: --jobs {requested} capped at {cap}: each grading runs up to "
            f"{RANKS_PER_RUN} rank processes and {cpus} CPUs are usable here",
            file=sys.stderr,
        )
    return max(1, min(requested, cap))


def students(batch: Batch) -> list[str]:
    """This shard's students: the sorted folder names whose index is I modulo N."""
    if not batch.submissions.is_dir():
        raise BatchError(f"no such directory: {batch.submissions}")
    out = batch.out.resolve()
    names = sorted(
        p.name
        for p in batch.submissions.iterdir()
        if p.is_dir() and not p.name.startswith(".") and p.resolve() != out
    )
    if not names:
        raise BatchError(f"no student folders in {batch.submissions}")
    index, count = batch.shard
    return [name for i, name in enumerate(names) if i % count == index]


def folder_of(out: Path, student: str) -> Path:
    """The student's folder in ``out``: the name itself, unless it is one of the batch's own
    files (in any case: macOS's disks ignore it) or ends with the escape, which then gets
    one more (one folder per name, always)."""
    own = student.casefold() in _OWN or student.endswith(_ESCAPE)
    return out / (student + _ESCAPE if own else student)


def shown(student: str) -> str:
    """The name as the terminal and failures.txt show it: no control characters."""
    return clean(student, 200)


def complete_results(path: Path) -> dict[str, Any] | None:
    """The results in ``path`` if it is a whole results.json, else None."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(results, dict) and isinstance(results.get("tests"), list)
    return results if ok and isinstance(results.get("score"), (int, float)) else None


def run_batch(batch: Batch) -> int:
    """Grade every student of the shard not graded yet; write the gradebook whatever happens."""
    names = students(batch)
    _check_settings(batch)
    todo = [s for s in names if complete_results(folder_of(batch.out, s) / RESULTS) is None]
    for skipped in sorted(set(names) - set(todo)):
        print(f"{shown(skipped)}: already graded, skipped", flush=True)
    failures: dict[str, str] = {}
    interrupted = False

    def books() -> None:  # after each student: an interrupted batch leaves a usable gradebook
        rows = [_row(batch.out, s, batch.parts) for s in names]
        _write_csv(batch.out / GRADEBOOK, batch.parts, rows)
        said = "".join(f"{shown(s)}: {why}\n" for s, why in failures.items())
        _write_text(batch.out / FAILURES, said)
        write_report(batch.out, names)

    progress = _Progress(len(todo), time.monotonic())

    def finish(student: pool.Student, seconds: float, status: int, timed_out: bool) -> None:
        why = _finish(batch, student.name, seconds, status, timed_out, progress.step())
        if why is not None:
            failures[student.name] = why
            log = shown(str(student.log))
            print(f"grader batch: {shown(student.name)}: {why}; see {log}", file=sys.stderr)
        books()

    command = pool.worker_command(batch.grader_args, batch.run_args)
    try:
        pool.grade_all(
            command, [_student(batch, s) for s in todo], batch.jobs, batch.timeout, finish
        )
    except KeyboardInterrupt:
        interrupted = True
    books()
    missing = [s for s in names if complete_results(folder_of(batch.out, s) / RESULTS) is None]
    print(
        f"gradebook: {batch.out / GRADEBOOK} ({len(names) - len(missing)} of {len(names)} graded)"
    )
    if interrupted:
        print("grader batch: interrupted; the same command grades the rest", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_INCOMPLETE if missing else EXIT_COMPLETE


def _student(batch: Batch, name: str) -> pool.Student:
    """The student's folder in the output, made and emptied of a half-written result."""
    folder = folder_of(batch.out, name)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (folder / RESULTS, folder / PARTIAL):
        stale.unlink(missing_ok=True)
    return pool.Student(name, batch.submissions / name, folder / PARTIAL, folder / LOG)


def _check_settings(batch: Batch) -> None:
    """Refuse to resume into a folder graded with another selection: its rows would not compare."""
    settings = {"parts": batch.parts, "run_args": batch.run_args, "grader_args": batch.grader_args}
    path = batch.out / SETTINGS
    if path.exists():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = None
        if earlier != settings:
            raise BatchError(
                f"{batch.out} holds grades of another selection ({path}); use new --out"
            )
    else:
        _write_text(path, json.dumps(settings, indent=2) + "\n")


@dataclass
class _Progress:
    """How far a batch is: "[k/N]" and, at the pace so far, the time left."""

    total: int
    began: float
    done: int = 0

    def step(self) -> str:
        self.done += 1
        spent = time.monotonic() - self.began
        left = spent / self.done * (self.total - self.done)
        eta = f", about {left / 60:.0f} min left" if self.done < self.total else ""
        return f"[{self.done}/{self.total}{eta}]"


def _finish(
    batch: Batch, student: str, seconds: float, status: int, timed_out: bool, step: str = ""
) -> str | None:
    """Promote a finished grading's results atomically; why the student has no row, or None."""
    folder = folder_of(batch.out, student)
    partial = folder / PARTIAL
    results = complete_results(partial) if status in (0, 1) and not timed_out else None
    if results is None:
        partial.unlink(missing_ok=True)
        if timed_out:
            return f"stopped after {seconds:.0f} s, the per-student limit (--timeout)"
        if status in (0, 1):
            return f"the grader ended with status {status} but wrote no results.json"
        last = clean(_last_line(folder / LOG), 300)
        return f"the grader could not grade it (exit status {status}): {last}"
    partial.chmod(0o644)  # CONTRACT section 3: results files are 0644
    os.replace(partial, folder / RESULTS)
    maximum = sum(t.get("max_score", 0) for t in results["tests"])
    points = f"{results['score']:g} / {maximum:g} points ({seconds:.0f} s)"
    print(f"{step} {shown(student)}: {points}".lstrip(), flush=True)
    return None


def _last_line(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        return "no log"
    return next((line for line in reversed(lines) if line), "no output")


def _row(out: Path, student: str, parts: list[str]) -> list[str]:
    """A gradebook row: total and each part's points, or empty cells if not graded."""
    return gradebook.row(student, complete_results(folder_of(out, student) / RESULTS), parts)


def merge(shards: list[Path], out: Path) -> int:
    """Join shards' folders, gradebooks and failures into ``out``; a student twice is an error."""
    header: list[str] | None = None
    rows: dict[str, tuple[Path, list[str]]] = {}
    settings: set[str] = set()
    for shard in shards:
        book = shard / GRADEBOOK
        if not book.is_file():
            raise BatchError(f"{shard} has no {GRADEBOOK}: did that shard run to its end?")
        with book.open(newline="") as f:
            lines = [[from_cell(cell) for cell in line] for line in csv.reader(f)]
        if not lines or lines[0][:2] != ["student", "total"]:
            raise BatchError(f"{book} is not a gradebook (its first line is not student,total,...)")
        head, *body = lines
        if header is not None and head != header:
            raise BatchError(f"{book} has other columns than the first shard's: {','.join(head)}")
        header = head
        settings.add((shard / SETTINGS).read_text() if (shard / SETTINGS).is_file() else "")
        for row in body:
            if row[0] in rows:
                raise BatchError(
                    f"student {shown(row[0])} is in two shards: {rows[row[0]][0]} and {shard}"
                )
            rows[row[0]] = (shard, row)
    if len(settings) > 1:
        raise BatchError("the shards were graded with different selections (see their batch.json)")
    assert header is not None  # argparse requires at least one shard
    for student, (shard, _) in rows.items():
        folder = folder_of(shard, student)
        if folder.is_dir() and shard.resolve() != out.resolve():
            shutil.copytree(folder, folder_of(out, student), dirs_exist_ok=True)
    failures = [(s / FAILURES).read_text() for s in shards if (s / FAILURES).is_file()]
    _write_text(out / FAILURES, "".join(failures))
    if settings != {""}:
        _write_text(out / SETTINGS, settings.pop())
    _write_csv(out / GRADEBOOK, header[2:], [rows[s][1] for s in sorted(rows)])
    write_report(out, sorted(rows))
    missing = sum(1 for _, row in rows.values() if row[1] == "")
    print(f"gradebook: {out / GRADEBOOK} ({len(rows) - missing} of {len(rows)} graded)")
    return EXIT_INCOMPLETE if missing else EXIT_COMPLETE


def write_report(out: Path, names: list[str]) -> None:
    """``report.html``: the class at a glance, from every complete results.json."""
    from grader.report import classreport

    found = {s: complete_results(folder_of(out, s) / RESULTS) for s in names}
    _write_text(out / REPORT, classreport.render({s: r for s, r in found.items() if r}))


def _write_csv(path: Path, parts: list[str], rows: list[list[str]]) -> None:
    _write_text(path, gradebook.text(parts, rows))


def _write_text(path: Path, text: str) -> None:
    """Write atomically: a reader (or a resumed batch) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
