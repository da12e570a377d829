"""The planner counts the collective outputs the MPI path keeps by the same numbers the
communication layer keeps them by (``dtm_mpi.sharding.retention``: ``plan/`` imports nothing
from ``comm/``)."""

from __future__ import annotations

from dtm_mpi.comm import buffers
from dtm_mpi.sharding.retention import ALIGN_FROM, REUSE_UP_TO, kept_bytes


def test_the_comm_layer_keeps_buffers_by_the_planners_numbers() -> None:
    assert buffers.ALIGN_FROM == ALIGN_FROM
    assert buffers.OutputCache.REUSE_UP_TO == REUSE_UP_TO


def test_kept_bytes_bounds() -> None:
    assert kept_bytes(ALIGN_FROM - 1) == 0
    assert kept_bytes(ALIGN_FROM) == ALIGN_FROM
    assert kept_bytes(REUSE_UP_TO) == REUSE_UP_TO
    assert kept_bytes(REUSE_UP_TO + 1) == 0
