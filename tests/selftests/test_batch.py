"""`grader batch`: a class graded into a gradebook, resumed, sharded, merged, and run by SLURM.

Three students, graded on a tiny selection so that the whole file stays fast:
alice submits the reference, bob the untouched stub, carol a module with a syntax error
(graded without a launch: the cheapest way to a third, different row).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm
from runner import REPO, run_grader

SELECTION = ["collectives", "-k", "broadcast", "--world-size", "2"]
EXPECTED = [
    ["student", "total", "collectives"],
    ["alice", "2", "2"],
    ["bob", "0", "0"],
    ["carol", "0", "0"],
]


def gradebook(out: Path) -> list[list[str]]:
    with (out / "gradebook.csv").open(newline="") as f:
        return list(csv.reader(f))


def batch(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_grader(["batch", *map(str, args)], timeout=timeout)


@pytest.fixture(scope="module")
def submissions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("submissions")
    for student, source in (("alice", "reference"), ("bob", "assignments")):
        (root / student).mkdir()
        shutil.copy(REPO / source / "collectives.py", root / student)
    (root / "carol").mkdir()
    (root / "carol" / "collectives.py").write_text("def broadcast(tensor, src)\n    pass\n")
    return root


@pytest.fixture(scope="module")
def graded(submissions: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The class graded on one machine, with more jobs asked for than two CPUs allow."""
    out = tmp_path_factory.mktemp("graded")
    done = batch(submissions, "--out", out, "--jobs", "8", *SELECTION)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--jobs 8 capped at" in done.stderr
    return out


def copy_of(graded: Path, to: Path, students: tuple[str, ...] = ("alice", "bob", "carol")) -> Path:
    """An output folder as if these students had been graded already (with the same selection)."""
    to.mkdir()
    shutil.copy(graded / "batch.json", to)
    for student in students:
        shutil.copytree(graded / student, to / student)
    return to


def test_every_student_gets_a_row_and_a_folder(graded: Path):
    assert gradebook(graded) == EXPECTED
    assert (graded / "batch.json").is_file()
    for student in ("alice", "bob", "carol"):
        assert (graded / student / "results.json").is_file()
        assert "Grading" in (graded / student / "grader.log").read_text()
    assert not list(graded.glob("*/.results*"))
    assert (graded / "failures.txt").read_text() == ""


def test_a_rerun_grades_only_the_students_without_results(
    submissions: Path, graded: Path, tmp_path: Path
):
    out = copy_of(graded, tmp_path / "out")
    (out / "carol" / "results.json").unlink()
    before = {s: (out / s / "results.json").stat().st_mtime_ns for s in ("alice", "bob")}
    done = batch(submissions, "--out", out, *SELECTION)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "alice: already graded, skipped" in done.stdout
    assert "bob: already graded, skipped" in done.stdout
    assert "carol: 0 / 2 points" in done.stdout
    after = {s: (out / s / "results.json").stat().st_mtime_ns for s in ("alice", "bob")}
    assert after == before
    assert gradebook(out) == EXPECTED


def test_shards_split_by_index_and_merge_into_the_same_gradebook(
    submissions: Path, graded: Path, tmp_path: Path
):
    """Shard folders that hold every student already: a shard lists only its own students."""
    shards = [copy_of(graded, tmp_path / f"shard-{i}") for i in range(2)]
    for i, shard in enumerate(shards):
        done = batch(submissions, "--out", shard, "--shard", f"{i}/2", *SELECTION)
        assert done.returncode == 0, done.stdout + done.stderr
    assert [row[0] for row in gradebook(shards[0])[1:]] == ["alice", "carol"]
    assert [row[0] for row in gradebook(shards[1])[1:]] == ["bob"]

    merged = tmp_path / "merged"
    done = batch("--merge", *shards, "--out", merged)
    assert done.returncode == 0, done.stdout + done.stderr
    assert gradebook(merged) == gradebook(graded)
    assert all((merged / s / "results.json").is_file() for s in ("alice", "bob", "carol"))

    done = batch("--merge", shards[0], shards[0], "--out", tmp_path / "twice")
    assert done.returncode == 2
    assert done.stderr.startswith("grader: error: student alice is in two shards")
    assert len(done.stderr.splitlines()) == 1


def test_a_student_that_hangs_costs_only_its_own_row(
    submissions: Path, graded: Path, tmp_path: Path
):
    """alice is graded already; dora's import never returns.

    Stopped (SIGTERM, as SLURM and CI stop a job) while grading dora, the batch ends
    everything it started and keeps alice; run again with a per-student limit, dora
    alone fails.
    """
    others = tmp_path / "submissions"
    shutil.copytree(submissions / "alice", others / "alice")
    (others / "dora").mkdir()
    (others / "dora" / "collectives.py").write_text("import time\n\ntime.sleep(600)\n")
    out = copy_of(graded, tmp_path / "out", ("alice",))
    args = ["batch", others, "--out", out, *SELECTION]
    process = subprocess.Popen(
        [sys.executable, "-m", "grader", *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        log, deadline = out / "dora" / "grader.log", time.monotonic() + 120
        while "Grading" not in (log.read_text() if log.exists() else ""):
            assert process.poll() is None and time.monotonic() < deadline, "dora never started"
            time.sleep(0.2)
        time.sleep(2)  # into the launch of dora's ranks
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stderr
    assert not _processes_mentioning(str(others))
    assert gradebook(out) == [EXPECTED[0], EXPECTED[1], ["dora", "", ""]]
    assert (out / "failures.txt").read_text() == ""

    done = batch(others, "--out", out, "--timeout", "4", *SELECTION)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "alice: already graded, skipped" in done.stdout
    assert done.stderr.startswith("grader batch: dora: stopped after"), done.stderr
    stopped_after = int(done.stderr.split("stopped after ")[1].split(" s")[0])
    assert stopped_after <= 4 + 3 + 1  # the limit, honoured within the grader's grace
    assert len(done.stderr.splitlines()) == 1
    assert gradebook(out) == [EXPECTED[0], EXPECTED[1], ["dora", "", ""]]
    assert (out / "failures.txt").read_text().startswith("dora: stopped after")
    assert not (out / "dora" / "results.json").exists()
    assert not _processes_mentioning(str(others))


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            found.append(command)
    return found


HYPERLINK = '=HYPERLINK("grades.example","open me")'
ESCAPES = "dave\x1b[2J\x1b]0;owned\x07"  # clears the screen, retitles the terminal
NAMES = ("gradebook.csv", HYPERLINK, ESCAPES, "batch.json~", "failures.txt")


def test_names_a_student_chose_cannot_break_the_batch_nor_what_a_ta_opens(tmp_path: Path):
    """Folders named as the batch's own files, as a formula and with escape codes: each is
    graded into a folder of its own, the gradebook shows each name as text, the terminal
    gets no control character, and a rerun and a merge still work."""
    root = tmp_path / "submissions"
    for name in NAMES:
        (root / name).mkdir(parents=True)
        (root / name / "collectives.py").write_text("def broadcast(tensor, src)\n    pass\n")
    shutil.copy(REPO / "reference" / "collectives.py", root / "gradebook.csv")
    out = tmp_path / "out"
    done = batch(root, "--out", out, *SELECTION)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not any(ch in done.stdout + done.stderr for ch in "\x1b\x07")
    assert "dave]0;owned: 0 / 2 points" in done.stdout
    rows = {"gradebook.csv": ["2", "2"]}
    expected = [[name, *rows.get(name, ["0", "0"])] for name in sorted(NAMES)]
    assert gradebook(out)[1:] == [["'" + HYPERLINK, "0", "0"], *expected[1:]]
    assert gradebook(out)[1][0] == "'" + HYPERLINK  # a spreadsheet shows it, never runs it
    folders = {"gradebook.csv": "gradebook.csv~", "batch.json~": "batch.json~~"}
    folders["failures.txt"] = "failures.txt~"
    for name in NAMES:
        assert (out / folders.get(name, name) / "results.json").is_file(), name
    assert (out / "gradebook.csv").is_file() and (out / "failures.txt").read_text() == ""

    again = batch(root, "--out", out, *SELECTION)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("already graded, skipped") == len(NAMES)
    merged = tmp_path / "merged"
    assert batch("--merge", out, "--out", merged).returncode == 0
    assert gradebook(merged) == gradebook(out)
    assert (merged / "gradebook.csv~" / "results.json").is_file()


def test_no_student_folder_is_a_file_of_the_batch_and_no_two_students_share_one():
    from grader.commands.batch import FAILURES, GRADEBOOK, SETTINGS, folder_of

    names = ["alice", "gradebook.csv", "Gradebook.CSV", "gradebook.csv~", "gradebook.csv~~"]
    names += ["batch.json", "FAILURES.TXT", "bob~", "bob"]
    folders = [folder_of(Path("out"), name).name for name in names]
    assert len(set(folders)) == len(names)
    assert not {f.casefold() for f in folders} & {GRADEBOOK, FAILURES, SETTINGS}
    assert folder_of(Path("out"), "alice") == Path("out/alice")  # CONTRACT: OUT/<student>/


@pytest.mark.parametrize(
    "text", ["=1+1", "+1", "-1", "@SUM(A1)", "\tx", "\rx", "'=1", "''", "'", "alice", "", "a=b"]
)
def test_a_gradebook_cell_runs_nothing_and_reads_back_as_it_was(text: str):
    from grader.report.gradebook import from_cell, to_cell

    cell = to_cell(text)
    assert not cell.startswith(("=", "+", "-", "@", "\t", "\r"))
    assert from_cell(cell) == text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/dir", "--out", "x"], "grader: error: no such directory: /no/such/dir"),
        ([".", "--out", "x", "--shard", "2/2"], "grader: error: --shard must be I/N"),
        (["--merge", "/no/such/shard", "--out", "x"], "grader: error: /no/such/shard has no"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_status_2(args: list[str], message: str):
    done = batch(*args, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith(message), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A single-node SLURM for this session; every daemon and job step gone afterwards."""
    if why := slurm.available():
        pytest.skip(f"SLURM: {why} (.ci/run installs slurm-wlm and munge)")
    steps_before = slurm.stepd_pids()
    started = slurm.single_node_slurm(tmp_path_factory.mktemp("slurm"))
    with started as running:
        yield running
    assert all(p.poll() is not None for p in running.processes.values())
    assert slurm.stepd_pids() <= steps_before


@pytest.mark.slow
def test_the_sbatch_recipe_grades_like_one_machine(
    cluster: slurm.Cluster, submissions: Path, graded: Path, tmp_path: Path
):
    out = tmp_path / "out"
    env = {
        **cluster.env,
        "SUBMISSIONS": str(submissions),
        "OUT": str(out),
        "GRADER": f"{sys.executable} -m grader",
        "GRADER_ARGS": " ".join(SELECTION),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    # Two CPUs here: ask for one per task (the recipe's 4 would never be scheduled).
    command = ["sbatch", "--wait", "--array=0-2", "--cpus-per-task=1", "--mem=2G"]
    command += [f"--output={tmp_path}/task-%a.out", "deploy/slurm/grade-array.sbatch"]
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("task-*.out")))
    assert done.returncode == 0, done.stdout + done.stderr + logs + cluster.logs()
    for i, student in enumerate(("alice", "bob", "carol")):
        assert [row[0] for row in gradebook(out / f"shard-{i}")[1:]] == [student]
    merged = batch("--merge", *sorted(out.glob("shard-*")), "--out", out / "all")
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert gradebook(out / "all") == gradebook(graded)


def test_each_student_is_told_with_the_progress_and_the_level_passes_through(
    submissions: Path, tmp_path: Path
):
    """One line a student, "[k/N]" and the time left; --sandbox reaches every run; the
    gradebook is there after each student (an interrupted batch leaves one)."""
    from grader import sandbox

    level = sandbox.detect(sandbox.requested()).value
    out = tmp_path / "out"
    done = batch(submissions, "--out", out, "--sandbox", level, *SELECTION)
    assert done.returncode == 0, done.stdout + done.stderr
    told = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(told) == 3 and told[-1].startswith("[3/3] carol: 0 / 2 points"), told
    assert told[0].startswith("[1/3, about ") and " min left] alice: 2 / 2" in told[0], told
    for student in ("alice", "bob"):
        results = json.loads((out / student / "results.json").read_text())
        assert results["extra_data"]["sandbox"] == level
    assert gradebook(out) == EXPECTED


def test_the_class_report_shows_scores_pass_rates_and_causes(graded: Path, tmp_path: Path):
    """report.html beside the gradebook: a histogram of each part's scores, each test's pass
    rate, the most common causes with the students they hit (by the verdicts' machine
    causes), rendered by a real headless browser where one is installed."""
    page = (graded / "report.html").read_text()
    assert "<h1>The class at a glance: 3 students</h1>" in page and "<h2>collectives</h2>" in page
    assert 'class="histogram"' in page and 'broadcast (p=2)</td><td class="num">33%' in page
    causes = re.findall(r"<tr><td>(\w+)</td><td>([\w.]+)</td><td class=\"num\">(\d+)</td>"
                        r"<td>([^<]*)</td></tr>", page)  # fmt: skip
    assert ("not_implemented", "collectives.broadcast", "1", "bob") in causes, causes
    assert ("syntax_error", "collectives.broadcast", "1", "carol") in causes, causes
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no headless browser here (apt-get install chromium)")
    shot = tmp_path / "report.png"
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
               "--window-size=900,700", (graded / "report.html").as_uri()]  # fmt: skip
    subprocess.run(command, capture_output=True, timeout=120, check=True)
    dom = subprocess.run(
        [*command[:4], "--dump-dom", (graded / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "The class at a glance" in dom and dom.count("<tr>") >= 3 * 2
    assert shot.stat().st_size > 5000  # a page drawn, not a blank one
