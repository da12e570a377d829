"""The MPI implementation of the communication interface (:class:`~dtm_mpi.comm.interface.Comm`).

Every operation is an mpi4py buffer call on contiguous numpy arrays (no pickling on the data
path) on the group communicator of its axes, within the session's deadline: MPI's blocking
call under the watchdog where it runs (``MPI_THREAD_MULTIPLE``), else the non-blocking call and
the session's polling wait. The first call of a step spec records what later calls of it need
(communicator, datatype, operation, byte counts), so repeated steps go straight to MPI. Uneven blocks use the v-variants with counts and displacements from the per-rank step
specs, so no sizes are exchanged at run time. Data movement sends each element as an
unsigned integer of its size (every dtype, ``f16`` included, moves bit-exactly); reductions
use MPI's own operations where MPI has the type, and otherwise, or in deterministic mode
(``DTM_DETERMINISTIC=1``), gather the contributions and fold them left to right in group
order, bit-identical to the simulator whatever MPI's algorithm.

Messages above ``DTM_MAX_MSG_ELEMS`` elements (default ``2**31 - 1``, the limit of an MPI
count) are split into rounds of at most that many elements per peer.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dtm_mpi.comm.buffers import OutputCache, empty_aligned
from dtm_mpi.comm.frames import crc32c
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
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.config import get_config
from dtm_mpi.errors import CommError, PayloadIntegrityError
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.sharding.collectives import reduce_arrays
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.retention import ALIGN_FROM
from dtm_mpi.sharding.steps import (
    AllgatherSpec,
    AllreduceSpec,
    ExchangeSpec,
    ReduceScatterSpec,
    back_to_back,
)

__all__ = ["ExchangePlan", "MpiComm", "reduce_scatter_call", "starts_of"]


def starts_of(counts: list[int]) -> list[int]:
    """Displacements of consecutive runs of ``counts`` elements (plain Python: these lists
    are short, and numpy's per-call overhead would dominate small messages)."""
    return [0, *itertools.accumulate(counts[:-1])]


class ExchangePlan:
    """Counts, displacements and the zero-copy decisions of one exchange on one rank."""

    __slots__ = (
        "rc",
        "rd",
        "recv_in_place",
        "recv_offsets",
        "sc",
        "sd",
        "send_run",
        "spec",
        "traffic",
    )

    def __init__(self, spec: ExchangeSpec, in_shape: tuple[int, ...], rank: int) -> None:
        self.spec = spec
        k = len(spec.group)
        where = {r: j for j, r in enumerate(spec.group)}
        self.sc, self.rc = [0] * k, [0] * k
        for t in spec.sends:
            self.sc[where[t.peer]] = t.count
        for t in spec.recvs:
            self.rc[where[t.peer]] = t.count
        self.sd, self.rd = starts_of(self.sc), starts_of(self.rc)
        self.recv_offsets = [self.rd[where[t.peer]] for t in spec.recvs]
        self.send_run = back_to_back(in_shape, [t.region for t in spec.sends])
        total = math.prod(spec.out_shape)
        self.recv_in_place = back_to_back(spec.out_shape, [t.region for t in spec.recvs]) == (
            0,
            total,
        )
        self.traffic = exchange_traffic(spec, rank, 1)  # in elements


def reduce_scatter_call(counts: list[int]) -> tuple[str, tuple[Any, ...]]:
    """The MPI call of a reduce-scatter with these per-member ``counts`` and its arguments
    before ``op``: ``Reduce_scatter_block`` when they are all equal, else ``Reduce_scatter``
    with the counts. Decided by the counts alone (global: the same on every member), so every
    member makes the same call on its first and later calls, whether its buffers are on the
    host or (:class:`~dtm_mpi.comm.device.DeviceComm`) on a device."""
    if len(set(counts)) <= 1:
        return "Reduce_scatter_block", ()
    return "Reduce_scatter", (counts,)


class _SideCall:
    """A collective (``what``: allreduce, allgather) run by this rank's side thread
    (:class:`_SideThread`): done when its blocking call returned; ``out`` its result."""

    __slots__ = ("axes", "done", "error", "out", "send", "session", "what")

    def __init__(
        self,
        session: MpiSession,
        out: np.ndarray,
        send: np.ndarray,
        axes: tuple[str, ...],
        what: str = "allreduce",
    ) -> None:
        self.session, self.out, self.send, self.axes, self.what = session, out, send, axes, what
        self.done = threading.Event()
        self.error: BaseException | None = None

    def test(self) -> bool:
        return self.done.is_set()

    def wait(self) -> np.ndarray:
        if not self.done.is_set():
            self.session.wait_event(self.done, self.what, self.axes)
        if self.error is not None:
            raise CommError(
                f"rank {self.session.rank}: overlapped {self.what} on {','.join(self.axes)} failed: {self.error}"
            ) from self.error
        return self.out


class _CheckedCall:
    """An overlapped collective in integrity mode: when waited for, its result is compared
    across the group (``check``: a collective on the group's main communicator, which the side
    thread does not use; every member waits for its buckets in the plan's order)."""

    __slots__ = ("check", "inner", "result")

    def __init__(self, inner: _SideCall, check: Callable[[np.ndarray], np.ndarray]) -> None:
        self.inner, self.check = inner, check
        self.result: np.ndarray | None = None

    def test(self) -> bool:
        return self.inner.test()

    def wait(self) -> np.ndarray:
        if self.result is None:
            self.result = self.check(self.inner.wait())
        return self.result


SEND_POLL_S = (20e-6, 200e-6)
"""The send thread's pauses between tests of its pending sends: the first, doubled after
each test up to the second."""


class _SendProgress:
    """Drives this rank's posted point-to-point sends from a thread of its own (with
    ``MPI_THREAD_MULTIPLE``), testing them with MPI's ``Testall`` (which moves every pending
    message, without Python's lock) and sleeping between tests: a message above MPI's eager
    size moves only while its sender is in MPI, which a rank inside a long kernel is not, so
    its receiver would wait for the whole kernel (a pipeline stage's send, then its next
    pass). It sleeps (:data:`SEND_POLL_S`) rather than blocking in ``Waitall``, whose busy
    poll took the core from the rank's own compute where ranks have no core to spare (the
    interleaved schedule: 465 against 270-313 ms per step on 2 cores). Only this thread
    completes the requests; :meth:`MpiComm.flush` waits (bounded) for :attr:`empty`."""

    def __init__(self, testall: Callable[[list[Any]], bool]) -> None:
        self.testall = testall
        self.cond = threading.Condition()
        self.pending: list[tuple[Any, np.ndarray]] = []
        self.empty = threading.Event()
        self.empty.set()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def add(self, req: Any, buf: np.ndarray) -> None:
        with self.cond:
            self.pending.append((req, buf))
            self.empty.clear()
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="dtm-sends", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending:
                    self.cond.wait()
                batch = list(self.pending)
            reqs = [req for req, _ in batch]
            pause, longest = SEND_POLL_S
            try:
                while not self.testall(reqs):
                    time.sleep(pause)
                    pause = min(2 * pause, longest)
            except BaseException as exc:  # handed to flush
                with self.cond:
                    self.error = exc
                    self.pending.clear()
                    self.empty.set()
                continue
            done = {id(req) for req, _ in batch}
            with self.cond:
                self.pending = [(r, b) for r, b in self.pending if id(r) not in done]
                if not self.pending:
                    self.empty.set()


FOLDED_RS_UP_TO = 4
FOLDED_RS_FROM = 128 << 10
"""A reduce-scatter over a group of ``p`` members, at most :data:`FOLDED_RS_UP_TO`, of at least
``FOLDED_RS_FROM * p * p`` bytes in all moves the pieces itself (one all-to-all: each member
gets every member's piece of its part) and folds them in group order, instead of calling MPI's
reduce-scatter: the same bytes on the wire, and with Open MPI 4.1 much faster for large arrays
(measured on 2 cores, 3 and 4 ranks oversubscribed: at 2 ranks 1.5-1.9x from 256 KiB to 1 MiB,
2.5-2.7x at 32 MiB, 5.5 ms against 25; at 4 ranks 1.4-1.7x at 4 and 8 MiB, 3.1x at 32 MiB, but
0.5-0.8x at 256 KiB and 1 MiB; at 3 ranks even to 1.13x at 8 MiB; over TCP 2.8x at 1 and 8 MiB
on a 1 Gbit/s link), where MPI's reduce-scatter moved about the whole array. Smaller arrays keep
MPI's call, bound once per op; larger groups too (MPI's algorithms for more ranks were not
measured here: groups of 2-4 were). The fold's order is the group's, whatever MPI's
algorithm."""


REPLICATED_RESULTS = ("allreduce", "allgather", "broadcast")
"""The collectives whose result every member of the group holds alike: integrity mode compares
the result's CRC32C across the group after each."""


class MpiComm:
    """This rank's endpoint over an :class:`MpiSession` (implements ``Comm``)."""

    def __init__(
        self,
        session: MpiSession,
        *,
        deterministic: bool = False,
        max_msg_elems: int = 2**31 - 1,
        integrity: bool | None = None,
    ) -> None:
        mpi = session.MPI
        self.MPI = mpi
        self.session = session
        self.side_thread = get_config().overlap
        # payload integrity mode (None: DTM_INTEGRITY decides)
        self.integrity = get_config().integrity if integrity is None else integrity
        self.deterministic = deterministic
        self.limit = max(1, int(max_msg_elems))
        self._stats = CommStats()
        self._sends: list[tuple[Any, np.ndarray]] = []
        # sends driven by a thread of their own where MPI allows it (else flush drives them)
        self._progress = (
            _SendProgress(mpi.Request.Testall) if session.watchdog is not None else None
        )
        self._move = {1: mpi.UINT8_T, 2: mpi.UINT16_T, 4: mpi.UINT32_T, 8: mpi.UINT64_T}
        self._by_dtype = {  # the types MPI reduces natively
            np.dtype(k): v
            for k, v in (
                ("f4", mpi.FLOAT),
                ("f8", mpi.DOUBLE),
                ("i1", mpi.INT8_T),
                ("i4", mpi.INT32_T),
                ("i8", mpi.INT64_T),
                ("u1", mpi.UINT8_T),
            )
        }
        self._plans: dict[tuple[int, tuple[int, ...]], ExchangePlan] = {}
        # bound calls for repeated steps, by id of the step spec: (spec, dtype, axes, shape, fn)
        self._prepared: dict[int, tuple[Any, Any, tuple[str, ...], tuple[int, ...], Any]] = {}
        self._bcast: dict[tuple[Any, ...], Callable[[np.ndarray], np.ndarray]] = {}
        self._outputs = OutputCache()
        self._transient: set[int] = set()  # ids of step specs whose outputs are not kept
        self._udt = {n: np.dtype(f"u{n}") for n in (1, 2, 4, 8)}
        self._ops = {
            ReduceOp.SUM: mpi.SUM,
            ReduceOp.PROD: mpi.PROD,
            ReduceOp.MAX: mpi.MAX,
            ReduceOp.MIN: mpi.MIN,
        }
        if self.integrity:  # the collectives whose result every member holds alike
            for name in REPLICATED_RESULTS:
                setattr(self, name, self._audited(name, getattr(self, name)))

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def mesh(self) -> MeshShape:
        return self.session.mesh

    @property
    def stats(self) -> CommStats:
        return self._stats.settle()

    # -- helpers ------------------------------------------------------------------------------
    def _flat(self, x: np.ndarray) -> np.ndarray:
        """``x`` as contiguous unsigned integers of its item size (a view where possible)."""
        a = np.ascontiguousarray(x).reshape(-1)
        return a.view(f"u{a.itemsize}") if a.size else np.empty(0, dtype=f"u{a.itemsize}")

    def _allgatherv(
        self, comm: Any, send: np.ndarray, counts: list[int], what: str, axes: tuple[str, ...]
    ) -> np.ndarray:
        """Collective: call on all ranks of the group. The members' flat arrays, concatenated
        (received in place; messages above the limit go in rounds through a staging buffer)."""
        mtype = self._move[send.itemsize]
        out = empty_aligned(sum(counts), dtype=send.dtype)
        starts = starts_of(counts)
        if max(counts, default=0) <= self.limit:
            self.call(comm, "Allgatherv", what, axes, [send, mtype], [out, (counts, starts), mtype])
            return out
        rounds = max(-(-c // self.limit) for c in counts)
        me = int(comm.Get_rank())
        for r in range(rounds):
            lo = r * self.limit
            part = [max(0, min(self.limit, c - lo)) for c in counts]
            piece = empty_aligned(sum(part), dtype=send.dtype)
            displs = starts_of(part)
            self.call(
                comm,
                "Allgatherv",
                what,
                axes,
                [send[lo : lo + part[me]], mtype],
                [piece, (part, displs), mtype],
            )
            for j, (d, n) in enumerate(zip(displs, part, strict=True)):
                out[starts[j] + lo : starts[j] + lo + n] = piece[d : d + n]
        return out

    def _alltoallv(
        self,
        comm: Any,
        sbuf: np.ndarray,
        sc: list[int],
        rc: list[int],
        what: str,
        axes: tuple[str, ...],
        max_count: int,
    ) -> np.ndarray:
        """Collective: call on all ranks of the group. ``sbuf`` holds, in member order,
        ``sc[j]`` elements for member ``j``; returns the flat buffer of what each member sent
        here (``rc[j]`` elements each, in member order). ``max_count`` bounds every transfer
        of the group and is the same on every member, so all agree on the number of rounds."""
        mtype = self._move[sbuf.itemsize]
        rbuf = empty_aligned(sum(rc), dtype=sbuf.dtype)
        sd = starts_of(sc)
        rd = starts_of(rc)
        if max_count <= self.limit:
            self.call(
                comm, "Alltoallv", what, axes, [sbuf, (sc, sd), mtype], [rbuf, (rc, rd), mtype]
            )
            return rbuf
        for r in range(-(-max_count // self.limit)):
            lo = r * self.limit
            sc_r = [max(0, min(self.limit, c - lo)) for c in sc]
            rc_r = [max(0, min(self.limit, c - lo)) for c in rc]
            part = np.concatenate(
                [sbuf[d + lo : d + lo + n] for d, n in zip(sd, sc_r, strict=True)]
            )
            got = empty_aligned(sum(rc_r), dtype=sbuf.dtype)
            sd_r = starts_of(sc_r)
            rd_r = starts_of(rc_r)
            self.call(
                comm,
                "Alltoallv",
                what,
                axes,
                [part, (sc_r, sd_r), mtype],
                [got, (rc_r, rd_r), mtype],
            )
            for d, dr, n in zip(rd, rd_r, rc_r, strict=True):
                rbuf[d + lo : d + lo + n] = got[dr : dr + n]
        return rbuf

    def _checked_alltoallv(
        self,
        comm: Any,
        sbuf: np.ndarray,
        sc: list[int],
        rc: list[int],
        group: Sequence[int],
        what: str,
        axes: tuple[str, ...],
        max_count: int,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        """Integrity mode: :meth:`_alltoallv` with each piece's CRC32C computed by its sender
        before it leaves and sent after it (a 4-byte Alltoall); each receiver compares what
        arrived from every member, and names the sender of a damaged piece. ``into``: a flat
        buffer to receive into (returned) where one call moves everything."""
        from dtm_mpi.faults import corrupted

        sd, rd = starts_of(sc), starts_of(rc)
        sent = np.array(
            [crc32c(sbuf[d : d + n]) for d, n in zip(sd, sc, strict=True)], dtype=np.uint32
        )
        wire = corrupted(self.rank, what, sbuf)  # DTM_FAULT=RANK:WHAT:corrupt: in flight
        if into is not None and max_count <= self.limit:
            move = self._move[sbuf.itemsize]
            self.call(comm, "Alltoallv", what, axes, [wire, (sc, sd), move], [into, (rc, rd), move])
            rbuf = into
        else:
            rbuf = self._alltoallv(comm, wire, sc, rc, what, axes, max_count)
        theirs = np.empty(len(rc), dtype=np.uint32)
        mtype = self._move[4]
        self.call(comm, "Alltoall", "integrity", axes, [sent, mtype], [theirs, mtype])
        for j, (d, n) in enumerate(zip(rd, rc, strict=True)):
            got = crc32c(rbuf[d : d + n]) if n else 0
            if n and got != int(theirs[j]):
                raise PayloadIntegrityError(
                    f"{what} over {','.join(axes)} from rank {group[j]} to rank {self.rank}: "
                    f"the piece ({n * rbuf.itemsize} bytes) arrived with CRC32C {got:08x}, its "
                    f"sender's was {int(theirs[j]):08x}",
                    rank=self.rank,
                )
        return rbuf

    def _keep(
        self,
        spec: Any,
        x: np.ndarray,
        axes: tuple[str, ...],
        call: Any,
        what: str,
        send_meta: tuple[Any, ...],
        recv_meta: tuple[Any, ...] | None,
        extra: tuple[Any, ...],
        out_shape: tuple[int, ...],
        traffic: tuple[int, int],
    ) -> None:
        """Bind ``call`` for the next calls of ``spec`` with an input like ``x`` (see
        :meth:`MpiSession.bind`): the executor repeats its steps, and the bound call is what
        keeps small collectives within a few microseconds of raw MPI."""
        if self.session.watchdog is None:
            return
        new_out = None if recv_meta is None else self._new_out(spec, out_shape, x.dtype)
        tally = self._stats.tally(what, *traffic)
        fn = self.session.bind(call, what, axes, send_meta, recv_meta, extra, new_out, tally)
        self._prepared[id(spec)] = (spec, x.dtype, axes, x.shape, fn)

    def transient(self, spec: object) -> None:
        """Outputs of the step ``spec`` are not kept for reuse (a gather of a parameter
        stored sharded: freed after its uses, see ``sharding.retention``)."""
        self._transient.add(id(spec))

    def _new_out(self, key: object, shape: tuple[int, ...], dtype: Any) -> Any:
        """How a bound call gets its output: a reused page-aligned buffer from the output
        cache when large and not transient, else a plain allocation (as cheap as a cache
        lookup when small)."""
        if id(key) in self._transient:
            return functools.partial(empty_aligned, shape, dtype)
        if math.prod(shape) * dtype.itemsize >= ALIGN_FROM:
            return functools.partial(self._outputs.get, key, shape, dtype, True)
        return functools.partial(np.empty, shape, dtype)

    def _audited(self, name: str, run: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        """``run`` (collective ``name``, whose result every member of the group holds alike)
        followed by a comparison of the result's CRC32C across the group (integrity mode)."""

        def audited(x: np.ndarray, axes: tuple[str, ...], *rest: Any) -> np.ndarray:
            return self._checked_result(name, axes, run(x, axes, *rest))

        return audited

    def _checked_result(self, name: str, axes: tuple[str, ...], out: np.ndarray) -> np.ndarray:
        """``out`` (this member's result of collective ``name``) once the group compared
        their results' CRC32C (integrity mode). ``DTM_FAULT=RANK:NAME:corrupt`` flips a bit
        of it first, as if on its way in."""
        from dtm_mpi.faults import corrupted

        out = corrupted(self.rank, name, out)
        self._compare_results(name, axes, out)
        return out

    def _compare_results(self, name: str, axes: tuple[str, ...], out: np.ndarray) -> None:
        """Every member's CRC32C of its result of collective ``name`` on ``axes``, gathered:
        the same on every member, else one error on every member naming the odd rank(s)
        (by majority) or, with no majority, what each holds."""
        comm = self.session.group(axes)
        mine = np.array([crc32c(np.ascontiguousarray(out))], dtype=np.uint32)
        k = int(comm.Get_size())
        every = np.empty(k, dtype=np.uint32)
        self.call(
            comm, "Allgather", "integrity", axes, [mine, self._move[4]], [every, self._move[4]]
        )
        if len(set(every.tolist())) == 1:
            return
        world = comm.Get_group().Translate_ranks(list(range(k)), self.session.cart.Get_group())
        counts: dict[int, list[int]] = {}
        for g, crc in enumerate(every.tolist()):
            counts.setdefault(int(crc), []).append(int(world[g]))
        ranked = sorted(counts.values(), key=len, reverse=True)
        if len(ranked[0]) > k // 2:
            odd = sorted(r for group in ranked[1:] for r in group)
            what = f"rank(s) {', '.join(map(str, odd))} hold other bytes than the rest"
        else:
            what = "; ".join(
                f"rank(s) {', '.join(map(str, rs))}: CRC32C {crc:08x}"
                for crc, rs in sorted(counts.items(), key=lambda kv: kv[1][0])
            )
        raise PayloadIntegrityError(
            f"{name} over {','.join(axes)}: the members' results differ ({what}; "
            f"{out.nbytes} bytes each)",
            rank=self.rank,
        )

    def call(
        self, comm: Any, name: str, what: str, axes: tuple[str, ...], *args: Any, **kwargs: Any
    ) -> None:
        """Run MPI operation ``name`` (e.g. ``Allreduce``) on ``comm`` within the deadline:
        the blocking call under the watchdog's guard where the watchdog runs (MPI's fastest
        paths), else the non-blocking variant and the session's polling wait."""
        session = self.session
        if session.watchdog is not None:
            session.guarded(getattr(comm, name), what, axes, *args, **kwargs)
        else:
            session.check()
            session.wait(
                getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kwargs), what, axes
            )

    def folds_reduce_scatter(self, nbytes: int, members: int) -> bool:
        """Whether a reduce-scatter of ``nbytes`` over ``members`` moves the pieces by an
        all-to-all and folds them here rather than calling MPI's (in integrity mode, so that
        what moves is checked; else for large arrays in small groups: :data:`FOLDED_RS_FROM`).
        The same on every member; the device path follows it (the calls must pair)."""
        if self.integrity:
            return True
        return members <= FOLDED_RS_UP_TO and nbytes >= FOLDED_RS_FROM * members * members

    def native_type(self, x: np.ndarray, op: ReduceOp) -> Any | None:
        """The MPI datatype to reduce ``x`` with MPI's own ``op``, or None to gather and fold
        in group order: floats in deterministic mode (integer sums are exact in any order), types
        MPI lacks (f16, bool), and float max/min (MPI implementations drop NaN there; the fold
        keeps numpy's NaN rule)."""
        if self.deterministic and x.dtype.kind == "f":
            return None
        if x.dtype.kind == "f" and op in (ReduceOp.MAX, ReduceOp.MIN):
            return None
        return self._by_dtype.get(x.dtype)

    # -- primitives of the direct device path (DeviceComm) ----------------------------------
    # DeviceComm hands device buffers to MPI through these, so its calls are exactly the
    # calls this class makes for host arrays (same datatypes, operations, deadline guard).
    def move_type(self, itemsize: int) -> Any | None:
        """The MPI datatype that moves items of ``itemsize`` bytes bit-exactly (the unsigned
        integer of that size), or None where MPI has none."""
        return self._move.get(itemsize)

    def reduce_op(self, op: ReduceOp) -> Any:
        """MPI's own operation for ``op``."""
        return self._ops[op]

    def post_send(self, buf: Any, itemsize: int, peer: int, tag: int) -> None:
        """Point-to-point (not collective): post one ``Isend`` of ``buf`` (items of
        ``itemsize`` bytes, at most :attr:`limit` of them) to ``peer`` and keep ``buf`` alive
        until :meth:`flush` has waited for it."""
        req = self.session.cart.Isend([buf, self._move[itemsize]], dest=peer, tag=tag)
        if self._progress is not None:
            self._progress.add(req, buf)
        else:
            self._sends.append((req, buf))

    def recv_into(self, buf: Any, itemsize: int, peer: int, tag: int) -> int:
        """Point-to-point (not collective): a bounded wait for one message from ``peer`` with
        ``tag`` into ``buf`` (room for items of ``itemsize`` bytes, at most :attr:`limit`);
        returns the number of items received."""
        mtype = self._move[itemsize]
        status = self.MPI.Status()
        session = self.session
        if session.watchdog is not None:
            session.guarded(
                session.cart.Recv, "recv", (), [buf, mtype], source=peer, tag=tag, status=status
            )
        else:
            req = session.cart.Irecv([buf, mtype], source=peer, tag=tag)
            session.wait(req, "recv", status=status)
        return int(status.Get_count(mtype))

    # -- the interface ------------------------------------------------------------------------
    def allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        p = self._prepared.get(id(spec))
        if (
            p
            and p[0] is spec
            and p[1] is x.dtype
            and p[2] == axes
            and p[3] == x.shape
            and x.flags.c_contiguous
        ):
            return p[4](x)  # type: ignore[no-any-return]
        comm = self.session.group(axes)
        counts = spec.counts
        if len(set(counts)) == 1 and counts[0] <= self.limit:  # equal blocks: plain Allgather
            send = self._flat(x)
            flat = empty_aligned(counts[0] * len(counts), dtype=send.dtype)
            mtype = self._move[x.itemsize]
            self.call(comm, "Allgather", "allgather", axes, [send, mtype], [flat, mtype])
        else:
            flat = self._allgatherv(comm, self._flat(x), list(counts), "allgather", axes)
        values = flat.view(x.dtype)
        shape = list(x.shape)
        shape[spec.dim] = sum(spec.extents)
        if math.prod(shape[: spec.dim]) <= 1:  # the blocks landed in place
            out = values.reshape(shape)
        else:
            blocks, start = [], 0
            for extent, count in zip(spec.extents, spec.counts, strict=True):
                shape[spec.dim] = extent
                blocks.append(values[start : start + count].reshape(shape))
                start += count
            out = np.concatenate(blocks, axis=spec.dim)
        sent, received = allgather_traffic(x.nbytes, out.nbytes, len(spec.counts))
        self._stats.record("allgather", sent, received)
        if self._gathers_in_place(x, spec):
            mtype = self._move[x.itemsize]
            self._keep(
                spec,
                x,
                axes,
                comm.Allgather,
                "allgather",
                (mtype,),
                (mtype,),
                (),
                out.shape,
                (sent, received),
            )
        return out

    def _gathers_in_place(self, x: np.ndarray, spec: AllgatherSpec) -> bool:
        """Whether an allgather of ``x`` is one MPI ``Allgather`` landing the members' blocks
        in place: equal blocks within ``max_msg_elems``, split along the first dim of size
        above one."""
        counts = spec.counts
        return (
            len(set(counts)) == 1
            and counts[0] <= self.limit
            and math.prod(x.shape[: spec.dim]) <= 1
        )

    def _on_side_thread(
        self,
        what: str,
        axes: tuple[str, ...],
        out: np.ndarray,
        send: np.ndarray,
        method: str,
        args: tuple[Any, ...],
    ) -> Pending:
        """Collective ``what`` run by this rank's side thread as the blocking ``method`` of a
        duplicate of the group's communicator with ``args`` (``out``: its result, ``send``:
        its input, both held until it completed); the handle's ``wait`` waits within the
        deadline, watching for failure notices, and in integrity mode compares the result
        across the group.

        Collective: call on all ranks of the group, in the same order."""
        session = self.session
        session.check()
        comm = session.side_group(axes)
        call = _SideCall(session, out, send, axes, what)
        session.side_submit(call.done, call, getattr(comm, method), args)
        if self.integrity:  # compared when waited for, on the main thread's communicator
            return _CheckedCall(call, lambda out: self._checked_result(what, axes, out))
        return call

    def allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        # a spec seen before (the executor repeats its steps) takes its bound call
        p = self._prepared.get(id(spec))
        if (
            p
            and p[0] is spec
            and p[1] is x.dtype
            and p[2] == axes
            and p[3] == x.shape
            and x.flags.c_contiguous
        ):
            return p[4](x)  # type: ignore[no-any-return]
        comm = self.session.group(axes)
        k = len(spec.group)
        mtype = self.native_type(x, spec.op)
        if mtype is None:  # gather and fold in group order
            flat = self._allgatherv(comm, self._flat(x), [x.size] * k, "allreduce", axes)
            parts = flat.view(x.dtype).reshape(k, *x.shape)
            out = reduce_arrays(list(parts), spec.op)
        elif x.size <= self.limit:
            moved = allreduce_moved(x, k, spec.position)
            self._keep(
                spec,
                x,
                axes,
                comm.Allreduce,
                "allreduce",
                (mtype,),
                (mtype,),
                (self._ops[spec.op],),
                x.shape,
                (moved, moved),
            )
            send = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            out = empty_aligned(x.shape, dtype=x.dtype)
            op = self._ops[spec.op]
            self.call(comm, "Allreduce", "allreduce", axes, [send, mtype], [out, mtype], op=op)
        else:
            send = np.ascontiguousarray(x).reshape(-1)
            flat_out = np.empty_like(send)
            for lo in range(0, send.size, self.limit):
                hi = min(send.size, lo + self.limit)
                self.call(
                    comm,
                    "Allreduce",
                    "allreduce",
                    axes,
                    [send[lo:hi], mtype],
                    [flat_out[lo:hi], mtype],
                    op=self._ops[spec.op],
                )
            out = flat_out.reshape(x.shape)
        moved = allreduce_moved(x, k, spec.position)
        self._stats.record("allreduce", moved, moved)
        return out

    def start_allreduce(self, x: np.ndarray, axes: tuple[str, ...], spec: AllreduceSpec) -> Pending:
        """The allreduce run by this rank's side thread on a duplicate of the group's
        communicator (MPI's own reduction, one message) while this thread goes on; the
        returned handle's ``wait`` waits within the deadline, watching for failure notices.
        Where the blocking path would not make one native call (a fold in group order, a
        message beyond ``max_msg_elems``), or without ``MPI_THREAD_MULTIPLE`` or
        ``DTM_OVERLAP``, it runs the blocking path now.

        Collective: call on all ranks of the group, in the same order."""
        mtype = self.native_type(x, spec.op)
        if (
            mtype is None
            or x.size > self.limit
            or self.session.watchdog is None
            or not self.side_thread
        ):
            return Completed(self.allreduce(x, axes, spec))
        send = np.ascontiguousarray(x)
        out = empty_aligned(x.shape, dtype=x.dtype)
        moved = allreduce_moved(x, len(spec.group), spec.position)
        self._stats.record("allreduce", moved, moved)
        args = ([send, mtype], [out, mtype], self._ops[spec.op])
        return self._on_side_thread("allreduce", axes, out, send, "Allreduce", args)

    def start_allgather(self, x: np.ndarray, axes: tuple[str, ...], spec: AllgatherSpec) -> Pending:
        """The allgather run by this rank's side thread on a duplicate of the group's
        communicator while this thread goes on (a prefetched gather); the returned handle's
        ``wait`` waits within the deadline, watching for failure notices. Where the blocking
        path would not make one ``Allgather`` landing the blocks in place (unequal blocks, a
        split along an inner dim, a message beyond ``max_msg_elems``), or without
        ``MPI_THREAD_MULTIPLE`` or ``DTM_OVERLAP``, it runs the blocking path now.

        Collective: call on all ranks of the group, in the same order."""
        if (
            not self._gathers_in_place(x, spec)
            or self.session.watchdog is None
            or not self.side_thread
        ):
            return Completed(self.allgather(x, axes, spec))
        send = self._flat(x)
        shape = list(x.shape)
        shape[spec.dim] = sum(spec.extents)
        out = empty_aligned(shape, x.dtype)  # (not kept: as the blocking path's, transient)
        flat = out.reshape(-1).view(send.dtype)
        sent, received = allgather_traffic(x.nbytes, flat.nbytes, len(spec.counts))
        self._stats.record("allgather", sent, received)
        mtype = self._move[x.itemsize]
        args = ([send, mtype], [flat, mtype])
        return self._on_side_thread("allgather", axes, out, send, "Allgather", args)

    def reduce_scatter(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ReduceScatterSpec
    ) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        p = self._prepared.get(id(spec))
        if (
            p
            and p[0] is spec
            and p[1] is x.dtype
            and p[2] == axes
            and p[3] == x.shape
            and x.flags.c_contiguous
        ):
            return p[4](x)  # type: ignore[no-any-return]
        comm = self.session.group(axes)
        k = len(spec.group)
        if math.prod(x.shape[: spec.dim]) <= 1:  # pieces: consecutive runs of the flat input
            packed = np.ascontiguousarray(x).reshape(-1)
        else:
            index = [slice(None)] * x.ndim
            runs = []
            for start, length in spec.pieces:
                index[spec.dim] = slice(start, start + length)
                runs.append(np.ascontiguousarray(x[tuple(index)]).reshape(-1))
            packed = np.concatenate(runs) if runs else x.reshape(-1)
        counts = list(spec.counts)
        out_shape = list(x.shape)
        out_shape[spec.dim] = spec.pieces[spec.position][1]
        mine = counts[spec.position]
        folds = self.folds_reduce_scatter(x.nbytes, k)
        mtype = None if folds else self.native_type(x, spec.op)
        if mtype is not None and max(counts, default=0) <= self.limit:
            out = empty_aligned(mine, dtype=x.dtype)
            name, extra = reduce_scatter_call(counts)
            self.call(
                comm,
                name,
                "reduce_scatter",
                axes,
                [packed, mtype],
                [out, mtype],
                *extra,
                op=self._ops[spec.op],
            )
        else:  # every member's contribution to this member's piece, then a fold in group order
            udt = f"u{x.itemsize}"
            flat = packed.view(udt) if packed.size else np.empty(0, dtype=udt)
            move = (
                functools.partial(self._checked_alltoallv, group=spec.group)
                if self.integrity
                else self._alltoallv
            )
            got = move(
                comm, flat, counts, [mine] * k, what="reduce_scatter", axes=axes,
                max_count=max(counts, default=0),
            ).view(x.dtype)  # fmt: skip
            out = reduce_arrays([got[j * mine : (j + 1) * mine] for j in range(k)], spec.op)
        out = out.reshape(out_shape)
        sent, received = reduce_scatter_traffic(x.nbytes, out.nbytes, k)
        self._stats.record("reduce_scatter", sent, received)
        if (
            mtype is not None
            and max(counts, default=0) <= self.limit
            and math.prod(x.shape[: spec.dim]) <= 1
        ):
            name, extra = reduce_scatter_call(counts)
            call = getattr(comm, name)
            extra = (*extra, self._ops[spec.op])
            self._keep(
                spec,
                x,
                axes,
                call,
                "reduce_scatter",
                (mtype,),
                (mtype,),
                extra,
                tuple(out_shape),
                (sent, received),
            )
        return out

    def exchange_plan(self, spec: ExchangeSpec, in_shape: tuple[int, ...]) -> ExchangePlan:
        """What one exchange needs beyond the spec, computed once per (spec, input shape):
        the executor reuses its specs every step, and this keeps small exchanges cheap."""
        key = (id(spec), in_shape)
        got = self._plans.get(key)
        if got is None or got.spec is not spec:
            got = ExchangePlan(spec, in_shape, self.rank)
            self._plans[key] = got
        return got

    def exchange(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ExchangeSpec, what: str = "exchange"
    ) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        if self.integrity:
            return self._checked_exchange(x, axes, spec, what)
        p = self._prepared.get(id(spec))
        if (
            p
            and p[0] is spec
            and p[1] is x.dtype
            and p[2] == axes
            and p[3] == x.shape
            and x.flags.c_contiguous
        ):
            return p[4](x)  # type: ignore[no-any-return]
        comm = self.session.group(axes)
        plan = self.exchange_plan(spec, x.shape)
        traffic = (plan.traffic[0] * x.itemsize, plan.traffic[1] * x.itemsize)
        if plan.send_run == (0, x.size) and plan.recv_in_place and spec.max_count <= self.limit:
            # everything in place: one call, no copies (bound for the next calls)
            mtype = self._move[x.itemsize]
            if spec.uniform:  # a group-wide fact: every member makes this same call
                self._keep(
                    spec,
                    x,
                    axes,
                    comm.Alltoall,
                    what,
                    (mtype,),
                    (mtype,),
                    (),
                    spec.out_shape,
                    traffic,
                )
            else:
                self._keep(
                    spec,
                    x,
                    axes,
                    comm.Alltoallv,
                    what,
                    ((plan.sc, plan.sd), mtype),
                    ((plan.rc, plan.rd), mtype),
                    (),
                    spec.out_shape,
                    traffic,
                )
        udt = self._udt[x.itemsize]
        if plan.send_run is not None:  # back-to-back in member order: no packing
            lo, hi = plan.send_run
            sbuf = np.ascontiguousarray(x).reshape(-1)[lo:hi].view(udt)
        else:
            parts = [x[t.region].reshape(-1) for t in spec.sends]
            sbuf = np.concatenate(parts).view(udt) if parts else np.empty(0, dtype=udt)
        out = empty_aligned(spec.out_shape, dtype=x.dtype)
        if plan.recv_in_place and spec.max_count <= self.limit:  # straight into the output
            flat_out = out.reshape(-1).view(udt)
            mtype = self._move[x.itemsize]
            # every member of a group must make the same MPI call: Alltoall only where the spec
            # says every member can (``uniform`` is a group-wide fact), as the bound calls do
            if spec.uniform:
                self.call(comm, "Alltoall", what, axes, [sbuf, mtype], [flat_out, mtype])
            else:
                self.call(
                    comm,
                    "Alltoallv",
                    what,
                    axes,
                    [sbuf, (plan.sc, plan.sd), mtype],
                    [flat_out, (plan.rc, plan.rd), mtype],
                )
        else:
            rbuf = self._alltoallv(comm, sbuf, plan.sc, plan.rc, what, axes, spec.max_count)
            values = rbuf.view(x.dtype)
            for t, d in zip(spec.recvs, plan.recv_offsets, strict=True):
                out[t.region] = values[d : d + t.count].reshape(out[t.region].shape)
        self._stats.record(what, *traffic)
        return out

    def _checked_exchange(
        self, x: np.ndarray, axes: tuple[str, ...], spec: ExchangeSpec, what: str
    ) -> np.ndarray:
        """Integrity mode's exchange: the pieces packed in member order, moved with their
        senders' CRC32C (:meth:`_checked_alltoallv`), then put in place."""
        comm = self.session.group(axes)
        plan = self.exchange_plan(spec, x.shape)
        udt = self._udt[x.itemsize]
        if plan.send_run is not None:  # back-to-back in member order: no packing
            lo, hi = plan.send_run
            sbuf = np.ascontiguousarray(x).reshape(-1)[lo:hi].view(udt)
        else:
            parts = [np.ascontiguousarray(x[t.region]).reshape(-1) for t in spec.sends]
            sbuf = np.concatenate(parts).view(udt) if parts else np.empty(0, dtype=udt)
        out = empty_aligned(spec.out_shape, dtype=x.dtype)
        flat_out = out.reshape(-1).view(udt) if plan.recv_in_place else None
        rbuf = self._checked_alltoallv(
            comm, sbuf, plan.sc, plan.rc, spec.group, what, axes, spec.max_count, flat_out
        )
        if flat_out is not None:
            if rbuf is not flat_out:  # (moved in rounds)
                flat_out[:] = rbuf
        else:
            values = rbuf.view(x.dtype)
            for t, d in zip(spec.recvs, plan.recv_offsets, strict=True):
                out[t.region] = values[d : d + t.count].reshape(out[t.region].shape)
        self._stats.record(what, plan.traffic[0] * x.itemsize, plan.traffic[1] * x.itemsize)
        return out

    def broadcast(self, x: np.ndarray, axes: tuple[str, ...], root: int) -> np.ndarray:
        """Collective: call on all ranks of the group."""
        key = (axes, root, x.shape, x.dtype)
        fn = self._bcast.get(key)
        if fn is not None and x.flags.c_contiguous:
            return fn(x)
        comm = self.session.group(axes)
        is_root = int(comm.Get_rank()) == root
        # values are immutable: the root sends its own array, the others receive a new one
        buf = np.ascontiguousarray(x) if is_root else empty_aligned(x.shape, dtype=x.dtype)
        flat = self._flat(buf)
        mtype = self._move[buf.itemsize]
        for lo in range(0, max(flat.size, 1), self.limit):
            self.call(
                comm, "Bcast", "broadcast", axes, [flat[lo : lo + self.limit], mtype], root=root
            )
        k = int(comm.Get_size())
        sent, received = broadcast_traffic(x.nbytes, k, is_root)
        self._stats.record("broadcast", sent, received)
        if self.session.watchdog is not None and x.size <= self.limit:
            meta = (self._move[x.itemsize],)
            new_out = self._new_out(key, x.shape, x.dtype)
            tally = self._stats.tally("broadcast", sent, received)
            self._bcast[key] = self.session.bind(
                comm.Bcast,
                "broadcast",
                axes,
                meta if is_root else None,
                None if is_root else meta,
                (root,),
                new_out,
                tally,
            )
        return buf

    def send(self, x: np.ndarray, peer: int, tag: int) -> None:
        """Point-to-point (not collective): posts the transfer and returns; :meth:`flush`
        (or the end of the step) waits for it, bounded."""
        from dtm_mpi.faults import corrupt_in_place

        flat = self._flat(np.array(x, order="C"))  # a private copy: the caller may reuse x
        crc = crc32c(flat) if self.integrity else 0  # of what the sender means to send
        corrupt_in_place(self.rank, "send", flat)  # DTM_FAULT=RANK:send:corrupt: in flight
        for lo in range(0, max(flat.size, 1), self.limit):
            self.post_send(flat[lo : lo + self.limit], x.itemsize, peer, tag)
        if self.integrity:  # after the payload, on its tag: MPI keeps the order
            self.post_send(np.array([crc], dtype=np.uint32), 4, peer, tag)
        self._stats.record("send", x.nbytes, 0)

    def flush(self) -> None:
        """Wait (bounded) for every posted send."""
        progress = self._progress
        if progress is not None:
            if not progress.empty.is_set():
                self.session.wait_event(progress.empty, "send", ())
            if progress.error is not None:
                error, progress.error = progress.error, None
                raise CommError(f"rank {self.rank}: a send failed: {error}", rank=self.rank)
        while self._sends:
            req, _ = self._sends[0]
            self.session.wait(req, "send")
            self._sends.pop(0)

    def recv(
        self, shape: tuple[int, ...], dtype: np.dtype[np.generic], peer: int, tag: int
    ) -> np.ndarray:
        """Point-to-point (not collective): a bounded wait for the paired send."""
        out = empty_aligned(shape, dtype=dtype)
        flat = self._flat(out)
        for lo in range(0, max(flat.size, 1), self.limit):
            part = flat[lo : lo + self.limit]
            got = self.recv_into(part, out.itemsize, peer, tag)
            if got != part.size:
                raise CommError(
                    f"rank {self.rank}: recv from rank {peer} tag {tag} got "
                    f"{got} elements, expected {part.size}",
                    rank=self.rank,
                )
        if self.integrity:
            sent = np.zeros(1, dtype=np.uint32)
            self.recv_into(sent, 4, peer, tag)
            actual = crc32c(flat)
            if int(sent[0]) != actual:
                raise PayloadIntegrityError(
                    f"send/recv from rank {peer} to rank {self.rank} tag {tag}: the payload "
                    f"({out.nbytes} bytes) arrived with CRC32C {actual:08x}, its sender's was "
                    f"{int(sent[0]):08x}",
                    rank=self.rank,
                )
        self._stats.record("recv", 0, out.nbytes)
        return out
