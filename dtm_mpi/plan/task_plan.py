"""The task graph's plan: which task runs when and on which ranks (io/TASKS.md §4).

A pure, deterministic function of the tasks' needs (ranks, memory per rank, bytes moved,
accelerator), their dependencies and the job (ranks, capacity per rank, devices): the same
inputs give the same plan and the same plan hash on every rank and every machine. Stated
rules:

1. **Levels.** A task's level is one more than the highest level of the tasks it needs (0
   without any): every task runs after everything it needs.
2. **Waves.** The tasks of one level are packed into waves, largest rank count first (ties: file
   order), each onto the lowest free ranks of the first wave of that level with room (first
   fit); the tasks of a wave run at once on disjoint ranks, and a wave starts after the one
   before it ended.
3. **Fail closed.** A task needing more ranks than the job has, more bytes per rank than the
   capacity, or an accelerator the job lacks is refused, naming the task and both figures;
   nothing runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtm_mpi.errors import PlanError, TaskPlacementError

__all__ = ["Placement", "TaskNeeds", "TaskPlan", "plan_tasks", "task_plan_text"]


@dataclass(frozen=True, slots=True)
class TaskNeeds:
    """What one task needs to run, from its program and mesh (:mod:`dtm_mpi.plan.task_needs`)."""

    name: str
    deps: tuple[str, ...]  # tasks that run first
    ranks: int
    peak_bytes: int  # the most any rank of it holds at once
    sent_bytes: int  # bytes all its ranks send over its run
    accelerator: bool = False  # a GPU backend


@dataclass(frozen=True, slots=True)
class Placement:
    """Where and when one task runs: in ``wave``, on ranks ``first .. first + ranks - 1``."""

    task: str
    level: int
    wave: int
    first: int
    ranks: int

    @property
    def members(self) -> range:
        return range(self.first, self.first + self.ranks)


@dataclass(frozen=True, slots=True)
class TaskPlan:
    """Every task's placement in run order (by wave, then first rank), the job it was made
    for and its hash (SHA-256 of the canonical JSON of both and of the needs)."""

    placements: tuple[Placement, ...]
    needs: tuple[TaskNeeds, ...]  # in file order
    job_ranks: int
    capacity: int | None
    devices: int
    hash: str

    @property
    def waves(self) -> int:
        return 1 + max((p.wave for p in self.placements), default=-1)

    def wave(self, index: int) -> tuple[Placement, ...]:
        return tuple(p for p in self.placements if p.wave == index)

    def placement(self, task: str) -> Placement:
        for p in self.placements:
            if p.task == task:
                return p
        raise KeyError(task)


def plan_tasks(
    needs: Sequence[TaskNeeds],
    *,
    job_ranks: int,
    capacity: int | None = None,
    devices: int = 0,
) -> TaskPlan:
    """Plan ``needs`` (file order; dependencies already free of cycles) for a job of
    ``job_ranks`` ranks with ``capacity`` bytes per rank (None: unbounded) and ``devices``
    accelerators per rank (0: none). Raises :class:`TaskPlacementError` naming the task that
    fits nowhere."""
    if job_ranks < 1:
        raise PlanError(f"a task plan needs a job of >= 1 rank; got {job_ranks}")
    order = {n.name: i for i, n in enumerate(needs)}
    for n in needs:
        if n.ranks > job_ranks:
            raise TaskPlacementError(
                f"task {n.name!r} needs {n.ranks} ranks; the job has {job_ranks}: it fits nowhere",
                task=n.name,
            )
        if capacity is not None and n.peak_bytes > capacity:
            raise TaskPlacementError(
                f"task {n.name!r} needs {n.peak_bytes} bytes on a rank, over the capacity of "
                f"{capacity} bytes per rank: it fits nowhere",
                task=n.name,
            )
        if n.accelerator and devices < 1:
            raise TaskPlacementError(
                f"task {n.name!r} needs an accelerator (a GPU backend); the job has none",
                task=n.name,
            )
        for d in n.deps:
            if d not in order:
                raise TaskPlacementError(
                    f"task {n.name!r} needs {d!r}, which is no task of the plan", task=n.name
                )
    level: dict[str, int] = {}
    for n in _topological(needs, order):
        level[n.name] = 1 + max((level[d] for d in n.deps), default=-1)
    by_level: dict[int, list[TaskNeeds]] = {}
    for n in needs:
        by_level.setdefault(level[n.name], []).append(n)
    placements: list[Placement] = []
    wave = 0
    for lv in sorted(by_level):
        tasks = sorted(by_level[lv], key=lambda n: (-n.ranks, order[n.name]))
        smallest = tasks[-1].ranks
        used: list[int] = []  # per wave of this level: its lowest free rank
        open_: list[int] = []  # the waves that can still take the level's smallest task
        for n in tasks:
            w = next((i for i in open_ if used[i] + n.ranks <= job_ranks), None)
            if w is None:
                used.append(0)
                w = len(used) - 1
                open_.append(w)
            placements.append(Placement(n.name, lv, wave + w, used[w], n.ranks))
            used[w] += n.ranks
            if used[w] + smallest > job_ranks:  # full for every task still to come
                open_.remove(w)
        wave += len(used)
    placements.sort(key=lambda p: (p.wave, p.first))
    body = _canonical(placements, needs, job_ranks, capacity, devices)
    return TaskPlan(
        tuple(placements),
        tuple(needs),
        job_ranks,
        capacity,
        devices,
        hashlib.sha256(body).hexdigest(),
    )


def _topological(needs: Sequence[TaskNeeds], order: Mapping[str, int]) -> list[TaskNeeds]:
    """``needs`` with every task after the tasks it needs (Kahn; ties by file order)."""
    import heapq

    waiting = {n.name: len(set(n.deps)) for n in needs}
    users: dict[str, list[str]] = {}
    for n in needs:
        for d in set(n.deps):
            users.setdefault(d, []).append(n.name)
    ready = [order[n.name] for n in needs if waiting[n.name] == 0]
    heapq.heapify(ready)
    out: list[TaskNeeds] = []
    while ready:
        n = needs[heapq.heappop(ready)]
        out.append(n)
        for u in users.get(n.name, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, order[u])
    if len(out) != len(needs):
        stuck = sorted((n for n in waiting if waiting[n] > 0), key=order.__getitem__)
        raise PlanError(f"the tasks form a cycle through {', '.join(stuck)}")
    return out


def _canonical(
    placements: Sequence[Placement],
    needs: Sequence[TaskNeeds],
    job_ranks: int,
    capacity: int | None,
    devices: int,
) -> bytes:
    doc = {
        "job": [job_ranks, capacity, devices],
        "needs": [
            [n.name, list(n.deps), n.ranks, n.peak_bytes, n.sent_bytes, n.accelerator]
            for n in needs
        ],
        "placements": [[p.task, p.level, p.wave, p.first, p.ranks] for p in placements],
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def task_plan_text(plan: TaskPlan) -> str:
    """``dtm task plan``: the waves, each task's ranks, memory and traffic, the hash."""
    from dtm_mpi.plan.explain import human_bytes

    needs = {n.name: n for n in plan.needs}
    cap = human_bytes(plan.capacity) if plan.capacity is not None else "unbounded"
    lines = [
        f"task plan for {plan.job_ranks} rank(s), capacity {cap} per rank, "
        f"{plan.devices} accelerator(s) per rank: {len(plan.placements)} task(s) in "
        f"{plan.waves} wave(s)",
        "",
        f"  {'wave':>4}  {'task':<20} {'ranks':<9} {'peak/rank':>10} {'sent':>10}  needs",
    ]
    for p in plan.placements:
        n = needs[p.task]
        ranks = f"{p.first}" if p.ranks == 1 else f"{p.first}-{p.first + p.ranks - 1}"
        lines.append(
            f"  {p.wave:>4}  {p.task:<20} {ranks:<9} {human_bytes(n.peak_bytes):>10} "
            f"{human_bytes(n.sent_bytes):>10}  {', '.join(n.deps) or '-'}"
        )
    total = sum(n.sent_bytes for n in plan.needs)
    lines += ["", f"  bytes sent by all tasks: {human_bytes(total)}", f"  plan hash: {plan.hash}"]
    return "\n".join(lines) + "\n"
