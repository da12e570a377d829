"""The MPI implementation of the communication interface (:class:`~dtm_mpi.comm.interface.Comm`).

Every operation is mpi4py's non-blocking buffer call on contiguous numpy arrays (no pickling
on the data path) on the group communicator of its axes, followed by the session's bounded
wait. Uneven blocks use the v-variants with counts and displacements from the per-rank step
specs, so no sizes are exchanged at run time. Data movement sends each element as an
unsigned integer of its size (every dtype, ``f16`` included, moves bit-exactly); reductions
use MPI's own operations where MPI has the type, and otherwise, or in deterministic mode
(``DTM_DETERMINISTIC=1``), gather the contributions and fold them left to right in group
order, bit-identical to the simulator whatever MPI's algorithm.

Messages above ``DTM_MAX_MSG_ELEMS`` elements (default ``2**31 - 1``, the limit of an MPI
count) are split into rounds of at most that many elements per peer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dtm_mpi.comm.interface import CommStats, allreduce_moved
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.errors import CommError
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.sharding.collectives import reduce_arrays
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.steps import AllgatherSpec, AllreduceSpec, ExchangeSpec, ReduceScatterSpec

__all__ = ["MpiComm"]


class MpiComm:
    """This rank's endpoint over an :class:`MpiSession` (implements ``Comm``)."""

    def __init__(
        self, session: MpiSession, *, deterministic: bool = False, max_msg_elems: int = 2**31 - 1
    ) -> None:
        mpi = session.MPI
        self.MPI = mpi
        self.session = session
        self.deterministic = deterministic
        self.limit = max(1, int(max_msg_elems))
        self._stats = CommStats()
        self._sends: list[tuple[Any, np.ndarray]] = []
        self._move = {1: mpi.UINT8_T, 2: mpi.UINT16_T, 4: mpi.UINT32_T, 8: mpi.UINT64_T}
        self._reduce_types = {
            "f4": mpi.FLOAT, "f8": mpi.DOUBLE, "i1": mpi.INT8_T, "i4": mpi.INT32_T,
            "i8": mpi.INT64_T, "u1": mpi.UINT8_T,
        }  # fmt: skip
        self._ops = {
            ReduceOp.SUM: mpi.SUM, ReduceOp.PROD: mpi.PROD, ReduceOp.MAX: mpi.MAX,
            ReduceOp.MIN: mpi.MIN,
        }  # fmt: skip

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def mesh(self) -> MeshShape:
        return self.session.mesh

    @property
    def stats(self) -> CommStats:
        return self._stats

    # -- helpers ------------------------------------------------------------------------------
    def _flat(self, x: np.ndarray) -> np.ndarray:
        """``x`` as contiguous unsigned integers of its item size (a view where possible)."""
        a = np.ascontiguousarray(x).reshape(-1)
        return a.view(f"u{a.itemsize}") if a.size else np.empty(0, dtype=f"u{a.itemsize}")

    def _allgatherv(self, comm: Any, send: np.ndarray, counts: list[int], what: str, axes: tuple[str, ...]) -> np.ndarray:  # fmt: skip
        """Collective: call on all ranks of the group. The members' flat arrays, concatenated."""
        mtype = self._move[send.itemsize]
        total = sum(counts)
        out = np.empty(total, dtype=send.dtype)
        rounds = max([-(-c // self.limit) for c in counts] + [1])
        for r in range(rounds):
            lo = r * self.limit
            part = [max(0, min(self.limit, c - lo)) for c in counts]
            piece = np.empty(sum(part), dtype=send.dtype)
            displs = list(np.cumsum([0, *part[:-1]]))
            mine = send[lo : lo + part[comm.Get_rank()]]
            req = comm.Iallgatherv([mine, mtype], [piece, (part, displs), mtype])
            self.session.wait(req, what, axes)
            starts = np.cumsum([0, *counts[:-1]])
            for j, (s, n) in enumerate(zip(displs, part, strict=True)):
                out[starts[j] + lo : starts[j] + lo + n] = piece[s : s + n]
        return out

    def _alltoallv(self, comm: Any, chunks: list[np.ndarray], recv_counts: list[int], dtype: np.dtype[Any], what: str, axes: tuple[str, ...], max_count: int) -> list[np.ndarray]:  # fmt: skip
        """Collective: call on all ranks of the group. ``chunks[j]`` (flat) goes to member
        ``j``; returns what each member sent here. ``max_count`` bounds every transfer of the
        group and must be the same on every member."""
        itemsize = np.dtype(dtype).itemsize
        mtype = self._move[itemsize]
        udt = np.dtype(f"u{itemsize}")
        send_counts = [c.size for c in chunks]
        outs = [np.empty(n, dtype=udt) for n in recv_counts]
        # the same number of rounds on every member: from a bound all members share
        rounds = max(1, -(-max_count // self.limit))
        for r in range(rounds):
            lo = r * self.limit
            sc = [max(0, min(self.limit, c - lo)) for c in send_counts]
            rc = [max(0, min(self.limit, c - lo)) for c in recv_counts]
            sbuf = (
                np.concatenate([c[lo : lo + n] for c, n in zip(chunks, sc, strict=True)])
                if chunks else np.empty(0, dtype=udt)
            )  # fmt: skip
            rbuf = np.empty(sum(rc), dtype=udt)
            sd = list(np.cumsum([0, *sc[:-1]]))
            rd = list(np.cumsum([0, *rc[:-1]]))
            req = comm.Ialltoallv([sbuf, (sc, sd), mtype], [rbuf, (rc, rd), mtype])
            self.session.wait(req, what, axes)
            for j, (s, n) in enumerate(zip(rd, rc, strict=True)):
                outs[j][lo : lo + n] = rbuf[s : s + n]
        return [o.view(dtype) for o in outs]

    def _reducible(self, x: np.ndarray) -> Any | None:
        if self.deterministic:
            return None
        return self._reduce_types.get(x.dtype.str[1:])

    # -- the interface ------------------------------------------------------------------------
    def allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        comm = self.session.group(axes)
        flat = self._allgatherv(comm, self._flat(x), list(spec.counts), "allgather", axes)
        values = flat.view(x.dtype)
        shape = list(x.shape)
        blocks, start = [], 0
        for extent, count in zip(spec.extents, spec.counts, strict=True):
            shape[spec.dim] = extent
            blocks.append(values[start : start + count].reshape(shape))
            start += count
        out = np.concatenate(blocks, axis=spec.dim) if len(blocks) > 1 else blocks[0].copy()
        self._stats.record("allgather", (len(blocks) - 1) * x.nbytes, out.nbytes - x.nbytes)
        return out

    def allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        comm = self.session.group(axes)
        k = len(spec.group)
        mtype = self._reducible(x)
        if mtype is None:  # gather and fold in group order
            flat = self._allgatherv(comm, self._flat(x), [x.size] * k, "allreduce", axes)
            parts = flat.view(x.dtype).reshape(k, *x.shape)
            out = reduce_arrays(list(parts), spec.op)
        else:
            send = np.ascontiguousarray(x).reshape(-1)
            out = np.empty_like(send)
            for lo in range(0, max(send.size, 1), self.limit):
                hi = min(send.size, lo + self.limit)
                req = comm.Iallreduce(
                    [send[lo:hi], mtype], [out[lo:hi], mtype], op=self._ops[spec.op]
                )
                self.session.wait(req, "allreduce", axes)
            out = out.reshape(x.shape)
        moved = allreduce_moved(x, k, spec.position)
        self._stats.record("allreduce", moved, moved)
        return out

    def reduce_scatter(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ReduceScatterSpec
    ) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        comm = self.session.group(axes)
        index = [slice(None)] * x.ndim
        pieces = []
        for start, length in spec.pieces:
            index[spec.dim] = slice(start, start + length)
            pieces.append(np.ascontiguousarray(x[tuple(index)]))
        mine = pieces[spec.position]
        mtype = self._reducible(x)
        if mtype is not None and all(p.size <= self.limit for p in pieces):
            packed = np.concatenate([p.reshape(-1) for p in pieces]) if pieces else x.reshape(-1)
            out = np.empty(mine.shape, dtype=x.dtype)
            req = comm.Ireduce_scatter(
                [packed, mtype], [out.reshape(-1), mtype], [p.size for p in pieces],
                op=self._ops[spec.op],
            )  # fmt: skip
            self.session.wait(req, "reduce_scatter", axes)
            self._stats.record(
                "reduce_scatter", x.nbytes - out.nbytes, (len(pieces) - 1) * out.nbytes
            )
            return out
        # every member's contribution to this member's piece, in group order, then a fold
        got = self._alltoallv(
            comm, [self._flat(p) for p in pieces], [mine.size] * len(pieces), x.dtype,
            "reduce_scatter", axes, max(spec.counts, default=0),
        )  # fmt: skip
        out = reduce_arrays([g.reshape(mine.shape) for g in got], spec.op)
        self._stats.record("reduce_scatter", x.nbytes - out.nbytes, (len(pieces) - 1) * out.nbytes)
        return out

    def exchange(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ExchangeSpec, what: str = "exchange"
    ) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        comm = self.session.group(axes)
        k = len(spec.group)
        where = {r: j for j, r in enumerate(spec.group)}
        empty = np.empty(0, dtype=f"u{x.itemsize}")
        chunks = [empty] * k
        for t in spec.sends:
            chunks[where[t.peer]] = self._flat(x[t.region])
        counts = [0] * k
        for t in spec.recvs:
            counts[where[t.peer]] = t.count
        got = self._alltoallv(comm, chunks, counts, x.dtype, what, axes, spec.max_count)
        out = np.empty(spec.out_shape, dtype=x.dtype)
        for t in spec.recvs:
            out[t.region] = got[where[t.peer]].reshape(out[t.region].shape)
        sent = sum(t.count for t in spec.sends if t.peer != self.rank)
        received = sum(t.count for t in spec.recvs if t.peer != self.rank)
        self._stats.record(what, sent * x.itemsize, received * x.itemsize)
        return out

    def broadcast(self, x: np.ndarray, axes: tuple[str, ...], root: int) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        comm = self.session.group(axes)
        buf = np.array(x, order="C")
        flat = self._flat(buf)
        mtype = self._move[buf.itemsize]
        for lo in range(0, max(flat.size, 1), self.limit):
            req = comm.Ibcast([flat[lo : lo + self.limit], mtype], root=root)
            self.session.wait(req, "broadcast", axes)
        k = int(comm.Get_size())
        is_root = int(comm.Get_rank()) == root
        self._stats.record(
            "broadcast", (k - 1) * x.nbytes if is_root else 0, 0 if is_root else x.nbytes
        )
        return buf

    def send(self, x: np.ndarray, peer: int, tag: int) -> None:
        """Point-to-point (not collective): posts the transfer and returns; :meth:`flush`
        (or the end of the step) waits for it, bounded."""
        flat = self._flat(np.array(x, order="C"))  # a private copy: the caller may reuse x
        mtype = self._move[x.itemsize]
        for lo in range(0, max(flat.size, 1), self.limit):
            req = self.session.cart.Isend([flat[lo : lo + self.limit], mtype], dest=peer, tag=tag)
            self._sends.append((req, flat))
        self._stats.record("send", x.nbytes, 0)

    def flush(self) -> None:
        """Wait (bounded) for every posted send."""
        while self._sends:
            req, _ = self._sends[0]
            self.session.wait(req, "send")
            self._sends.pop(0)

    def recv(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], peer: int, tag: int
    ) -> np.ndarray:
        """Point-to-point (not collective): a bounded wait for the paired send."""
        out = np.empty(shape, dtype=dtype)
        flat = self._flat(out)
        mtype = self._move[out.itemsize]
        status = self.MPI.Status()
        for lo in range(0, max(flat.size, 1), self.limit):
            part = flat[lo : lo + self.limit]
            req = self.session.cart.Irecv([part, mtype], source=peer, tag=tag)
            self.session.wait(req, "recv", status=status)
            if status.Get_count(mtype) != part.size:
                raise CommError(
                    f"rank {self.rank}: recv from rank {peer} tag {tag} got "
                    f"{status.Get_count(mtype)} elements, expected {part.size}",
                    rank=self.rank,
                )
        self._stats.record("recv", 0, out.nbytes)
        return out
