"""What grading.yaml may say, where it is found, and what results.json makes of it.

In-process and fast: nothing here launches a job.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from runner import REPO

from grader.course import config
from grader.course.catalog import GradedTest
from grader.course.config import ConfigError, find_config, load_config
from grader.course.submission import SubmissionError, find_modules
from grader.failures import Cause, GraderFailure
from grader.judge.verdict import EXTRA_DATA_KEYS, Verdict
from grader.report.results import (
    GradedResult,
    ResultsPathError,
    check_writable,
    student_summary,
    to_gradescope,
    write_results,
)
from grader.testkit.record import Details

GRADED = REPO / "tests" / "graded"


@pytest.fixture
def course(tmp_path: Path) -> Path:
    """A copy of the course's tests/graded/, to edit its grading.yaml."""
    shutil.copytree(GRADED, tmp_path / "tests" / "graded")
    return tmp_path / "tests" / "graded" / "grading.yaml"


def edit(path: Path, old: str, new: str) -> Path:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


def test_the_course_configuration_loads_with_its_gradescope_block():
    loaded = load_config(GRADED / "grading.yaml")
    assert loaded.gradescope == {"visibility": "visible", "stdout_visibility": "hidden"}
    assert loaded.part("tensor_parallel").defaults.world_sizes_divide == 4


def test_a_world_size_the_tensor_parallel_tests_cannot_shard_is_refused(course: Path):
    edit(course, "world_sizes: [1, 2, 4]\n    points: 0.25\n    timeout: 60\n"
         "    visibility: visible\n    forbid_collectives: false\n    # IN",
         "world_sizes: [1, 3]\n    points: 0.25\n    timeout: 60\n"
         "    visibility: visible\n    forbid_collectives: false\n    # IN")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_config(course)
    message = str(err.value)
    assert "tensor_parallel" in message and "world size 3" in message
    assert "does not divide 4" in message and "\n" not in message


def test_a_per_test_world_size_is_checked_against_the_part_divisor(course: Path):
    edit(course, "      parallel_mlp_communication:\n        world_sizes: [2, 4]",
         "      parallel_mlp_communication:\n        world_sizes: [2, 8]")  # fmt: skip
    with pytest.raises(ConfigError, match=r"tensor_parallel\.tests\.parallel_mlp_communication"):
        load_config(course)


@pytest.mark.parametrize("bad", ["0.5", "many", "-2", "true"])
def test_world_sizes_divide_must_be_a_positive_integer(course: Path, bad: str):
    edit(course, "world_sizes_divide: 4", f"world_sizes_divide: {bad}")
    with pytest.raises(ConfigError, match="world_sizes_divide must be a positive integer"):
        load_config(course)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("gradescope:\n  visibility: secret\n", "gradescope.visibility must be one of"),
        ("gradescope:\n  colour: blue\n", "gradescope has unknown keys: colour"),
        ("gradescope: visible\n", "'gradescope' must be a mapping"),
    ],
)
def test_a_bad_gradescope_block_is_one_clear_line(course: Path, block: str, message: str):
    text = course.read_text()
    course.write_text(text[: text.index("\ngradescope:") + 1] + block)
    with pytest.raises(ConfigError, match=message):
        load_config(course)


def test_the_limits_block_sets_each_ranks_memory_and_scratch(course: Path):
    assert load_config(course).limits == config.RankLimits()  # the sandbox's defaults
    course.write_text(course.read_text() + "limits:\n  memory_per_rank_mib: 1536\n")
    limits = load_config(course).limits
    assert limits.memory_bytes == 1536 << 20 and limits.scratch_bytes == 64 << 20


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("limits:\n  memory: 1G\n", "limits has unknown keys: memory"),
        ("limits:\n  scratch_per_rank_mib: 1.5\n", "limits.scratch_per_rank_mib must be a whole"),
        ("limits: 1024\n", "'limits' must be a mapping"),
    ],
)
def test_a_bad_limits_block_is_one_clear_line(course: Path, block: str, message: str):
    course.write_text(course.read_text() + block)
    with pytest.raises(ConfigError, match=message):
        load_config(course)


def test_a_tests_options_are_the_parts_with_its_own_keys_on_top():
    collectives = load_config(GRADED / "grading.yaml").part("collectives")
    communication = collectives.settings_for("communication").options
    assert communication.need("communication_elements") == 49152
    assert communication.bytes_ratio("scatter") == 1.25  # a ratio per function
    performance = collectives.settings_for("performance").options
    assert (performance.full_points_within, performance.zero_points_beyond) == (1.5, 3.0)
    with pytest.raises(ValueError, match="no 'communication_elements' in its options"):
        performance.need("communication_elements")


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (  # a misspelt key, in a test's own options: found when the file loads
            "performance_elements: 1048576",
            "performance_elemnts: 1048576",
            r"collectives\.tests\.performance: unknown option performance_elemnts \(known: ",
        ),
        ("full_points_within: 1.5", "full_points_within: 0.5", "must be a number >= 1"),
        ("zero_points_beyond: 3.0", "zero_points_beyond: 1.2", "must be above full_points"),
        ("communication_elements: 49152", "communication_elements: 4.5", "positive integer"),
        ("        float16: 2.0e-2", "        float8: 2.0e-2", "unknown dtype 'float8'"),
    ],
)
def test_a_bad_option_is_one_clear_line(course: Path, old: str, new: str, message: str):
    edit(course, old, new)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(course)
    assert "\n" not in str(err.value)


def test_stdout_cannot_be_shown_while_a_test_is_hidden(course: Path):
    edit(course, "stdout_visibility: hidden", "stdout_visibility: visible")
    load_config(course)  # every test visible: fine
    edit(course, "      gpipe_schedule:\n", "      gpipe_schedule:\n        visibility: hidden\n")
    with pytest.raises(ConfigError, match=r"pipeline_parallel\.tests\.gpipe_schedule"):
        load_config(course)


def test_the_configuration_is_found_by_flag_then_environment_then_upward(
    course: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    other = tmp_path / "elsewhere.yaml"
    other.write_text("")
    deep = tmp_path / "assignments" / "deeper"
    deep.mkdir(parents=True)
    monkeypatch.delenv(config.CONFIG_ENV, raising=False)
    assert find_config(cwd=deep) == course.resolve()
    monkeypatch.setenv(config.CONFIG_ENV, str(other))
    assert find_config(cwd=deep) == other.resolve()
    assert find_config(Path("x.yaml"), cwd=deep) == Path("x.yaml").resolve()
    assert config.course_root(course) == tmp_path


def test_no_configuration_anywhere_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv(config.CONFIG_ENV, raising=False)
    monkeypatch.setattr(config, "_PACKAGE_CHECKOUT", tmp_path / "site-packages")
    with pytest.raises(ConfigError, match="cannot find the grading configuration") as err:
        find_config(cwd=tmp_path)
    assert "--config" in str(err.value) and "\n" not in str(err.value)


def result(visibility: str, outcome: str, points: float = 1.0) -> GradedResult:
    settings = load_config(GRADED / "grading.yaml").part("collectives").defaults
    settings = type(settings)(**{**settings.__dict__, "visibility": visibility, "points": points})
    test = GradedTest(
        "collectives", f"t_{visibility}", "n", "collectives.x", "correctness", 2, settings
    )
    verdict = Verdict(outcome, "" if outcome == "passed" else "wrong")
    return GradedResult(test, verdict, points if outcome == "passed" else 0.0)


def test_the_summary_students_see_leaves_out_hidden_tests():
    results = [
        result("visible", "passed"),
        result("hidden", "failed", 5),
        result("after_published", "passed", 2),
        result("after_due_date", "failed"),
    ]
    summary = student_summary(results)
    assert summary == "1 / 1 points; 1 of 1 tests passed"
    document = to_gradescope(results, 3.0, summary, {"stdout_visibility": "hidden"})
    assert document["stdout_visibility"] == "hidden" and "visibility" not in document
    assert [t["visibility"] for t in document["tests"]][1:] == [
        "hidden",
        "after_published",
        "after_due_date",
    ]


def test_results_are_readable_by_everyone(tmp_path: Path):
    path = tmp_path / "results.json"
    write_results(path, {"score": 1, "tests": []})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert json.loads(path.read_text())["score"] == 1


def test_an_unwritable_results_path_is_found_before_grading(tmp_path: Path):
    with pytest.raises(ResultsPathError, match="no such directory"):
        check_writable(tmp_path / "missing" / "results.json")
    (tmp_path / "file").write_text("")
    with pytest.raises(ResultsPathError, match="no such directory"):
        check_writable(tmp_path / "file" / "results.json")
    with pytest.raises(ResultsPathError, match="is a directory"):
        check_writable(tmp_path)
    check_writable(tmp_path / "results.json")
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # the probe is gone


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_a_folder_not_writable_by_us_is_refused(tmp_path: Path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ResultsPathError, match="Permission denied"):
        check_writable(locked / "results.json")


@pytest.mark.parametrize(
    "layout",
    [
        "collectives.py",
        "assignments/collectives.py",
        "repo-main/assignments/collectives.py",
        "repo-main/collectives.py",
    ],
)
def test_the_module_files_are_found_in_every_upload_layout(tmp_path: Path, layout: str):
    module = tmp_path / layout
    module.parent.mkdir(parents=True, exist_ok=True)
    module.write_text("")
    (tmp_path / "__MACOSX").mkdir()
    (tmp_path / "README.md").write_text("")
    assert find_modules(tmp_path) == module.parent


def test_an_upload_without_module_files_says_where_they_may_be(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(SubmissionError, match=r"no module files in .*assignments/") as err:
        find_modules(tmp_path)
    assert "collectives.py" in str(err.value)


def test_two_copies_of_the_work_are_ambiguous(tmp_path: Path):
    for copy in ("a", "b"):
        (tmp_path / copy).mkdir()
        (tmp_path / copy / "collectives.py").write_text("")
    with pytest.raises(SubmissionError, match="more than one folder"):
        find_modules(tmp_path)


def test_an_option_the_course_left_out_is_the_graders_failure_not_the_students(course: Path):
    """A graded test that needs an option grading.yaml does not give ends the run (exit 2, the
    option named): it is the course's mistake, never charged to the submission as an error."""
    from runner import run_grader

    edit(course, "          communication_elements: 49152", "          # no elements")
    done = run_grader(
        ["--config", str(course), "run", "collectives", "-k", "communication[all_reduce]",
         "--world-size", "2", "--submission", str(REPO / "reference")]
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the course's configuration: grading.yaml gives this test no" in done.stderr
    assert "'communication_elements'" in done.stderr


def test_a_figure_cannot_take_a_key_of_results_json_which_holds_them_all() -> None:
    """A test's figure named ``outcome`` would hide the grader's own: the course's mistake
    ends the run, never silently, never charged to the student."""
    details = Details()  # a TestRecord's
    details["bytes"] = 1
    with pytest.raises(GraderFailure, match="'outcome'"):
        details.update(outcome="passed")
    with pytest.raises(GraderFailure, match="'cause'"):
        details.setdefault("cause", {})
    assert dict(details) == {"bytes": 1}
    failed = result("visible", "failed")
    verdict = replace(failed.verdict, cause=Cause.CHECK, fraction=0.5, details={"bytes": 1})
    entry = to_gradescope([replace(failed, verdict=verdict)], 1.0, "")["tests"][0]
    assert set(entry["extra_data"]) == EXTRA_DATA_KEYS | {"bytes"}
