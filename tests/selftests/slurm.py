"""A throwaway single-node SLURM cluster in a temporary directory, for testing the sbatch recipe.

munged, slurmctld and slurmd run in the foreground as children of the test, with their
own key, socket, ports, state and logs under ``root``: nothing of the machine's own
configuration (``/etc/munge``, ``/etc/slurm``) is read or changed. No cgroups: processes
are tracked through /proc (``proctrack/linuxproc``), tasks are not bound (``task/none``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from runner import ends_with_the_tests

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "scontrol", "sinfo")


def available() -> str | None:
    """Why SLURM cannot be started here, or None if its programs are installed and we are root.

    Root, because slurmd starts each job as the user who submitted it.
    """
    missing = [p for p in (*DAEMONS, *CLIENTS) if not shutil.which(p)]
    if missing:
        return f"not installed: {', '.join(missing)}"
    return None if os.geteuid() == 0 else "needs root (slurmd starts jobs as their user)"


@dataclass
class Cluster:
    """Where the cluster lives and the environment its client commands need."""

    root: Path
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def logs(self) -> str:
        """The tail of every daemon's log: what to show when something fails."""
        tails = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-25:]
            tails.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(tails)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stepd_pids() -> set[int]:
    """Processes named slurmstepd: the per-job daemons slurmd forks, which outlive it if lost."""
    pids = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "slurmstepd":
                pids.add(int(entry.name))
    return pids


def _node_line() -> tuple[str, str]:
    """This machine as slurmd sees it (``slurmd -C``), reachable on loopback."""
    probe = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True)
    node = probe.stdout.splitlines()[0].split()
    name = node[0].split("=", 1)[1]
    kept = [f for f in node[1:] if f.split("=")[0] in ("CPUs", "RealMemory")]
    return f"NodeName={name} NodeAddr=127.0.0.1 {' '.join(kept)} State=UNKNOWN", name


def _write_config(root: Path) -> tuple[Path, str]:
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir()
    node, name = _node_line()
    config = root / "slurm.conf"
    config.write_text(
        "\n".join(
            [
                "ClusterName=graderci",
                f"SlurmctldHost={name}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={root / 'run' / 'munge.socket'}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SwitchType=switch/none",
                "MpiDefault=none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "ReturnToService=2",
                "KillWait=5",
                "SlurmctldDebug=info",
                "SlurmdDebug=info",
                node,
                "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    return config, name


def _wait_for(what: str, check, cluster: Cluster, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name, process in cluster.processes.items():
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with status {process.returncode} while waiting for {what}\n"
                    + cluster.logs()
                )
        if check():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}\n{cluster.logs()}")


def _stop(cluster: Cluster) -> None:
    """Cancel every job, then stop the daemons in reverse order, SIGKILL after a grace period."""
    if "slurmctld" in cluster.processes and cluster.processes["slurmctld"].poll() is None:
        subprocess.run(
            ["scancel", "--full", "--user", "root"],
            env=cluster.env,
            capture_output=True,
            timeout=30,
            check=False,
        )
    for name in reversed(list(cluster.processes)):
        process = cluster.processes[name]
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


@contextlib.contextmanager
def single_node_slurm(root: Path) -> Iterator[Cluster]:
    """Start munged, slurmctld and slurmd under ``root``; stop them all on the way out."""
    config, node = _write_config(root)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    env = {**os.environ, "SLURM_CONF": str(config)}
    cluster = Cluster(root, env)
    log = root / "log"
    commands = {
        "munged": [
            "munged",
            "--foreground",
            "--force",
            f"--socket={root / 'run' / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={root / 'run' / 'munged.pid'}",
            f"--seed-file={root / 'run' / 'munge.seed'}",
            f"--log-file={log / 'munged.log'}",
        ],
        "slurmctld": ["slurmctld", "-D", "-i", "-f", str(config)],
        "slurmd": ["slurmd", "-D", "-N", node, "-f", str(config)],
    }
    try:
        for name, command in commands.items():
            with open(log / f"{name}.out", "w") as out:
                cluster.processes[name] = subprocess.Popen(
                    ends_with_the_tests(command),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if name == "munged":
                _wait_for("munged's socket", (root / "run" / "munge.socket").exists, cluster, 20)
            if name == "slurmctld":
                _wait_for("slurmctld", lambda: _query(env, ["scontrol", "ping"], "UP"), cluster, 30)
        _wait_for(
            "the node to be idle",
            lambda: _query(env, ["sinfo", "-h", "-o", "%T"], "idle"),
            cluster,
            60,
        )
        yield cluster
    finally:
        _stop(cluster)


def _query(env: dict[str, str], command: list[str], expected: str) -> bool:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=20, check=False)
    return done.returncode == 0 and expected in done.stdout
