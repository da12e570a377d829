"""Phase ``backend`` under MPI: every rank opens the numpy backend with its BLAS limited to its
share of the node's CPUs (all the suite's ranks share one node here), unless the environment
sets a BLAS thread count."""

from __future__ import annotations

from typing import Any

import pytest

from dtm_mpi.config import blas_threads_share
from dtm_mpi.runtime.mpirun import open_backend_everywhere

pytestmark = pytest.mark.mpi


def test_every_rank_s_blas_uses_its_share_of_the_node(comm: Any, all_ranks: Any) -> None:
    from threadpoolctl import threadpool_info

    backend = open_backend_everywhere("numpy", comm)
    all_ranks(backend.kind.value == "numpy", f"backend {backend.description}")
    share = blas_threads_share(comm.Get_size())
    blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    if share is None:
        pytest.skip("the environment sets a BLAS thread count")
    all_ranks(blas and all(n == share for n in blas), f"BLAS threads {blas}, want {share}")
