"""``grader doctor``: the sandbox levels this machine offers this install and course, why
each stronger one is refused, and what fixes it. Each level is tried as a grading would try
it: the machine's tools and privileges, then one rank started in the level's sandbox with
this run's paths, then (``uid``) whether a rank could read the course. A few seconds."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from grader import sandbox
from grader.course.config import GradingConfig
from grader.device import Device
from grader.launch.job import job_settings
from grader.launch.workspace import Workspace, why_not


def doctor(
    console: Console, config: GradingConfig, request: sandbox.Level | None
) -> sandbox.Level | None:
    """Print each level's verdict; return the level a course's grading would use, if any."""
    workspace = Workspace(config, request, for_course=True)
    try:
        chosen = None
        for level in sandbox.Level:
            why = why_not(
                level,
                sandbox.Level.NONE if level is sandbox.Level.NONE else request,
                False,
                lambda lv: job_settings(
                    workspace.work, lv, Device.CPU, identity=workspace.identity
                ),
            )
            if why is None and chosen is None and level is not sandbox.Level.NONE:
                chosen = level
            mark = "[green]ok[/]" if why is None else f"[red]refused[/]: {escape(why)}"
            console.print(f"{level.value:>10}  {mark}", highlight=False, soft_wrap=True)
    finally:
        workspace.close()
    if chosen is None:
        console.print("a course's grading cannot run here: fix one of the levels above")
    else:
        console.print(f"a course's grading runs at [bold]{chosen.value}[/]", highlight=False)
    return chosen
