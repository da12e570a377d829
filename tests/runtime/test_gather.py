"""gather_to_root: the global value on one rank from the owners of each distinct block (the
output path of ``dtm run`` under mpirun), checked on the simulator for every layout family,
pending reductions included."""

from __future__ import annotations

import numpy as np
import pytest

from dtm_mpi.comm.sim import SimComm, run_ranks
from dtm_mpi.ir.types import DType, TensorType
from dtm_mpi.runtime.executor import gather_to_root
from dtm_mpi.sharding import block_owners
from tests.sharding.sharding_helpers import MESHES, layouts, source_locals


@pytest.mark.parametrize("mesh_name", ["1", "3", "2x2"])
@pytest.mark.parametrize("shape", [(5, 7), (10,), ()])
@pytest.mark.parametrize("root", [0, -1])
def test_gather_to_root_equals_the_global_value(
    mesh_name: str, shape: tuple[int, ...], root: int
) -> None:
    mesh = MESHES[mesh_name]
    root = root % mesh.size
    rng = np.random.default_rng(7)
    g = rng.integers(-50, 50, size=shape).astype(np.float64)
    for layout in layouts(mesh.axis_names, len(shape)):
        t = TensorType(DType.F64, shape, layout)
        blocks = source_locals(g, t, mesh, rng)

        def body(
            comm: SimComm, t: TensorType = t, blocks: list[np.ndarray] = blocks
        ) -> tuple[np.ndarray | None, int]:
            value = gather_to_root(t, blocks[comm.rank], comm, root)
            return value, comm.stats.bytes_sent

        got = run_ranks(mesh, body)
        for r, (value, _) in enumerate(got):
            if r == root:
                assert value is not None and value.shape == g.shape
                np.testing.assert_array_equal(value, g, err_msg=str(layout))
            else:
                assert value is None
        if layout.partial is None:  # each element crosses once, and only if not at the root
            owners = block_owners(shape, layout, mesh)
            want = sum(g[region].nbytes for owner, region in owners if owner != root)
            assert sum(b for _, b in got) == want, str(layout)
