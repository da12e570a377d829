"""Generated backward passes under real MPI (the MPI suite, at 2, 3 and 4 ranks): a subset of
the autodiff cases -- collectives, k-sharded matmuls, layer norm, softmax, a tp chain -- run
by the executor over MpiComm on a dp x tp mesh of the job's size give the reference's loss
and gradients."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dtm_mpi.comm.mpi_comm import MpiComm
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime.executor import Executor, gather_to_root
from dtm_mpi.runtime.mpirun import plan_groups
from dtm_mpi.runtime.reference import evaluate_function
from dtm_mpi.runtime.simulate import initial_blocks
from tests.ir.test_autodiff import CASES, build, draw

pytestmark = pytest.mark.mpi(min_size=2)
SUBSET = [
    "matmul-k-sharded",
    "reduce_scatter",
    "allgather",
    "layer_norm",
    "log_softmax",
    "chain",
    "max-dims",
    "slice",
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "exact"])
@pytest.mark.parametrize("name", SUBSET)
def test_backward_pass_under_mpi_matches_the_reference(
    comm: Any, name: str, deterministic: bool
) -> None:
    case = next(c for c in CASES if c.name == name)
    module, _ = build(case)
    entry = module.entry
    assert entry is not None
    size = comm.Get_size()
    binding = {"dp": 2, "tp": size // 2} if size % 2 == 0 and size > 2 else {"dp": 1, "tp": size}
    values = draw(module, case.positive, seed=4)
    want = evaluate_function(
        module, entry, tuple(values[p.name.lstrip("%")] for p in entry.params), 0
    )
    plan = compile_plan(module, mesh_for(module, size, binding))
    session = MpiSession(plan.mesh, timeout_s=60, world=comm, join=False)
    try:
        session.join_mesh(plan_groups(plan, deterministic))
        mc = MpiComm(session)
        rank = comm.Get_rank()
        results = Executor(plan, mc, "numpy", deterministic).run(
            initial_blocks(plan, rank, values), 0
        )
        for i, (spec, block) in enumerate(zip(entry.results, results, strict=True)):
            got = gather_to_root(spec.type, block, mc)
            if rank == 0:
                assert got is not None
                np.testing.assert_allclose(
                    got, want[i], rtol=1e-10, atol=1e-10, err_msg=f"{name} result {i} at {binding}"
                )
    finally:
        session.close()
