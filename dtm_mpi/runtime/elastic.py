"""``dtm launch``: run a ``dtm run`` job under ``mpirun`` and keep it going when ranks or hosts
are lost: relaunch on the slots that remain with the largest mesh that fits, resumed from the
newest checkpoint that verifies, up to a bounded number of restarts.

The launcher is an ordinary process (it starts ``mpirun``; it is not an MPI rank). Its
decisions are pure functions (:func:`shrink_mesh`, :func:`parse_hostfile`) of what it was given
and what it observed:

* **Which slots remain.** Without a host file, the machine's: the same number of ranks again
  (a rank that died on a live machine left its slot free). With one, each host is probed
  (``--probe``, by default ``ssh HOST true``, bounded); a host that does not answer is gone,
  with its slots.
* **The mesh (rule).** The first axis of ``--mesh`` (by convention ``dp``: data-parallel
  replicas are interchangeable) shrinks to ``floor(slots / product of the other axes)``; the
  others keep their sizes (they shard the model: a smaller ``tp`` needs more memory per rank).
  If even one replica does not fit, the launch gives up, saying why. Only the ranks of the new
  mesh are started.
* **Resume.** Every relaunch passes ``--resume`` (the run takes the newest checkpoint that
  restores and verifies, on any mesh); so a lost rank costs at most the steps since the last
  checkpoint. A run stopped on a signal after saving (exit 75) is not relaunched here: the
  launcher exits 75 for the scheduler to requeue.
* **Bounded.** After ``--max-restarts`` relaunches that failed, one line says so, with the last
  failure, and the launcher exits 1.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dtm_mpi.errors import EXIT_REQUEUE, UsageError
from dtm_mpi.io.store import read_latest
from dtm_mpi.sharding.mesh import parse_mesh_binding

__all__ = ["Attempt", "LaunchPlan", "launch_elastic", "parse_hostfile", "shrink_mesh"]

DEFAULT_PROBE = "ssh -o BatchMode=yes -o ConnectTimeout=5 {host} true"

_LAUNCHER_LINE = re.compile(r"^\[[^\]\s]+:\d+\] ")  # Open MPI's own "[host:pid] ..." lines


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """What one launch starts: ``ranks`` on ``hosts`` (name, slots) with mesh ``mesh``."""

    ranks: int
    mesh: dict[str, int] | None
    hosts: tuple[tuple[str, int], ...] = ()

    def mesh_text(self) -> str | None:
        return ",".join(f"{k}={v}" for k, v in self.mesh.items()) if self.mesh else None


@dataclass(frozen=True, slots=True)
class Attempt:
    """One launch and how it ended."""

    plan: LaunchPlan
    code: int
    last_line: str


def parse_hostfile(text: str, where: str = "host file") -> tuple[tuple[str, int], ...]:
    """``HOST [slots=N]`` per line (Open MPI's format; ``#`` comments); the hosts in order."""
    hosts: list[tuple[str, int]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        slots = 1
        for item in rest:
            key, _, value = item.partition("=")
            if key in ("slots", "max_slots") and value.isdigit() and int(value) >= 1:
                slots = int(value) if key == "slots" else slots
            else:
                raise UsageError(f"{where}:{n}: {item!r} is not slots=N (N >= 1)")
        hosts.append((name, slots))
    if not hosts:
        raise UsageError(f"{where}: no hosts")
    return tuple(hosts)


def shrink_mesh(mesh: dict[str, int] | None, slots: int) -> dict[str, int] | None:
    """The largest mesh of the rule (the first axis shrinks, the others stay) on ``slots``
    ranks; None for a run without ``--mesh`` (then every slot is a rank). Raises
    :class:`UsageError` when not even one replica fits."""
    if mesh is None:
        return None
    first, *others = mesh
    rest = 1
    for axis in others:
        rest *= mesh[axis]
    replicas = min(mesh[first], slots // rest)
    if replicas < 1:
        kept = ", ".join(f"{a}={mesh[a]}" for a in others)
        raise UsageError(
            f"{slots} slot(s) left cannot hold one replica of the mesh ({kept} needs {rest} ranks)"
        )
    return {first: replicas, **{a: mesh[a] for a in others}}


def _option(args: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _without(args: Sequence[str], name: str, *, takes_value: bool) -> list[str]:
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == name:
            skip = takes_value
            continue
        if takes_value and a.startswith(name + "="):
            continue
        out.append(a)
    return out


def launch_elastic(
    run_args: Sequence[str],
    *,
    ranks: int | None,
    hostfile: str | None,
    max_restarts: int,
    probe: str,
    mpirun: Sequence[str] = ("mpirun",),
    mpirun_args: Sequence[str] = (),
    python: str = sys.executable,
    say: Callable[[str], None] = print,
    start: Callable[[list[str]], tuple[int, str]] | None = None,
) -> int:
    """Run ``dtm run RUN_ARGS`` under ``mpirun`` until it succeeds, stops on a signal after
    saving (returns 75), or fails ``max_restarts + 1`` times (returns 1). ``start(cmd)`` runs
    one launch and returns (exit code, its last output line); the default streams the job's
    output through."""
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0; got {max_restarts}")
    mesh_text = _option(run_args, "--mesh")
    mesh = parse_mesh_binding(mesh_text) if mesh_text else None
    hosts = parse_hostfile(Path(hostfile).read_text(), hostfile) if hostfile else ()
    if ranks is None:
        ranks = sum(s for _, s in hosts) if hosts else (_product(mesh) if mesh else None)
    if ranks is None or ranks < 1:
        raise UsageError(
            "dtm launch needs --ranks N (or --mesh in the run's arguments, or a host file)"
        )
    if _option(run_args, "--store") is None:
        say("dtm launch: warning: no --store: a relaunch starts from the beginning")
    base = _without(_without(run_args, "--mesh", takes_value=True), "--resume", takes_value=False)
    run = start or _stream
    attempts: list[Attempt] = []
    plan = LaunchPlan(
        min(ranks, _product(mesh)) if mesh else ranks, shrink_mesh(mesh, ranks), hosts
    )
    store = _option(run_args, "--store")
    while True:
        # resume after a failure once a checkpoint is committed (before that: from the start)
        resume = "--resume" in run_args or (
            bool(attempts) and store is not None and _committed(Path(store))
        )
        cmd = _command(plan, base, resume, mpirun, mpirun_args, python)
        say(
            f"dtm launch: attempt {len(attempts) + 1}: {plan.ranks} rank(s)"
            + (f", mesh {plan.mesh_text()}" if plan.mesh else "")
            + (f" on {', '.join(f'{h}:{s}' for h, s in plan.hosts)}" if plan.hosts else "")
            + (" (resuming)" if resume else "")
        )
        code, last = run(cmd)
        attempts.append(Attempt(plan, code, last))
        if code in (0, EXIT_REQUEUE):
            return code
        if len(attempts) > max_restarts:
            say(
                f"dtm launch: gave up after {len(attempts)} attempt(s) ({max_restarts} restart(s)); the last ended with exit code {code}: {last or '(no output)'}"
            )
            return 1
        alive = tuple(h for h in plan.hosts if _answers(h[0], probe)) if plan.hosts else ()
        slots = sum(s for _, s in alive) if plan.hosts else ranks
        lost = [h for h, _ in plan.hosts if h not in {a for a, _ in alive}]
        try:
            new_mesh = shrink_mesh(mesh, slots)
        except UsageError as exc:
            say(f"dtm launch: gave up: hosts {', '.join(lost) or '(none)'} lost; {exc}")
            return 1
        new_ranks = _product(new_mesh) if new_mesh else slots
        say(
            f"dtm launch: exit code {code}"
            + (f"; lost host(s) {', '.join(lost)}" if lost else "")
            + f"; relaunching on {new_ranks} rank(s)"
        )
        plan = LaunchPlan(new_ranks, new_mesh, _fit(alive, new_ranks) if plan.hosts else ())


def _committed(store: Path) -> bool:
    """Whether ``store`` holds a committed checkpoint (a run can resume from it)."""
    return store.is_dir() and read_latest(store) is not None


def _product(mesh: dict[str, int] | None) -> int:
    n = 1
    for v in (mesh or {}).values():
        n *= v
    return n


def _fit(hosts: tuple[tuple[str, int], ...], ranks: int) -> tuple[tuple[str, int], ...]:
    """The hosts in order, with slots cut to ``ranks`` in all."""
    out, left = [], ranks
    for h, s in hosts:
        if left <= 0:
            break
        out.append((h, min(s, left)))
        left -= min(s, left)
    return tuple(out)


def _command(
    plan: LaunchPlan,
    base: Sequence[str],
    resume: bool,
    mpirun: Sequence[str],
    mpirun_args: Sequence[str],
    python: str,
) -> list[str]:
    cmd = [*mpirun, "-n", str(plan.ranks), *mpirun_args]
    if plan.hosts:
        cmd += ["--host", ",".join(f"{h}:{s}" for h, s in plan.hosts)]
    cmd += [python, "-m", "mpi4py", "-m", "dtm_mpi", "run", *base]
    if plan.mesh:
        cmd += ["--mesh", plan.mesh_text() or ""]
    if resume:
        cmd.append("--resume")
    return cmd


def _answers(host: str, probe: str) -> bool:
    cmd = shlex.split(probe.format(host=shlex.quote(host)))
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _stream(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd``, passing its output through; its exit code and last line."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.strip() and not line.startswith(("-----", " ")) and not _LAUNCHER_LINE.match(line):
            last = line.strip()
    return proc.wait(), last
