"""The schedule picture, from a made-up broker record: fast, no job.

The broker's clock gives each stage's forwards, backwards and waits (the pipeline
bubble a student reads about); the PNG draws them with a legend, and a schedule that
passes leaves no stale PNG behind.
"""

from __future__ import annotations

import base64
import html
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from grader import protocol
from grader.course.catalog import GradedTest
from grader.course.config import TestSettings
from grader.judge.verdict import Schedule, Verdict, backward, forward
from grader.report.results import GradedResult, to_gradescope
from grader.report.timeline import draw_failed_schedules, png_path
from grader.testkit import Event, Traffic, stage_timing


def gpipe_two_stages() -> Traffic:
    """GPipe on 2 stages, 2 microbatches, each forward 1 s and each backward 2 s of work."""
    mark = "mark"
    stage0 = [
        Event(mark, -1, 0, at="step", posted=0.0),
        Event("send", 1, 24, posted=1.0),  # F0 done
        Event("send", 1, 24, posted=2.0),  # F1 done
        Event("recv", 1, 24, posted=2.0),  # waits for B0's gradient until 5
        Event("recv", 1, 24, posted=7.0),  # B0 done; B1's gradient came at 7
        Event(mark, -1, 0, at="end", posted=9.0),
    ]
    stage1 = [
        Event(mark, -1, 0, at="step", posted=0.0),
        Event("recv", 0, 24, posted=0.0),  # F0's activation comes at 1
        Event("recv", 0, 24, posted=2.0),  # F0 done; F1's activation came at 2
        Event("send", 0, 24, posted=5.0),  # F1 + B0 done (its loss joins them)
        Event("send", 0, 24, posted=7.0),  # B1 done
        Event(mark, -1, 0, at="end", posted=7.0),
    ]
    return Traffic([stage0, stage1])


def test_the_broker_clock_gives_each_stages_work_and_waits() -> None:
    timing = stage_timing(gpipe_two_stages())
    got = [[(s["kind"], s["label"], s["start"], s["end"]) for s in row] for row in timing]
    assert got[0] == [
        ("forward", "F0", 0.0, 1.0),
        ("forward", "F1", 1.0, 2.0),
        ("idle", "", 2.0, 5.0),  # the bubble: stage 1 works on F1 and B0
        ("backward", "B0", 5.0, 7.0),
        ("backward", "B1", 7.0, 9.0),
    ]
    assert got[1] == [
        ("idle", "", 0.0, 1.0),
        ("forward", "F0", 1.0, 2.0),
        ("forward+backward", "F1+B0", 2.0, 5.0),  # the last stage's loss joins them
        ("backward", "B1", 5.0, 7.0),
    ]


def result(passed: bool, details: dict) -> GradedResult:
    settings = TestSettings((2,), 2.0, 60.0, "visible", True)
    test = GradedTest(
        "pipeline_parallel",
        "gpipe_schedule",
        "gpipe_schedule",
        "pipeline_parallel.gpipe_step",
        "schedule",
        2,
        settings,
    )
    order = [[forward(0), forward(1), backward(0), backward(1)]] * 2
    outcome = protocol.PASSED if passed else protocol.FAILED
    verdict = Verdict(
        outcome, "" if passed else "wrong", details=details, schedule=Schedule(order, order)
    )
    return GradedResult(test, verdict, 2.0 if passed else 0.0)


def test_a_failed_schedule_is_drawn_in_time_and_a_passing_one_leaves_no_png(tmp_path: Path):
    pytest.importorskip("matplotlib")
    details = {"stage_timing": stage_timing(gpipe_two_stages())}
    failed = result(False, details)
    (drawn,) = draw_failed_schedules([failed], tmp_path)
    path = png_path(failed, tmp_path)
    assert path.exists() and path.name in drawn.verdict.message
    draw_failed_schedules([result(True, details)], tmp_path)  # fixed since: the PNG goes
    assert not path.exists()


def test_on_gradescope_the_picture_is_in_the_tests_html(tmp_path: Path):
    """Gradescope shows no image that is a file beside results.json: a test with a picture
    has HTML output with the PNG embedded, the message escaped; the others stay text."""
    pytest.importorskip("matplotlib")
    failed = result(False, {"stage_timing": stage_timing(gpipe_two_stages())})
    failed = replace(failed, verdict=replace(failed.verdict, message="expected <F0> & more"))
    (drawn,) = draw_failed_schedules([failed], tmp_path)
    document = to_gradescope([drawn, result(True, {})], 1.0, "summary")
    pictured, plain = document["tests"]
    assert pictured["output_format"] == "html" and plain["output_format"] == "text"
    assert pictured["output"].startswith("<pre>expected &lt;F0&gt; &amp; more")
    found = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', pictured["output"])
    assert found is not None
    assert base64.b64decode(found.group(1)) == png_path(failed, tmp_path).read_bytes()


def test_a_browser_draws_the_picture_gradescope_is_given(tmp_path: Path):
    """The test's HTML output, in a page as Gradescope shows it, rendered by a real headless
    browser: the message is text and the embedded picture decodes to an image of its size."""
    pytest.importorskip("matplotlib")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no headless browser here (apt-get install chromium)")
    failed = result(False, {"stage_timing": stage_timing(gpipe_two_stages())})
    (drawn,) = draw_failed_schedules([failed], tmp_path)
    (test,) = to_gradescope([drawn], 1.0, "summary")["tests"]
    measure = "document.body.dataset.width = document.images[0].naturalWidth"
    page = tmp_path / "test.html"
    page.write_text(
        f"<html><body><div class='test-output'>{test['output']}</div>"
        f"<script>addEventListener('load', () => {{ {measure} }})</script></body></html>"
    )
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    width = re.search(r'data-width="(\d+)"', dom)
    assert width is not None and int(width.group(1)) > 100, dom[:500]
    assert failed.verdict.message.split("\n")[0] in html.unescape(dom)
