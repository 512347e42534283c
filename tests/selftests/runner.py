"""Runs the real `grader` command, as a user would, and reads what it reported."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SUBMISSIONS = Path(__file__).resolve().parent / "submissions"
_IMPORT = re.compile(r"^from reference(?:\.(\w+))? import (.+?)(?:\s+#.*)?$")


def materialize(name: str, into: Path) -> Path:
    """A broken submission as a student would hand it in: self-contained.

    The files in ``submissions/`` say ``from reference.<part> import *`` and
    override what they break; the ranks cannot see the reference (it is hidden
    from them), so the reference's source is written into the file first, and
    the override follows it. ``from reference import <part> as R`` keeps a
    snapshot of the reference's names as ``R``. ``"a+b"`` is ``a`` with ``b``'s
    overrides after its own (one attack through another's honest variant).
    """
    first, *more = name.split("+")
    target = into / name
    target.mkdir(parents=True, exist_ok=True)
    for path in (SUBMISSIONS / first).iterdir():
        if path.suffix != ".py":
            continue
        lines = path.read_text().splitlines()
        if not any(_IMPORT.match(line) for line in lines):
            (target / path.name).write_text(path.read_text())
            continue
        reference = (REPO / "reference" / path.name).read_text()
        body = _overrides(lines)
        for other in more:
            body += ["", *_overrides((SUBMISSIONS / other / path.name).read_text().splitlines())]
        (target / path.name).write_text(reference + "\n\n" + "\n".join(body) + "\n")
    return target


def _overrides(lines: list[str]) -> list[str]:
    """A submission file's own lines, its imports of the reference made into what they bind."""
    body = []
    for line in lines:
        found = _IMPORT.match(line)
        if line.startswith("from __future__"):
            continue
        if found is None:
            body.append(line)
        elif found.group(1) is None:  # from reference import part as alias
            alias = found.group(2).split(" as ")[-1].strip()
            body.append(f"{alias} = __import__('types').SimpleNamespace(**dict(globals()))")
        elif " as " in found.group(2):  # from reference.part import name as alias
            original, alias = (w.strip() for w in found.group(2).split(" as "))
            body.append(f"{alias} = {original}")
    return body


@dataclass
class Graded:
    """One `grader run`: its exit status, its terminal output and its results.json."""

    returncode: int
    stdout: str
    stderr: str
    results: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """A test whose output is Gradescope's HTML (a picture embedded) is read as the text
        a student sees above the picture; the HTML stays in ``output_html``."""
        for test in self.tests:
            if test.get("output_format") == "html":
                test["output_html"] = test["output"]
                test["output"] = html_text(test["output"])

    @property
    def tests(self) -> list[dict[str, Any]]:
        return self.results.get("tests", [])

    def test(self, name: str, world_size: int, part: str | None = None) -> dict[str, Any]:
        for entry in self.tests:
            extra = entry["extra_data"]
            if (
                extra["test"] == name
                and extra["world_size"] == world_size
                and part in (None, extra["part"])
            ):
                return entry
        raise KeyError(f"no test {name} at world size {world_size} in {self.names()}")

    def outcome(self, name: str, world_size: int) -> str:
        return self.test(name, world_size)["extra_data"]["outcome"]

    def message(self, name: str, world_size: int) -> str:
        return self.test(name, world_size)["output"]

    def outcomes(self) -> dict[tuple[str, int], str]:
        return {
            (e["extra_data"]["test"], e["extra_data"]["world_size"]): e["extra_data"]["outcome"]
            for e in self.tests
        }

    def names(self) -> list[str]:
        return [e["name"] for e in self.tests]


def html_text(page: str) -> str:
    """The text of a test's HTML output: its ``<pre>`` message, unescaped."""
    found = re.search(r"<pre>(.*?)</pre>", page, re.S)
    return html.unescape(found.group(1)) if found else page


def ends_with_the_tests(command: list[str]) -> list[str]:
    """``command``, sent SIGTERM when the test process that starts it dies (``setpriv
    --pdeathsig``): a suite stopped by a signal runs no teardown, and the grader and the
    SLURM daemons answer SIGTERM by ending what they started."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *command] if setpriv else command


def start_grader(
    args: list[str],
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
) -> subprocess.Popen[str]:
    """`python -m grader ARGS` of this checkout (whatever the folder it runs in, and whichever
    checkout is installed), started in a session of its own, its output piped; it ends when
    the test process does."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        ends_with_the_tests([python, "-m", "grader", *args]),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})},
        start_new_session=True,
    )


def run_grader(
    args: list[str], timeout: float = 600, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m grader ARGS`; on timeout, stop it as Ctrl-C would, then for good."""
    process = start_grader(args, cwd, env)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # the grader ends its own jobs
        try:
            stdout, stderr = process.communicate(timeout=15)
        finally:
            os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def assert_all_ended(pids: list[int] | set[int], seconds: float = 10) -> None:
    """Every process of ``pids`` ends within ``seconds`` (killed ones take a moment to be
    reaped); the message names those left behind by their command line."""
    from grader.launch.job import process_alive

    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if process_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"left behind: {[command_line(p) for p in alive]}"


def naming(path: Path) -> list[int]:
    """Every process whose command line names ``path``: a grader's jobs name its folder of
    temporary files (its wrappers, their bwraps, the ranks), whoever their parent is now."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and str(path) in command_line(int(entry))
    ]


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def process_owner(pid: int) -> int | None:
    """The uid that owns process ``pid``; None once it is gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def without_bwrap(tmp_path: Path) -> dict[str, str]:
    """PATH with every tool this machine has but bubblewrap: namespaces are refused."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        for tool in Path(folder).glob("*") if Path(folder).is_dir() else ():
            link = tools / tool.name
            if tool.name != "bwrap" and not os.path.lexists(link):
                link.symlink_to(tool)
    return {"PATH": str(tools)}
