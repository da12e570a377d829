"""A private single-node Slurm cluster for the tests: its own munge key and socket, its own
``slurm.conf`` (ports picked free on loopback, state and spool in a temporary directory),
``munged``, ``slurmctld`` and ``slurmd`` started here and stopped at the end. It never reads or
touches a system Slurm: every client command gets ``SLURM_CONF`` pointing at this one.

Needs Debian's ``slurmctld slurmd slurm-client munge`` (``make setup`` installs them as root
where it can) and root (the daemons run as root here); :func:`why_not` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REQUEUE_SETTLE_S = 1.0
"""How long a requeued job waits, at least, before the test moves its start to now (and only
once no step daemon of its previous run is left)."""

DAEMONS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "scancel",
    "scontrol",
    "sinfo",
)


def why_not() -> str | None:
    """Why a private cluster cannot start here (None: it can)."""
    missing = [
        d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()
    ]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; make setup installs Debian's slurmctld slurmd slurm-client munge as root)"
    if os.geteuid() != 0:
        return "the private Slurm daemons run as root here; not root"
    return None


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    """A running private cluster; :meth:`env` is what its client commands need."""

    root: Path
    host: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for key in list(env):
            if key.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_")):
                del env[key]  # nothing of an outer job leaks in
        env["SLURM_CONF"] = str(self.root / "slurm.conf")
        env.update(extra)
        return env

    def run(
        self, *cmd: str, timeout: float = 60, check: bool = True, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=self.env(**extra), check=check
        )

    def sbatch(self, script: Path, *args: str, cwd: Path, **extra: str) -> int:
        out = subprocess.run(
            ["sbatch", "--parsable", *args, str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            env=self.env(**extra),
            cwd=cwd,
            check=True,
        )
        return int(out.stdout.strip().split(";")[0])

    def state(self, job: int) -> str:
        """The job's state as squeue shows it ('' once it has left the queue)."""
        out = self.run("squeue", "-h", "-j", str(job), "-o", "%T", check=False)
        return out.stdout.strip()

    def wait_gone(self, job: int, timeout: float, *, hurry_requeue: bool = True) -> None:
        """Wait until ``job`` has left the queue. A requeued job waits about two minutes before
        it may start again (Slurm's delay); with ``hurry_requeue`` the test, as the operator,
        moves its start to now."""
        deadline = time.monotonic() + timeout
        held_since: float | None = None
        while time.monotonic() < deadline:
            st = self.state(job)
            if not st:
                return
            info = (
                self.run("scontrol", "show", "job", str(job), check=False).stdout
                if st == "PENDING"
                else ""
            )
            if hurry_requeue and "Reason=BeginTime" in info:
                held_since = held_since if held_since is not None else time.monotonic()
                # once slurmd has finished with the job's previous run (Slurm's own delay is
                # about two minutes; a restart while a step daemon of the previous run is still
                # there fails to launch its tasks)
                if not self.step_daemons(job) and time.monotonic() - held_since > REQUEUE_SETTLE_S:
                    self.run("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)
            else:
                held_since = None
            time.sleep(0.5)
        raise AssertionError(f"job {job} still {self.state(job)} after {timeout:g} s")

    def step_daemons(self, job: int | None = None) -> list[int]:
        """The pids of this cluster's ``slurmstepd`` processes (those of ``job``: its batch,
        extern or task steps). Another cluster's (an earlier run's) carry another
        ``SLURM_CONF`` and the same job numbers."""
        conf = f"SLURM_CONF={self.root / 'slurm.conf'}".encode()
        title = f"slurmstepd: [{'' if job is None else f'{job}.'}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (entry / "cmdline").read_bytes().startswith(title) and conf in (
                    entry / "environ"
                ).read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "-u", "root", check=False, timeout=20)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        # step daemons outlive slurmd (a job that was ending when the cluster stopped): they and
        # what they run (the job script, srun, the tasks) must not be left behind
        for pid in _with_descendants(self.step_daemons()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def start_cluster(cpus: int = 8) -> SlurmCluster:
    """Start munged, slurmctld and slurmd on loopback with a configuration of their own."""
    root = Path(tempfile.mkdtemp(prefix="dtm-slurm-"))
    host = socket.gethostname().split(".")[0]
    munge = root / "munge"
    for d in (munge, root / "state", root / "spool"):
        d.mkdir()
    munge.chmod(0o700)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = munge / "munge.sock"
    ctld_port, d_port = _free_ports(2)
    (root / "slurm.conf").write_text(f"""ClusterName=dtmtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=30
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    cluster = SlurmCluster(root, host)
    conf = str(root / "slurm.conf")
    env = cluster.env()
    logs = open(root / "daemons.out", "ab")  # noqa: SIM115  (closed with the process group)
    try:
        cluster.procs.append(
            subprocess.Popen(
                [
                    _exe("munged"),
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={sock}",
                    f"--pid-file={munge}/munged.pid",
                    f"--log-file={munge}/munged.log",
                    f"--seed-file={munge}/seed",
                ],
                stdout=logs,
                stderr=logs,
                env=env,
            )
        )
        _wait(sock.exists, 20, "munged did not create its socket", root)
        cluster.procs.append(
            subprocess.Popen(
                [_exe("slurmctld"), "-D", "-i", "-f", conf], stdout=logs, stderr=logs, env=env
            )
        )
        cluster.procs.append(
            subprocess.Popen(
                [_exe("slurmd"), "-D", "-f", conf, "-N", host], stdout=logs, stderr=logs, env=env
            )
        )
        _wait(
            lambda: "idle" in cluster.run("sinfo", "-h", "-o", "%t", check=False).stdout,
            60,
            "the node did not become idle",
            root,
        )
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(ok: Callable[[], bool], timeout: float, what: str, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.2)
    logs = "".join(
        (root / n).read_text(errors="replace")[-2000:]
        for n in ("daemons.out", "slurmctld.log", "slurmd.log")
        if (root / n).exists()
    )
    raise RuntimeError(f"private Slurm: {what} within {timeout:g} s\n{logs}")
