"""``dtm bench tasks``: how long the task planner takes (io/TASKS.md §4) on random graphs.

Each graph has ``tasks`` tasks in file order, each needing up to three earlier ones (at random,
seeded), 1, 2 or 4 ranks of an 8-rank job and a random memory figure; the planner runs
``repeat`` times per graph and the best time is reported, per 1,000 tasks, against the
target of 10 ms per 1,000 tasks.
"""

from __future__ import annotations

import random
import time

from dtm_mpi.errors import UsageError
from dtm_mpi.plan.task_plan import TaskNeeds, plan_tasks

__all__ = ["TARGET_MS_PER_1000", "random_needs", "run_tasks_bench"]

TARGET_MS_PER_1000 = 10.0


def random_needs(tasks: int, seed: int = 0) -> list[TaskNeeds]:
    """A random acyclic graph of ``tasks`` tasks (dependencies on earlier tasks only)."""
    rng = random.Random(seed)
    needs = []
    for i in range(tasks):
        deps = sorted({rng.randrange(i) for _ in range(rng.randrange(4))}) if i else []
        needs.append(
            TaskNeeds(
                f"task{i}",
                tuple(f"task{d}" for d in deps),
                rng.choice((1, 1, 2, 4)),
                rng.randrange(1 << 34),
                rng.randrange(1 << 30),
            )
        )
    return needs


def run_tasks_bench(sizes: list[int], repeat: int) -> str:
    if repeat < 1 or not sizes or min(sizes) < 1:
        raise UsageError(f"--repeat and every --tasks size must be >= 1; got {repeat}, {sizes}")
    lines = [
        "dtm bench tasks: plan_tasks on random graphs, 8 ranks, best of each size's runs",
        f"{'tasks':>8} {'waves':>7} {'best ms':>9} {'ms/1000':>9}  target {TARGET_MS_PER_1000:g} ms/1000",
    ]
    for n in sizes:
        needs = random_needs(n)
        best, waves = float("inf"), 0
        for _ in range(repeat):
            start = time.perf_counter()
            plan = plan_tasks(needs, job_ranks=8)
            best = min(best, time.perf_counter() - start)
            waves = plan.waves
        per = best * 1e3 * 1000 / n
        mark = "ok" if per <= TARGET_MS_PER_1000 else "OVER"
        lines.append(f"{n:>8} {waves:>7} {best * 1e3:>9.2f} {per:>9.2f}  {mark}")
    return "\n".join(lines)
