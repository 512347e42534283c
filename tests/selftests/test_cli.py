"""The `grader` command as a user meets it: bad input, listing, and stopping it mid-run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner import (
    REPO,
    SUBMISSIONS,
    assert_all_ended,
    command_line,
    ends_with_the_tests,
    materialize,
    naming,
    process_owner,
    run_grader,
    start_grader,
)

from grader.launch.job import descendants


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "no_such_part"], "grader: error: unknown part 'no_such_part'"),
        (["run", "--submission", "/no/such/dir"], "grader: error: no such directory: /no/such/dir"),
        (["run", "--submission", "README.md"], "grader: error: --submission must be a directory"),
        (["run", "collectives", "-k", "nothing_matches"], "grader: error: no graded test matches"),
        (["frobnicate"], "grader: error: argument command: invalid choice: 'frobnicate'"),
        (["bench", "pipeline_parallel"], "grader: error: grader bench measures the collectives"),
        (
            ["run", "--results", "/no/such/dir/results.json"],
            "grader: error: cannot write --results /no/such/dir/results.json: no such directory",
        ),
        (["--config", "/no/such.yaml", "list"], "grader: error: cannot read the grading config"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_status_2(args: list[str], message: str):
    done = run_grader(args, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith(message), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stdout + done.stderr


def test_a_bad_configuration_is_exit_status_2(tmp_path: Path):
    config = tmp_path / "grading.yaml"
    config.write_text("parts:\n  collectives:\n    file: test_collectives.py\n    points: -1\n")
    done = run_grader(["--config", str(config), "run"], timeout=120)
    assert done.returncode == 2
    assert "grader: error:" in done.stderr and "Traceback" not in done.stderr


def test_a_bad_gradescope_visibility_is_one_line_naming_it(tmp_path: Path):
    graded = tmp_path / "tests" / "graded"
    shutil.copytree(REPO / "tests" / "graded", graded)
    config = graded / "grading.yaml"
    config.write_text(
        config.read_text().replace("stdout_visibility: hidden", "stdout_visibility: x")
    )
    done = run_grader(["run", "--submission", "reference"], timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("grader: error: ") and len(done.stderr.splitlines()) == 1
    assert "gradescope.stdout_visibility must be one of" in done.stderr


def test_list_shows_every_part_with_its_points_and_visibility():
    done = run_grader(["list"], timeout=120)
    assert done.returncode == 0
    for part in ("collectives", "pipeline_parallel"):
        assert part in done.stdout
    assert "points in all" in done.stdout
    assert "visibility" in done.stdout and "visible" in done.stdout


def test_help_documents_the_configuration_option():
    done = run_grader(["--help"], timeout=60)
    assert done.returncode == 0
    assert "--config FILE" in done.stdout and "GRADER_CONFIG" in done.stdout
    assert "gradescope" in done.stdout


def test_a_missing_module_grades_its_part_as_not_submitted(tmp_path: Path):
    """coll_unusual holds collectives.py only: the pipeline part is not submitted, not an error."""
    results = tmp_path / "results.json"
    args = ["run", "pipeline_parallel", "--submission", str(SUBMISSIONS / "coll_unusual")]
    done = run_grader([*args, "--results", str(results)], timeout=120)
    assert done.returncode == 1
    tests = json.loads(results.read_text())["tests"]
    assert tests and all(t["extra_data"]["outcome"] == "not_run" for t in tests)
    assert tests[0]["output"] == "not submitted: the submission has no pipeline_parallel.py"


def test_a_grader_the_tests_started_ends_with_their_process(tmp_path: Path):
    """A suite stopped by a signal runs no teardown: a grader one of its tests started (with
    ``runner.start_grader``) ends with the test's process all the same, and all it started."""
    test_process = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from runner import start_grader
grader = start_grader(["run", "--submission", "reference", "--results", sys.argv[1]])
print(grader.pid, flush=True)
time.sleep(600)
"""
    parent = subprocess.Popen(
        [sys.executable, "-c", test_process, str(tmp_path / "results.json")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert parent.stdout is not None
        grader = int(parent.stdout.readline())
        started: list[int] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(started) < 5:  # torchrun and its 4 ranks
            time.sleep(0.5)
            started = descendants(grader)
        assert len(started) >= 5, "the grader never started its job"
        time.sleep(3)  # its ranks are in their sandboxes now
        started = [grader, *descendants(grader)]
    finally:
        parent.kill()  # as SIGKILL ends a pytest worker: no teardown runs
        parent.wait()
    assert_all_ended(started, seconds=20)  # grading the whole reference takes longer


def hanging_submission(tmp_path: Path) -> Path:
    """A submission whose import never returns: its ranks never answer a call."""
    hanging = tmp_path / "submission"
    hanging.mkdir()
    (hanging / "collectives.py").write_text("import time\n\ntime.sleep(600)\n")
    return hanging


def until_its_job(grader: subprocess.Popen[str]) -> set[int]:
    """Every process seen under ``grader`` (and itself) until its torchrun appears."""
    seen, deadline = {grader.pid}, time.monotonic() + 90
    while not any("torch.distributed.run" in command_line(p) for p in seen):
        assert time.monotonic() < deadline and grader.poll() is None, "no job started"
        seen |= set(descendants(grader.pid))
        time.sleep(0.05)
    return seen


@pytest.mark.parametrize("after", [0.0, 3.0])
def test_sigterm_while_the_first_job_starts_leaves_nothing(after: float, tmp_path: Path):
    """SIGTERM ``after`` seconds past the start of the first job (its torchrun and ranks
    importing torch while the grader imports it and collects the tests; then the first test,
    on a submission whose import hangs): exit status 130, every process ended, every file
    removed. A job whose ranks were still connecting was neither the pool's running job nor
    its starting one, and was left with its folders; pytest's collection took the signal for
    a failure of its own, and the run went on to grade everything; an interrupt raised inside
    torch's import goes through C++ and aborts the process."""
    hanging = hanging_submission(tmp_path)
    scratch = tmp_path / "tmp"  # the grader's temporary files, its sockets' folders too
    scratch.mkdir()
    grader = start_grader(
        ["run", "collectives", "--submission", str(hanging)], env={"TMPDIR": str(scratch)}
    )
    try:
        started = until_its_job(grader)
        time.sleep(after)
        started |= set(descendants(grader.pid))
        grader.send_signal(signal.SIGTERM)
        out, err = grader.communicate(timeout=60)
    finally:
        if grader.poll() is None:
            os.killpg(grader.pid, signal.SIGKILL)
    assert grader.returncode == 130, out + err
    assert "interrupted" in out + err, out + err
    assert "Traceback" not in err, err
    assert_all_ended(started)
    assert_all_ended(naming(scratch))  # a bwrap forked after the last look, orphaned too
    assert not list(scratch.iterdir()), list(scratch.iterdir())


STOPPED_IN_EXEC = """
import os, signal, sys, threading
from grader.commands import interrupts

def main():
    with interrupts.sigterm_is_ctrl_c():
        try:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIG{name})).start()
            exec("while True: pass")  # as a dataclass's methods are made, at an import
        except KeyboardInterrupt:
            return 130
    return 0

sys.exit(main())
"""


@pytest.mark.parametrize("name", ["TERM", "INT"])
def test_an_interrupt_inside_exec_still_exits_130(name: str, tmp_path: Path):
    """Under ``python -m`` (as ``grader batch`` and the Gradescope script run the grader),
    CPython ended a program whose builtin KeyboardInterrupt had passed out of ``exec`` of a
    string by SIGINT at exit, whatever it returned: status -2, with nothing printed, for a
    grader stopped while it imported a module. The grader's own KeyboardInterrupt is not
    remembered so."""
    (tmp_path / "stopped.py").write_text(STOPPED_IN_EXEC.replace("{name}", name))
    done = subprocess.run(
        ends_with_the_tests([sys.executable, "-m", "stopped"]),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 130, done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_the_first_job_leaves_nothing(signum: int, tmp_path: Path):
    """SIGTERM or Ctrl-C as soon as the grader made its folder of temporary files, before
    its first job (while it reads the course, probes the sandbox or starts the job): exit
    status 130, no traceback, nothing left. SIGTERM killed it there with its folder left."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    grader = start_grader(["run", "collectives"], env={"TMPDIR": str(scratch)})
    try:
        deadline = time.monotonic() + 60
        while not any(scratch.glob("grader-run-*")):
            assert time.monotonic() < deadline and grader.poll() is None, "no folder made"
            time.sleep(0.005)
        started = set(descendants(grader.pid))
        grader.send_signal(signum)
        out, err = grader.communicate(timeout=60)
    finally:
        if grader.poll() is None:
            os.killpg(grader.pid, signal.SIGKILL)
    assert grader.returncode == 130, out + err
    assert "interrupted" in out + err, out + err
    assert "Traceback" not in err, err
    assert_all_ended(started)
    assert not list(scratch.iterdir()), list(scratch.iterdir())


def sockets_of(folder: Path) -> list[Path]:
    """The socket folders in /tmp of the grader whose folder of temporary files is ``folder``:
    each holds a link to its ``.owner``."""
    owner = (folder / ".owner").stat().st_ino
    found = [s for s in Path("/tmp").glob("grader-sockets-*") if _inode(s / ".owner") == owner]
    assert found, "no socket folder in /tmp"
    return found


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except OSError:
        return -1


def test_what_a_killed_grader_left_is_removed_by_the_next(tmp_path: Path):
    """SIGKILL runs no cleanup: the grader's folder of temporary files (sockets, work folder)
    stays. The next grader on the machine removes it, and leaves a live grader's alone."""
    hanging = hanging_submission(tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    killed = start_grader(["run", "collectives", "--submission", str(hanging)], env=env)
    live: subprocess.Popen[str] | None = None
    try:
        processes = until_its_job(killed)
        (left,) = scratch.iterdir()
        sockets = sockets_of(left)  # in /tmp: a socket's path would be too long in tmp_path
        killed.kill()
        killed.wait()
        assert_all_ended(processes)
        # Its socket folders in /tmp are not checked here: any grader starting meanwhile (a
        # test beside this one) may already have removed them, as the next one must.
        assert (left / ".owner").exists()
        live = start_grader(["run", "collectives", "--submission", str(hanging)], env=env)
        processes = until_its_job(live)
        assert not left.exists() and not any(s.exists() for s in sockets)
        (folder,) = scratch.iterdir()
        assert run_grader(["list", "collectives"], env=env).returncode == 0
        assert folder.exists()  # in use
        live.send_signal(signal.SIGTERM)
        assert live.wait(timeout=60) == 130
    finally:
        for grader in (killed, live):
            if grader is not None and grader.poll() is None:
                os.killpg(grader.pid, signal.SIGKILL)
    assert_all_ended(processes)
    assert not list(scratch.iterdir()), list(scratch.iterdir())


def ranks_of(pids: list[int]) -> list[int]:
    """The ranks' own processes among ``pids``: ``python -m grader.rank``, or forked by their
    job's zygote (its command line, under a rank's own uid)."""
    exec_d, forked = (f"{sys.executable} -m grader.{m} " for m in ("rank", "launch.zygote"))
    return [
        pid
        for pid in pids
        if command_line(pid).startswith(exec_d)
        or (command_line(pid).startswith(forked) and process_owner(pid) not in (None, os.geteuid()))
    ]


def test_interrupting_the_grader_ends_every_process_it_started(tmp_path: Path):
    """Ctrl-C while a rank is stuck in a busy loop: nothing is left behind, the results kept."""
    results = tmp_path / "results.json"
    submission = materialize("coll_faults", tmp_path)  # its scatter spins on one rank
    grader = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grader",
            "run",
            "collectives",
            "-k",
            "scatter",
            "--world-size",
            "2",
            "--submission",
            str(submission),
            "--results",
            str(results),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        started: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(ranks_of(started)) < 2:  # both ranks up
            time.sleep(0.5)
            started = descendants(grader.pid)
        assert len(ranks_of(started)) >= 2, "the grader never started its job's ranks"
        time.sleep(3)  # the ranks are in the test now, one of them spinning
        started = descendants(grader.pid)
        grader.send_signal(signal.SIGINT)
        assert grader.wait(timeout=30) == 130
    finally:
        if grader.poll() is None:
            os.killpg(grader.pid, signal.SIGKILL)
    assert_all_ended(started)
    reported = json.loads(results.read_text())["tests"]
    assert len(reported) == 6  # every selected test, those not finished as not_run
    assert "not run: grading was interrupted" in {t["output"] for t in reported}
    assert "the test did not complete" not in {t["output"] for t in reported}
