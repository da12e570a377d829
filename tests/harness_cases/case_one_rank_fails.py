"""Harness self-test case (not collected by the suite): rank 1 fails an assertion alone."""

import pytest


@pytest.mark.mpi(min_size=2)
def test_rank1_assert(comm):
    assert comm.Get_rank() != 1, "rank 1 disagrees on purpose"


@pytest.mark.mpi(min_size=2)
def test_after_the_failure_still_runs(comm):
    assert comm.allreduce(1) == comm.Get_size()
