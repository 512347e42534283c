"""The harness of test_zygote.py, run as root by an interpreter every uid may run: one job's
zygote at LEVEL, a rank forked from it as a wrapper asks, what the rank's process holds,
then its wrapper hanging up. Prints one line of JSON.

    python zygote_harness.py WORK LEVEL
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

from grader.broker.accounting import sender_pid
from grader.device import Device
from grader.launch import zygote
from grader.launch.job import job_settings, prepare_job
from grader.launch.plan import SandboxPlan, log_path, rank_sandbox
from grader.sandbox import Level, identity


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def descriptors(pid: int) -> dict[str, str]:
    folder = f"/proc/{pid}/fd"
    return {fd: os.readlink(f"{folder}/{fd}") for fd in sorted(os.listdir(folder), key=int)}


def main(work: Path, level: Level) -> dict[str, object]:
    uids = identity.reserve()
    work.mkdir(mode=0o711)
    try:
        settings = job_settings(work, level, Device.CPU, identity=uids)
        settings.import_dir.mkdir(mode=0o755)  # where a grading stages the submission
        job_dir = work / "job"
        prepare_job(settings, job_dir, {})
        plan = SandboxPlan.read(job_dir)
        process = zygote.start(plan, job_dir, 1)
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        rank_sandbox(plan, job_dir, 0, 1, 0).prepare()
        with open(log_path(job_dir, 0), "wb") as log:
            asked = {"rank": 0, "world_size": 1, "local_rank": 0}
            forked = zygote.Forked(Path(plan.zygote), asked, theirs.fileno(), log.fileno())
        theirs.close()
        # Its pid here, as the kernel names the writer of its hello (at namespaces the
        # zygote's answer is a pid in the job's own namespace).
        said = select.select([ours], [], [], 60)[0] and sender_pid(ours)
        pid = said or forked.pid
        seen = {"hello": bool(said), "status": status(pid), "fds": descriptors(pid)}
        seen |= {"uid": uids.uid(0), "job": str(job_dir)}
        parent = int(status(pid)["PPid"])
        seen["parent"] = Path(f"/proc/{parent}/cmdline").read_bytes().decode()
        forked.send_signal(signal.SIGTERM)  # the wrapper hangs up
        seen["exit"] = forked.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["rank_gone"] = not Path(f"/proc/{pid}").exists()
        seen["zygote_exit"] = process.wait(10)  # its one rank ended: it ends too
        seen["log"] = log_path(job_dir, 0).read_text()
        return seen
    finally:
        uids.release()


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Level(sys.argv[2]))))
