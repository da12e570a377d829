"""``dtm bench tasks``: the random graphs are acyclic and plannable, the table has a row per
size, bad arguments are one line (the time itself is a benchmark figure, not a test)."""

from __future__ import annotations

import pytest

from dtm_mpi.bench.tasks import random_needs, run_tasks_bench
from dtm_mpi.errors import UsageError
from dtm_mpi.plan.task_plan import plan_tasks


def test_random_graphs_are_acyclic_seeded_and_plannable() -> None:
    needs = random_needs(300, seed=4)
    index = {n.name: i for i, n in enumerate(needs)}
    assert all(index[d] < index[n.name] for n in needs for d in n.deps)
    assert random_needs(300, seed=4) == needs != random_needs(300, seed=5)
    assert plan_tasks(needs, job_ranks=8).waves >= 1


def test_the_table_has_a_row_per_size() -> None:
    table = run_tasks_bench([50, 120], repeat=1)
    rows = [ln.split() for ln in table.splitlines()[2:]]
    assert [r[0] for r in rows] == ["50", "120"] and all(r[-1] in ("ok", "OVER") for r in rows)
    with pytest.raises(UsageError, match="must be >= 1"):
        run_tasks_bench([0], repeat=1)
