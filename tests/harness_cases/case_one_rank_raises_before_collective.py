"""Harness self-test case (not collected by the suite): rank 1 raises while its peers block in
a collective it will never enter; the job must abort within seconds."""

import numpy as np
import pytest


@pytest.mark.mpi(min_size=2)
def test_rank1_raises(comm):
    if comm.Get_rank() == 1:
        raise RuntimeError("rank 1 broke before the allreduce")
    buf = np.ones(4)
    comm.Allreduce(np.ones(4), buf)
