"""``grader batch``: a folder of submissions graded into one gradebook (CONTRACT section 3).

Each student is graded by a ``grader run`` of its own, in a session of its own: a
submission that hangs, crashes the grader or fills the log costs its own row and
nothing else, and can be killed whole. Results are promoted to ``results.json``
only once that run has ended with a verdict, so a file that exists is complete and
a rerun of the same command grades exactly the students still missing: an
interrupted batch, a preempted SLURM task or a failed CI job is finished by running
it again. Shards split the sorted students by index modulo N, so that
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

import contextlib
import csv
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grader.launch import orphans
from grader.launch.job import descendants
from grader.protocol import clean
from grader.report import gradebook
from grader.report.gradebook import from_cell

GRADEBOOK, FAILURES, SETTINGS = "gradebook.csv", "failures.txt", "batch.json"
REPORT = "report.html"  # the class at a glance (grader.report.classreport)
RESULTS, PARTIAL, LOG = "results.json", ".results.partial.json", "grader.log"
RANKS_PER_RUN = 4  # the largest world size a grader run launches
GRACE_SECONDS = 3  # how long a stopped grader gets to end its own jobs before SIGKILL
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

    try:
        _grade(batch, todo, failures, books)
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


def _grade(
    batch: Batch, todo: list[str], failures: dict[str, str], after_each: Callable[[], None]
) -> None:
    """Keep ``jobs`` gradings running until none is left; stop them all if interrupted.

    One event queue: a thread per grading waits for its process and puts it there when it
    ends; between ends the loop sleeps until the oldest grading's deadline, and stops it then.
    Each student's end is told on a line of its own: "[k/N]", and the time left at the pace
    so far.
    """
    pending, running = list(todo), list[_Running]()
    progress = _Progress(len(todo), time.monotonic())
    ended: queue.Queue[_Running] = queue.Queue()
    try:
        while pending or running:
            while pending and len(running) < batch.jobs:
                run = _start(batch, pending.pop(0))
                running.append(run)
                threading.Thread(target=_report_end, args=(run, ended), daemon=True).start()
            oldest = min(running, key=lambda r: r.started)
            try:
                run, timed_out = ended.get(timeout=_left(batch, oldest)), False
            except queue.Empty:
                run, timed_out = oldest, True
            if run not in running:  # stopped at its deadline, and handled then
                continue
            running.remove(run)
            status = _stop([run.process])[0] if timed_out else run.process.wait()
            orphans.end()  # what a grader stopped by SIGKILL left, handed to the batch
            why = _finish(batch, run, status, timed_out, progress.step())
            if why is not None:
                failures[run.student] = why
                log = shown(str(folder_of(batch.out, run.student) / LOG))
                print(f"grader batch: {shown(run.student)}: {why}; see {log}", file=sys.stderr)
            after_each()
    finally:
        _stop([run.process for run in running])


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


def _report_end(run: _Running, ended: queue.Queue[_Running]) -> None:
    run.process.wait()
    ended.put(run)


def _left(batch: Batch, run: _Running) -> float:
    """Seconds until ``run`` reaches the per-student limit (--timeout)."""
    return max(0.0, run.started + batch.timeout - time.monotonic())


def _start(batch: Batch, student: str) -> _Running:
    folder = folder_of(batch.out, student)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in (folder / RESULTS, folder / PARTIAL):
        stale.unlink(missing_ok=True)
    command = [sys.executable, "-m", "grader", *batch.grader_args, "run", *batch.run_args]
    command += [
        "--submission",
        str(batch.submissions / student),
        "--results",
        str(folder / PARTIAL),
    ]
    with open(folder / LOG, "w") as log:
        process = orphans.start(  # its own child: never taken for an orphan of a killed job
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1", "COLUMNS": "120"},
            start_new_session=True,
        )
    return _Running(student, process, time.monotonic())


def _finish(
    batch: Batch, run: _Running, status: int, timed_out: bool, step: str = ""
) -> str | None:
    """Promote a finished run's results atomically; why the student has no row, or None."""
    folder = folder_of(batch.out, run.student)
    partial, seconds = folder / PARTIAL, time.monotonic() - run.started
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
    print(f"{step} {shown(run.student)}: {points}".lstrip(), flush=True)
    return None


def _stop(processes: list[subprocess.Popen]) -> list[int]:
    """SIGTERM (a grader stops its own jobs, as on Ctrl-C), then SIGKILL all that is left.

    All are signalled first, so that stopping many takes one grace period, not many.
    """
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        if process.poll() is None:
            for pid in [*descendants(process.pid), process.pid]:  # workers: own sessions
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
    return [process.wait() for process in processes]


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
