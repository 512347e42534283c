"""How long grading takes, against the cheapest real distributed job, measured side by side.

    python benchmarks/grading_time.py [--repeats 3] [--loop-only] [--editing 10]

The yardstick is a ``torchrun --standalone`` job that only initialises a gloo
process group, passes one barrier and destroys it: the least any
multi-process grading can cost on this machine. First a student's loop, beside
a 3-rank yardstick:

- a cold ``grader run collectives -k all_reduce --world-size 3``;
- the same in watch mode (``--watch``): the seconds from saving an edit of
  the submission to the end of its summary, the edit made ``--editing``
  seconds (10) after the last summary, as a student edits.

Then (not with ``--loop-only``), beside a 4-rank yardstick, each timed as a
whole command, with its peak memory:

- the reference, every part (every point expected);
- the untouched stubs, every part (no point expected);
- a submission whose every collective deadlocks, the collectives part.

Prints each wall time and its ratio to its yardstick (medians of --repeats), the
CPU time of the whole process tree and the least wall time it allows on this
machine's cores (where a ratio cannot go, however the grader waits), and the
peak memory of the whole process tree (what a container must allow).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "selftests")]

BARRIER_JOB = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


MEMORY_EVERY = 1.0  # seconds between two samples: a sample reads a few ms per process
CPU_EVERY = 0.05  # seconds between two readings of every process's CPU time
TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/<pid>/stat's times

# Every command runs this checkout's grader, installed or not.
ENVIRONMENT = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
}


class Measured(NamedTuple):
    """One run of a command: its wall seconds, the peak memory of its whole process tree
    (MB), and the CPU seconds its whole process tree used."""

    seconds: float
    peak_mb: float
    cpu: float


def timed(command: list[str], cwd: Path, status: int = 0) -> Measured:
    """Run ``command`` and measure it. The peak memory is sampled every
    :data:`MEMORY_EVERY` s (what a container's memory limit must allow): each process counts
    its proportional set (``Pss``: a page shared by n processes counts 1/n in each), as a
    container's limit counts each page once; its resident set where that cannot be read. The
    CPU is every process's own (all its threads), read every :data:`CPU_EVERY` s while it
    lives: what a process used after its last reading is missed, so the figure is a floor.
    A command that ends with another exit status than ``status`` measured nothing: the
    benchmark stops with its last lines."""
    from grader.launch.job import descendants

    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=cwd, env=ENVIRONMENT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True)
    reader.start()
    peak, sampled = 0, 0.0
    cpu: dict[tuple[int, int], float] = {}  # by (pid, start time): a pid may be reused
    while process.poll() is None:
        tree = [process.pid, *descendants(process.pid)]
        for pid in tree:
            reading = _cpu(pid)
            if reading is not None:
                cpu[(pid, reading[0])] = reading[1]
        if time.monotonic() - sampled >= MEMORY_EVERY:
            sampled = time.monotonic()
            peak = max(peak, sum(_memory(pid) for pid in tree))
        time.sleep(CPU_EVERY)
    seconds = time.monotonic() - start
    reader.join()
    if process.returncode != status:
        sys.exit(
            f"{shlex.join(command)} exited {process.returncode}, not {status}:\n"
            + "".join(errors[-5:])
        )
    return Measured(seconds, peak / 2**20, sum(cpu.values()))


def _cpu(pid: int) -> tuple[int, float] | None:
    """``pid``'s start time (clock ticks) and the CPU seconds it used so far, every thread's
    (not its children's: each is read as a process of its own); None once it has ended."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the name: state is field 0, utime 11, stime 12, starttime 19 (proc(5), from 3).
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS


def _memory(pid: int) -> int:
    """Bytes of ``pid``'s proportional set, or of its resident set; 0 once it has ended."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def watch_regrades(command: list[str], source: Path, edits: int, editing: float) -> list[float]:
    """Seconds from each save of ``source`` to the end of the summary it causes, in
    ``grader run --watch`` (``command``)."""
    process = subprocess.Popen(
        command, cwd=REPO, env=ENVIRONMENT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    lines: queue.Queue[tuple[float, str]] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put((time.monotonic(), line))

    def summary_done() -> float:
        while True:
            at, line = lines.get(timeout=300)
            if "watching" in line:
                return at

    threading.Thread(target=read, daemon=True).start()
    seconds = []
    try:
        summary_done()  # the first grading: cold
        for i in range(edits):
            time.sleep(editing)  # the student edits; the next grading's ranks start meanwhile
            saved = time.monotonic()
            source.write_text(source.read_text() + f"\n# edit {i}\n")
            seconds.append(summary_done() - saved)
    finally:
        # SIGTERM, which the grader takes as Ctrl-C: a benchmark started in the background
        # (`python benchmarks/grading_time.py &`) passes SIGINT on ignored.
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    return seconds


def barrier_job(work: Path, ranks: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", f"--log-dir={work / f'logs{ranks}'}", str(work / "barrier.py"),
    ]  # fmt: skip


def print_ratios(
    medians: dict[str, float], cpus: dict[str, float], peaks: dict[str, float]
) -> None:
    """Each command's wall time and its ratio to the first (the yardstick); its CPU, and the
    least wall time that CPU allows on this machine's cores, kept busy all along (no command
    can be faster than its CPU spread over every core); its peak memory."""
    yardstick = next(iter(medians.values()))
    cores = len(os.sched_getaffinity(0))
    for label, seconds in medians.items():
        line = f"{label:<60} {seconds:6.2f} s {seconds / yardstick:5.2f}x"
        if label in cpus:
            least = cpus[label] / cores
            line += f"  CPU {cpus[label]:6.1f} s: at least {least:5.2f} s on {cores} cores"
            line += f" ({least / yardstick:5.2f}x)"
        if label in peaks:
            line += f"  peak {peaks[label]:6.0f} MB"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop-only", action="store_true", help="only a student's loop")
    parser.add_argument(
        "--editing", type=float, default=10.0, help="seconds between two saves in watch mode"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "barrier.py").write_text(BARRIER_JOB)
        grader = [
            sys.executable,
            "-m",
            "grader",
            "--config",
            str(REPO / "tests/graded/grading.yaml"),
        ]
        submission = work / "student"
        submission.mkdir()
        source = submission / "collectives.py"
        source.write_text((REPO / "reference" / "collectives.py").read_text())
        one = [*grader, "run", "collectives", "-k", "all_reduce", "--world-size", "3"]
        one += ["--submission", str(submission)]
        loop = {
            "torchrun: 3 ranks, init + barrier + destroy": barrier_job(work, 3),
            "grader run collectives -k all_reduce --world-size 3": one,
        }
        medians, cpus, peaks = {}, {}, {}
        for label, command in loop.items():
            measured = [timed(command, work) for _ in range(args.repeats)]
            medians[label] = statistics.median(m.seconds for m in measured)
            cpus[label] = statistics.median(m.cpu for m in measured)
        regrades = watch_regrades([*one, "--watch"], source, args.repeats * 2, args.editing)
        label = f"the same, --watch: a save ({args.editing:g} s after the last) to its summary"
        medians[label] = statistics.median(regrades)
        print_ratios(medians, cpus, peaks)
        print("watch mode, each regrade:", " ".join(f"{s:.2f}" for s in regrades), "s")
        if not args.loop_only:
            whole_runs(grader, work, args.repeats)


def whole_runs(grader: list[str], work: Path, repeats: int) -> None:
    """Whole gradings (every part of the reference, of the stubs, a collective that deadlocks),
    each ``repeats`` times, and a torchrun job of 4 ranks that only starts and ends (the
    yardstick)."""
    from runner import materialize

    deadlocks = materialize("coll_deadlock_all", work)
    runs = {  # each command and the exit status it must end with
        "torchrun: 4 ranks, init + barrier + destroy": (barrier_job(work, 4), 0),
        "grader run --submission reference (all parts)": ([
            *grader, "run", "--submission", str(REPO / "reference"),
            "--results", str(work / "reference.json"),
        ], 0),
        "grader run, the untouched stubs (all parts)": ([
            *grader, "run", "--submission", str(REPO / "assignments"),
            "--results", str(work / "stubs.json"),
        ], 1),
        "grader run collectives, every collective deadlocks": ([
            *grader, "run", "collectives", "--submission", str(deadlocks),
            "--results", str(work / "deadlocks.json"),
        ], 1),
    }  # fmt: skip
    medians, cpus, peaks = {}, {}, {}
    for label, (command, status) in runs.items():
        measured = [timed(command, work, status) for _ in range(repeats)]
        medians[label] = statistics.median(m.seconds for m in measured)
        cpus[label] = statistics.median(m.cpu for m in measured)
        peaks[label] = max(m.peak_mb for m in measured)
    print_ratios(medians, cpus, peaks)
    for name in ("reference", "stubs", "deadlocks"):
        results = json.loads((work / f"{name}.json").read_text())
        maximum = sum(t["max_score"] for t in results["tests"])
        print(f"{name}: {results['score']:g} / {maximum:g} points, {len(results['tests'])} tests")


if __name__ == "__main__":
    main()
