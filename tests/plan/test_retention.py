"""The planner counts the collective outputs the MPI path keeps by the same numbers the
communication layer keeps them by (``dtm_mpi.sharding.retention``: ``plan/`` imports nothing
from ``comm/``)."""

from __future__ import annotations

from dtm_mpi.comm import buffers
from dtm_mpi.sharding.retention import ALIGN_FROM, kept_bytes


def test_the_comm_layer_keeps_buffers_by_the_planners_numbers() -> None:
    assert buffers.ALIGN_FROM == ALIGN_FROM


def test_kept_bytes_bounds() -> None:
    assert kept_bytes(ALIGN_FROM - 1) == 0
    assert kept_bytes(ALIGN_FROM) == ALIGN_FROM
    assert kept_bytes(64 << 20) == 64 << 20  # every size: a fresh big buffer page-faults


def test_the_cache_keeps_a_large_output_for_the_next_call() -> None:
    """A 64 MiB output freed by its user is handed back on the op's next call (no fresh
    mapping to page-fault), and a buffer still held is never handed out twice."""
    cache, key = buffers.OutputCache(), object()
    first = cache.get(key, (16 << 20,), "float32", True)
    first[0], first[-1] = 123.0, 456.0  # a fresh mapping would be zeros
    del first
    again = cache.get(key, (16 << 20,), "float32", True)
    assert (again[0], again[-1]) == (123.0, 456.0)
    other = cache.get(key, (16 << 20,), "float32", True)  # ``again`` is still held
    assert other.ctypes.data != again.ctypes.data
