"""The in-process multi-rank simulator: N ranks as threads of one process.

Each rank runs the same SPMD code with its own :class:`SimComm`; collectives meet in a shared
:class:`SimWorld` (a rendezvous per group and call number), where each member's output is
computed with the reference group semantics of :mod:`dtm_mpi.sharding.collectives`. The
simulator checks what MPI cannot: every member of a group must call the *same* collective
(a mismatch is an error naming both ranks and calls). Every wait is bounded by the timeout,
and a rank that fails poisons the world, so its peers stop at their next wait instead of
waiting out the timeout. :func:`run_ranks` runs a function on every rank and raises one
:class:`~dtm_mpi.errors.RemoteFailureError` listing every rank's own failure.

For unit tests and debugging (``dtm run --sim N``) only: the MPI tests use real MPI.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from dtm_mpi.comm.interface import (
    CommStats,
    Completed,
    Pending,
    allgather_traffic,
    allreduce_moved,
    broadcast_traffic,
    exchange_traffic,
    reduce_scatter_traffic,
)
from dtm_mpi.errors import (
    CommError,
    CommTimeoutError,
    PoisonedError,
    RankFailure,
    RemoteFailureError,
)
from dtm_mpi.sharding.collectives import reduce_arrays
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.steps import AllgatherSpec, AllreduceSpec, ExchangeSpec, ReduceScatterSpec

__all__ = ["SimComm", "SimWorld", "run_ranks"]

T = TypeVar("T")


class SimWorld:
    """The shared state of one simulated job of ``mesh.size`` ranks."""

    def __init__(self, mesh: MeshShape, timeout_s: float) -> None:
        self.mesh = mesh
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._slots: dict[tuple[object, ...], dict[int, tuple[str, Any]]] = {}
        self._reads: dict[tuple[object, ...], int] = {}
        self._mail: dict[tuple[int, int, int], deque[np.ndarray]] = {}
        self.failures: dict[int, BaseException] = {}

    def fail(self, rank: int, exc: BaseException) -> None:
        with self._cond:
            self.failures.setdefault(rank, exc)
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], rank: int, what: str, axes: tuple[str, ...]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            others = {r: e for r, e in self.failures.items() if r != rank}
            if others:
                first = min(others)
                raise PoisonedError(others[first])
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(
                    f"rank {rank}: {what} on axes {','.join(axes) or '-'} did not complete "
                    f"within {self.timeout_s:g} s (DTM_TIMEOUT)",
                    op=what,
                    axis=",".join(axes) or None,
                    rank=rank,
                )
            self._cond.wait(left)

    def meet(
        self,
        rank: int,
        group: tuple[int, ...],
        seq: int,
        what: str,
        axes: tuple[str, ...],
        payload: Any,
    ) -> list[Any]:
        """Deposit ``payload`` for call ``seq`` of ``group`` and return every member's, in
        group order, once all have arrived. Collective: call on all ranks of the group."""
        key = (group, seq)
        position = group.index(rank)
        with self._cond:
            entry = self._slots.setdefault(key, {})
            entry[position] = (what, payload)
            self._cond.notify_all()
            self._wait(lambda: len(entry) == len(group), rank, what, axes)
            calls = {entry[i][0] for i in range(len(group))}
            if len(calls) > 1:
                detail = ", ".join(f"rank {group[i]}: {entry[i][0]}" for i in range(len(group)))
                raise CommError(
                    f"collective mismatch on axes {','.join(axes)} (call {seq} of group "
                    f"{list(group)}): {detail}",
                    rank=rank,
                )
            payloads = [entry[i][1] for i in range(len(group))]
            self._reads[key] = self._reads.get(key, 0) + 1
            if self._reads[key] == len(group):
                del self._slots[key], self._reads[key]
            return payloads

    def post(self, src: int, dst: int, tag: int, x: np.ndarray) -> None:
        with self._cond:
            self._mail.setdefault((src, dst, tag), deque()).append(x.copy())
            self._cond.notify_all()

    def take(self, src: int, dst: int, tag: int, what: str) -> np.ndarray:
        key = (src, dst, tag)
        with self._cond:
            self._wait(lambda: bool(self._mail.get(key)), dst, what, ())
            return self._mail[key].popleft()


class SimComm:
    """Rank ``rank``'s endpoint in a :class:`SimWorld` (implements ``Comm``)."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world = world
        self._rank = rank
        self._seq: dict[tuple[int, ...], int] = {}
        self._stats = CommStats()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def mesh(self) -> MeshShape:
        return self.world.mesh

    @property
    def stats(self) -> CommStats:
        return self._stats

    def _meet(self, axes: tuple[str, ...], what: str, payload: Any) -> tuple[list[Any], int]:
        group = self.mesh.group_of(self._rank, axes)
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        return self.world.meet(self._rank, group, seq, what, axes, payload), group.index(self._rank)

    def allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> np.ndarray:
        blocks, _ = self._meet(axes, "allgather", x)
        out = np.concatenate(blocks, axis=spec.dim)
        self._stats.record("allgather", *allgather_traffic(x.nbytes, out.nbytes, len(blocks)))
        return out

    def allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> np.ndarray:
        contribs, pos = self._meet(axes, "allreduce", x)
        moved = allreduce_moved(x, len(contribs), pos)
        self._stats.record("allreduce", moved, moved)
        return reduce_arrays(contribs, spec.op)

    def start_allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> Pending:
        """The simulator completes it at once (its ranks are threads meeting in order)."""
        return Completed(self.allreduce(x, axes, spec))

    def start_allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> Pending:
        """The simulator completes it at once (its ranks are threads meeting in order)."""
        return Completed(self.allgather(x, axes, spec))

    def reduce_scatter(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ReduceScatterSpec
    ) -> np.ndarray:
        contribs, pos = self._meet(axes, "reduce_scatter", x)
        start, length = spec.pieces[pos]
        index = [slice(None)] * x.ndim
        index[spec.dim] = slice(start, start + length)
        pieces = [np.array(c[tuple(index)], order="C") for c in contribs]
        out = reduce_arrays(pieces, spec.op)
        traffic = reduce_scatter_traffic(x.nbytes, out.nbytes, len(contribs))
        self._stats.record("reduce_scatter", *traffic)
        return out

    def exchange(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ExchangeSpec, what: str = "exchange"
    ) -> np.ndarray:
        members, _ = self._meet(axes, what, (x, spec))
        by_rank = {s.group[s.position]: (a, s) for a, s in members}
        out = np.empty(spec.out_shape, dtype=x.dtype)
        for recv in spec.recvs:
            src, src_spec = by_rank[recv.peer]
            (send,) = [t for t in src_spec.sends if t.peer == self._rank]
            out[recv.region] = src[send.region]
        self._stats.record(what, *exchange_traffic(spec, self._rank, x.itemsize))
        return out

    def broadcast(self, x: np.ndarray, axes: tuple[str, ...], root: int) -> np.ndarray:
        blocks, pos = self._meet(axes, "broadcast", x)
        self._stats.record("broadcast", *broadcast_traffic(x.nbytes, len(blocks), pos == root))
        return np.array(blocks[root], copy=True)

    def transient(self, spec: object) -> None:
        pass  # nothing is kept between calls here

    def send(self, x: np.ndarray, peer: int, tag: int) -> None:
        self.world.post(self._rank, peer, tag, x)
        self._stats.record("send", x.nbytes, 0)

    def flush(self) -> None:
        """Sends are delivered to the shared mailbox at once: nothing to wait for."""

    def recv(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], peer: int, tag: int
    ) -> np.ndarray:
        x = self.world.take(peer, self._rank, tag, "recv")
        if x.shape != shape or x.dtype != dtype:
            raise CommError(
                f"rank {self._rank}: recv from rank {peer} tag {tag} expected {dtype}{list(shape)}, "
                f"got {x.dtype}{list(x.shape)}",
                rank=self._rank,
            )
        self._stats.record("recv", 0, x.nbytes)
        return x


def run_ranks(
    mesh: MeshShape,
    fn: Callable[[SimComm], T],
    *,
    timeout_s: float = 60.0,
    phase: str = "run",
) -> list[T]:
    """Run ``fn`` on every rank of ``mesh`` (one thread each) and return the results in rank
    order. If any rank raises, raise one :class:`RemoteFailureError` listing each failing
    rank's own error (ranks stopped only because a peer failed are not listed)."""
    world = SimWorld(mesh, timeout_s)
    results: list[Any] = [None] * mesh.size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(SimComm(world, rank))
        except BaseException as exc:  # reported below, for every rank
            errors[rank] = exc
            world.fail(rank, exc)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"dtm-sim-rank-{r}", daemon=True)
        for r in range(mesh.size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4 + 10)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise CommTimeoutError(
            f"simulated rank(s) {stuck} did not finish within {timeout_s * 4 + 10:g} s",
            op=phase,
        )
    own = {r: e for r, e in errors.items() if not isinstance(e, PoisonedError)}
    if own:
        failures = tuple(
            RankFailure(r, getattr(e, "phase", None) or phase, _describe(e))
            for r, e in sorted(own.items())
        )
        raise RemoteFailureError(phase, failures) from own[min(own)]
    return results


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return text if text else type(exc).__name__
