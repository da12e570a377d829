"""The communication interface: the only way the executor moves data between ranks.

Two implementations: the in-process simulator (:mod:`dtm_mpi.comm.sim`, N ranks as threads of
one process, for unit tests and ``dtm run --sim N``) and MPI (:mod:`dtm_mpi.comm.mpi_comm`). Every method is
collective over the group of ranks along ``axes`` (the ranks equal to this one on every other
mesh axis, in :meth:`MeshShape.group_of` order) unless it says otherwise, and every wait is
bounded: a peer that never arrives raises :class:`~dtm_mpi.errors.CommTimeoutError` naming the
operation and the axes.

Sizes never travel at run time: the per-rank specs (``dtm_mpi.sharding.steps``) carry every
extent, count and region, computed identically by every rank from (plan, mesh, rank).
Reductions fold contributions left to right in group order, so a result does not depend on
timing or on which rank arrives first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.steps import (
    AllgatherSpec,
    AllreduceSpec,
    ExchangeSpec,
    ReduceScatterSpec,
    allgather_traffic,
    allreduce_moved_items,
    exchange_traffic,
    reduce_scatter_traffic,
)

__all__ = [
    "Comm",
    "CommStats",
    "Completed",
    "Pending",
    "allgather_traffic",
    "allreduce_moved",
    "broadcast_traffic",
    "exchange_traffic",
    "reduce_scatter_traffic",
]


# The logical bytes a member sends and receives in each collective: the step-kind table's own
# formulas (dtm_mpi.sharding.steps, re-exported here), shared by every Comm implementation.


def allreduce_moved(x: np.ndarray, group_size: int, position: int) -> int:
    """The logical bytes one member sends (= receives) in an allreduce of ``x``: a
    reduce-scatter of the flat array in §5 pieces, then an allgather of the reduced pieces
    (the accounting of ``dtm_mpi.sharding.redistribute``)."""
    return allreduce_moved_items(x.size, group_size, position) * x.itemsize


def broadcast_traffic(nbytes: int, group_size: int, is_root: bool) -> tuple[int, int]:
    """The root sends its block to every other member; the others receive it."""
    return ((group_size - 1) * nbytes, 0) if is_root else (0, nbytes)


@dataclass(slots=True)
class CommStats:
    """What one rank's communicator did: calls per operation and bytes to/from other ranks."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes_sent: int = 0
    bytes_received: int = 0
    _tallies: dict[tuple[str, int, int], list[int]] = field(default_factory=dict, repr=False)

    def record(self, op: str, sent: int, received: int) -> None:
        self.calls[op] += 1
        self.bytes_sent += sent
        self.bytes_received += received

    def tally(self, op: str, sent: int, received: int) -> list[int]:
        """A counter cell for an operation that repeats with the same traffic: each
        ``cell[0] += 1`` counts as one :meth:`record` once :meth:`settle` runs (the cheapest
        accounting for the hot path of small collectives). Operations with the same traffic
        share a cell."""
        return self._tallies.setdefault((op, sent, received), [0])

    def settle(self) -> CommStats:
        """Fold the tallied calls into the totals; returns self."""
        for (op, sent, received), cell in self._tallies.items():
            n, cell[0] = cell[0], 0
            if n:
                self.calls[op] += n
                self.bytes_sent += n * sent
                self.bytes_received += n * received
        return self


class Pending(Protocol):
    """A collective started and not yet waited for (:meth:`Comm.start_allreduce`,
    :meth:`Comm.start_allgather`)."""

    def test(self) -> bool:
        """Progress it; True once complete (never blocks)."""
        ...

    def wait(self) -> np.ndarray:
        """Its result, within the run's deadline (raises as the blocking call would)."""
        ...


@dataclass(frozen=True, slots=True)
class Completed:
    """A collective that completed when it was started (a communicator without non-blocking
    collectives runs the blocking one)."""

    value: np.ndarray

    def test(self) -> bool:
        return True

    def wait(self) -> np.ndarray:
        return self.value


class Comm(Protocol):
    """One rank's endpoint. ``rank`` is the rank on ``mesh`` (row-major coordinates)."""

    @property
    def rank(self) -> int: ...

    @property
    def mesh(self) -> MeshShape: ...

    @property
    def stats(self) -> CommStats: ...

    def allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> np.ndarray:
        """The members' arrays concatenated along ``spec.dim`` in group order.

        Collective: call on all ranks of the group."""
        ...

    def allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> np.ndarray:
        """The ``spec.op`` fold of the members' arrays in group order.

        Collective: call on all ranks of the group."""
        ...

    def start_allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> Pending:
        """:meth:`allreduce` started, to be waited for later (``x`` is not to be written
        until then): other work runs while it is in flight.

        Collective: call on all ranks of the group, in the same order as their other
        collectives on the group."""
        ...

    def start_allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> Pending:
        """:meth:`allgather` started, to be waited for later (``x`` is not to be written until
        then): a prefetched gather of a parameter stored sharded.

        Collective: call on all ranks of the group, in the same order as their other
        collectives on the group."""
        ...

    def reduce_scatter(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ReduceScatterSpec
    ) -> np.ndarray:
        """This member's piece of the ``spec.op`` fold of the members' arrays.

        Collective: call on all ranks of the group."""
        ...

    def exchange(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ExchangeSpec, what: str = "exchange"
    ) -> np.ndarray:
        """An alltoallv: send ``x[t.region]`` to each ``t`` in ``spec.sends`` and place what
        each peer sends at ``t.region`` of a new array of ``spec.out_shape`` (``spec.recvs``).
        ``what`` names the step in statistics (``all_to_all`` or ``exchange``).

        Collective: call on all ranks of the group."""
        ...

    def broadcast(self, x: np.ndarray, axes: tuple[str, ...], root: int) -> np.ndarray:
        """The array of the member at index ``root`` along ``axes``.

        Collective: call on all ranks of the group."""
        ...

    def send(self, x: np.ndarray, peer: int, tag: int) -> None:
        """Send ``x`` to rank ``peer`` (buffered: returns without waiting for the receiver)."""
        ...

    def flush(self) -> None:
        """Wait (bounded) until every send of this rank has been delivered."""
        ...

    def transient(self, spec: object) -> None:
        """Outputs of the step ``spec`` (a step spec of the plan) are not kept for reuse by
        its next call (:func:`~dtm_mpi.sharding.retention.keeps_gather_of`)."""
        ...

    def recv(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], peer: int, tag: int
    ) -> np.ndarray:
        """Receive the array rank ``peer`` sent with ``tag`` (a bounded wait)."""
        ...
