"""Device arrays (CuPy) through any :class:`~dtm_mpi.comm.interface.Comm`.

:class:`DeviceComm` wraps a comm (MPI or the simulator) and a device backend
(:class:`DeviceOps`). For an operation on a device array it first waits for the work queued on
the device (``synchronize``: MPI must never read memory a kernel is still writing, nor write
memory a kernel still reads), then takes one of two paths:

* **direct**: MPI is GPU-aware (:mod:`dtm_mpi.comm.gpu_aware`), the inner comm is an
  :class:`~dtm_mpi.comm.mpi_comm.MpiComm` and the operation is one MPI call on contiguous
  buffers: allreduce and reduce-scatter (the reductions MPI does natively, outside
  deterministic mode; reduce-scatter along the leading dims, non-empty pieces), allgather
  along the leading dims (``Allgather`` for equal blocks, ``Allgatherv`` for uneven ones, as
  MpiComm), all-to-all exchanges whose pieces are back to back in member order (``Alltoall``
  for uniform specs, else ``Alltoallv``, as MpiComm), broadcast, send and recv. The device buffers go to MPI as they are, through MpiComm's own
  communicators, datatypes, deadline guard and accounting. A direct call is exactly the call
  MpiComm makes for a host array of the same shape, so ranks that take different paths
  (a host array here, a device array there) still match. Collectives go direct only as
  blocking calls under the session's watchdog: MPI libraries take device buffers in
  blocking collectives, not in non-blocking ones (Open MPI's CUDA support, for one);
* **staged**: everything else. The input is copied into a reusable page-locked host buffer,
  the inner comm runs on that host array, and its result (an ordinary host array the inner
  comm allocated) is copied to a new device array.

Float max/min stay staged even when MPI is GPU-aware: MpiComm folds them in group order on
the host because MPI implementations drop NaN there, and a device array must give the host
array's result. The direct path uses MpiComm's public primitives (``call``, ``native_type``,
``move_type``, ``reduce_op``, ``exchange_plan``, ``post_send``, ``recv_into``, ``limit``) rather than copies
of them, so the two cannot drift apart.

Host numpy arrays pass straight through to the inner comm. :attr:`DeviceComm.paths` counts
which path each operation took (and why it staged) for the run log and tests.

Staging buffers come from :class:`PinnedPool`: a few buffers per power-of-two size class,
reused once no view of them is alive (reference counts decide, so an inner comm that still
reads a buffer after returning, like the simulator's peers, is never overwritten); never a
new pinned allocation per call for repeated sizes.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dtm_mpi.comm.gpu_aware import GpuAwareness
from dtm_mpi.comm.interface import (
    Comm,
    CommStats,
    Completed,
    Pending,
    allgather_traffic,
    allreduce_moved,
    broadcast_traffic,
    reduce_scatter_traffic,
)
from dtm_mpi.comm.mpi_comm import MpiComm, reduce_scatter_call, starts_of
from dtm_mpi.errors import CommError, GpuAwareMpiError, agreed
from dtm_mpi.sharding.mesh import MeshShape
from dtm_mpi.sharding.steps import AllgatherSpec, AllreduceSpec, ExchangeSpec, ReduceScatterSpec

__all__ = ["DeviceComm", "DeviceOps", "DevicePaths", "PinnedPool"]

NOT_NATIVE = "deterministic mode, or a reduction MPI does not do natively (float max/min, f16, bool): folded in group order"
NOT_AWARE = "MPI is not GPU-aware"
FOLDED = (
    "a large array in a small group: the pieces moved by an all-to-all and folded in group order"
)


class DeviceOps(Protocol):
    """What the communication layer needs from a device backend. Device arrays expose
    ``shape``, ``dtype`` (a numpy dtype) and ``nbytes``, and for the direct path
    ``__cuda_array_interface__`` (or DLPack) and ``flags.c_contiguous``, as CuPy arrays do."""

    name: str
    """``cuda``, ``hip`` or ``fake`` (tests: host memory posing as device memory)."""

    def is_device(self, x: object) -> bool:
        """Whether ``x`` is this backend's device array (a numpy array is not)."""
        ...

    def synchronize(self) -> None:
        """Wait for all work queued on the current stream. Called before every MPI call
        that reads or writes a device buffer."""
        ...

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """A new (uninitialised, C-contiguous) device array."""
        ...

    def to_host(self, x: Any, out: np.ndarray) -> np.ndarray:
        """Copy device array ``x`` into host array ``out`` (``x.nbytes`` bytes; ``out`` may
        be a uint8 view of a pinned buffer) and return ``out`` viewed as ``x``'s dtype and
        shape. Synchronous: the bytes are in ``out`` when it returns."""
        ...

    def to_device(self, host: np.ndarray, out: Any | None = None) -> Any:
        """Copy the bytes of ``host`` into ``out``, or into a new device array of ``host``'s
        shape and dtype; returns it. Synchronous."""
        ...

    def pinned(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer (uint8, at least ``nbytes``) for staging. The comm layer
        keeps it for reuse, deciding by reference counts when no view of it is alive: the
        backend must keep the returned array's memory valid and must not itself keep
        references to the returned array (it may keep the underlying allocation)."""
        ...


@dataclass(slots=True)
class DevicePaths:
    """Per operation name: calls on device arrays that went ``direct`` to MPI or were
    ``staged`` through host memory, calls on ``host`` arrays; ``why``: staging reasons."""

    direct: Counter[str] = field(default_factory=Counter)
    staged: Counter[str] = field(default_factory=Counter)
    host: Counter[str] = field(default_factory=Counter)
    why: Counter[str] = field(default_factory=Counter)

    def describe(self) -> str:
        def items(c: Counter[str]) -> str:
            return ", ".join(f"{k} {n}" for k, n in sorted(c.items())) or "none"

        why = "; ".join(f"{k} ({n})" for k, n in sorted(self.why.items()))
        return (
            f"device buffers: direct {items(self.direct)}; staged {items(self.staged)}"
            + (f" [{why}]" if why else "")
            + f"; host arrays {items(self.host)}"
        )


class _Kept:
    """One pooled buffer; ``anchor`` is the object every view of it references."""

    __slots__ = ("anchor", "buf", "idle")

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.anchor: object = buf[:0].base  # numpy collapses view chains to this object
        self.idle = 0  # the anchor's reference count with no view alive (set once kept)


class PinnedPool:
    """Reusable page-locked staging buffers: at most ``PER_CLASS`` per power-of-two size class
    (from ``MIN_CLASS``) and ``max_bytes`` in all; past that, a call stages through an
    ordinary host array (counted in ``pageable``)."""

    MIN_CLASS = 4096
    PER_CLASS = 4

    def __init__(self, ops: DeviceOps, max_bytes: int = 4 << 30) -> None:
        self._ops = ops
        self.max_bytes = max_bytes
        self._kept: dict[int, list[_Kept]] = {}
        self.pinned_bytes = 0
        self.allocations = 0
        self.reused = 0
        self.pageable = 0

    @property
    def buffers(self) -> int:
        return sum(len(v) for v in self._kept.values())

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 host array of ``nbytes``: a view of a free pooled pinned buffer."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        size = max(self.MIN_CLASS, 1 << (nbytes - 1).bit_length())
        kept = self._kept.setdefault(size, [])
        for entry in kept:
            if sys.getrefcount(entry.anchor) == entry.idle:
                self.reused += 1
                return entry.buf[:nbytes]
        if len(kept) >= self.PER_CLASS or self.pinned_bytes + size > self.max_bytes:
            self.pageable += 1
            return np.empty(nbytes, dtype=np.uint8)
        try:
            buf = self._ops.pinned(size)
        except Exception:  # page-locked memory is capped (ulimit -l, the driver): use pageable
            self.pageable += 1
            return np.empty(nbytes, dtype=np.uint8)
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < size:
            raise CommError(
                f"{self._ops.name}: pinned({size}) returned {buf.dtype}{list(buf.shape)}, expected uint8[>={size}]"
            )
        entry = _Kept(buf)
        del buf
        entry.idle = sys.getrefcount(entry.anchor)  # measured as in the loop above
        kept.append(entry)
        self.allocations += 1
        self.pinned_bytes += size
        return entry.buf[:nbytes]

    def clear(self) -> None:
        """Forget every pooled buffer (its memory goes when its last view does)."""
        self._kept.clear()
        self.pinned_bytes = 0


def _like(x: Any) -> np.ndarray:
    """A host array with ``x``'s shape and dtype and no memory (for byte accounting)."""
    return np.broadcast_to(np.empty((), dtype=x.dtype), tuple(x.shape))


def _contiguous(x: Any) -> bool:
    flags = getattr(x, "flags", None)
    return True if flags is None else bool(flags.c_contiguous)


class DeviceComm:
    """A :class:`~dtm_mpi.comm.interface.Comm` for device arrays over ``inner`` (implements
    ``Comm``; every array argument may be a host or a device array).

    ``awareness``: whether MPI takes device buffers, agreed by every rank
    (:func:`~dtm_mpi.comm.gpu_aware.agree_gpu_aware`). ``log``: receives one line the first
    time a device buffer is staged because MPI is not GPU-aware (default: the ``dtm_mpi``
    logger at info level). ``require_gpu_aware``: refuse to construct, with
    :class:`~dtm_mpi.errors.GpuAwareMpiError`, when MPI is not GPU-aware."""

    def __init__(
        self,
        inner: Comm,
        ops: DeviceOps,
        awareness: GpuAwareness,
        *,
        log: Callable[[str], None] | None = None,
        require_gpu_aware: bool = False,
        max_pinned_bytes: int = 4 << 30,
    ) -> None:
        if require_gpu_aware and not awareness.aware:
            err = GpuAwareMpiError(
                f"GPU-aware MPI is required (--require-gpu-aware-mpi) but the {awareness.source} "
                f"layer decided MPI is not GPU-aware: {awareness.detail}. Use a GPU-aware MPI "
                "build (and enable it), set --gpu-aware-mpi yes if it is one, or drop the "
                "requirement to stage device buffers through host memory",
                rank=inner.rank,
                phase="gpu-aware mpi",
            )
            raise agreed(err) if awareness.agreed else err
        self.inner = inner
        self.ops = ops
        self.awareness = awareness
        self.paths = DevicePaths()
        self.pool = PinnedPool(ops, max_pinned_bytes)
        self._log = log if log is not None else logging.getLogger("dtm_mpi").info
        self._logged = False
        self._mpi = inner if isinstance(inner, MpiComm) else None

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def mesh(self) -> MeshShape:
        return self.inner.mesh

    @property
    def stats(self) -> CommStats:
        return self.inner.stats

    # -- paths --------------------------------------------------------------------------------
    def _direct(
        self, shape: tuple[int, ...], dtype: Any, contiguous: bool, collective: bool
    ) -> MpiComm | str:
        """The MpiComm to call for a direct ``op``, or the reason (a str) to stage."""
        if not self.awareness.aware:
            return NOT_AWARE
        mpi = self._mpi
        if mpi is None:
            return "the inner comm is not MPI"
        if mpi.integrity:  # (the same on every rank: compared in the handshake)
            return "payload integrity mode: the host path checks every payload"
        size = math.prod(shape)
        if size == 0:
            return "empty array"
        if not contiguous:
            return "not C-contiguous"
        if mpi.move_type(np.dtype(dtype).itemsize) is None:
            return f"no MPI type moves {np.dtype(dtype).itemsize}-byte items"
        if size > mpi.limit:
            return "more elements than one MPI message (DTM_MAX_MSG_ELEMS)"
        if collective and mpi.session.watchdog is None:
            return "MPI is not THREAD_MULTIPLE: collectives are non-blocking calls, which do not take device buffers"
        return mpi

    def _contiguous_if_aware(self, x: Any) -> Any:
        """``x``, or a contiguous device copy of it when MPI is GPU-aware and ``x`` is not
        contiguous. For operations whose MPI call depends on the path: contiguity is this
        rank's own fact, so staging on it could split the group's calls; the copy keeps the
        decision the same on every rank."""
        if self.awareness.aware and not _contiguous(x):
            return self.ops.to_device(self._to_pinned(x))
        return x

    def _note_staged(self, op: str, why: str) -> None:
        """Count a staged ``op``; the first staging because MPI is not GPU-aware is logged."""
        self.paths.staged[op] += 1
        self.paths.why[why] += 1
        if why == NOT_AWARE and not self._logged:
            self._logged = True
            a = self.awareness
            self._log(
                f"staging device buffers through pinned host memory: {NOT_AWARE} ({a.source}: {a.detail})"
            )

    def _to_pinned(self, x: Any) -> np.ndarray:
        """``x`` copied into a pooled pinned buffer (a view of it, shaped like ``x``)."""
        return self.ops.to_host(x, self.pool.take(int(x.nbytes)))

    def _staged(self, op: str, why: str, x: Any, call: Callable[[np.ndarray], np.ndarray]) -> Any:
        """``call`` on a pinned host copy of ``x``; its result as a new device array (never
        a view of the staging buffer, which a later call reuses)."""
        self._note_staged(op, why)
        return self.ops.to_device(call(self._to_pinned(x)))

    def describe(self) -> str:
        """Paths taken and the staging pool, for the run log."""
        p = self.pool
        return (
            f"{self.paths.describe()}; pinned pool {p.buffers} buffer(s), "
            f"{p.pinned_bytes / 2**20:.1f} MiB, reused {p.reused}x, pageable {p.pageable}"
        )

    # -- the interface ------------------------------------------------------------------------
    def allgather(self, x: Any, axes: tuple[str, ...], spec: AllgatherSpec) -> Any:
        """Collective: call on all ranks of the group."""
        if not self.ops.is_device(x):
            self.paths.host["allgather"] += 1
            return self.inner.allgather(x, axes, spec)
        self.ops.synchronize()
        mpi = self._direct(tuple(x.shape), x.dtype, _contiguous(x), True)
        counts = list(spec.counts)
        if not isinstance(mpi, str) and math.prod(x.shape[: spec.dim]) > 1:
            mpi = "gathered along an inner dim (the blocks would need reordering)"
        if not isinstance(mpi, str) and max(counts) > mpi.limit:
            mpi = "a block above one MPI message (DTM_MAX_MSG_ELEMS)"
        if isinstance(mpi, str):  # a rank staging here makes MpiComm's call: the same one
            return self._staged("allgather", mpi, x, lambda h: self.inner.allgather(h, axes, spec))
        comm = mpi.session.group(axes)
        shape = list(x.shape)
        shape[spec.dim] = sum(spec.extents)
        out = self.ops.empty(tuple(shape), x.dtype)  # the blocks land in place, in rank order
        mtype = mpi.move_type(x.dtype.itemsize)
        if len(set(counts)) == 1:  # as MpiComm: Allgather for equal blocks, else Allgatherv
            mpi.call(comm, "Allgather", "allgather", axes, [x, mtype], [out, mtype])
        else:
            mpi.call(
                comm,
                "Allgatherv",
                "allgather",
                axes,
                [x, mtype],
                [out, (counts, starts_of(counts)), mtype],
            )
        mpi.stats.record(
            "allgather", *allgather_traffic(int(x.nbytes), int(out.nbytes), len(counts))
        )
        self.paths.direct["allgather"] += 1
        return out

    def allreduce(self, x: Any, axes: tuple[str, ...], spec: AllreduceSpec) -> Any:
        """Collective: call on all ranks of the group."""
        if not self.ops.is_device(x):
            self.paths.host["allreduce"] += 1
            return self.inner.allreduce(x, axes, spec)
        self.ops.synchronize()
        mpi = self._direct(tuple(x.shape), x.dtype, _contiguous(x), True)
        if not isinstance(mpi, str) and mpi.native_type(x, spec.op) is None:
            mpi = NOT_NATIVE
        if isinstance(mpi, str):
            return self._staged("allreduce", mpi, x, lambda h: self.inner.allreduce(h, axes, spec))
        comm = mpi.session.group(axes)
        mtype = mpi.native_type(x, spec.op)
        out = self.ops.empty(tuple(x.shape), x.dtype)
        mpi.call(
            comm,
            "Allreduce",
            "allreduce",
            axes,
            [x, mtype],
            [out, mtype],
            op=mpi.reduce_op(spec.op),
        )
        moved = allreduce_moved(_like(x), len(spec.group), spec.position)
        mpi.stats.record("allreduce", moved, moved)
        self.paths.direct["allreduce"] += 1
        return out

    def start_allreduce(self, x: Any, axes: tuple[str, ...], spec: AllreduceSpec) -> Pending:
        """Device buffers: the blocking allreduce (the stream is synchronised around MPI)."""
        return Completed(self.allreduce(x, axes, spec))

    def start_allgather(self, x: Any, axes: tuple[str, ...], spec: AllgatherSpec) -> Pending:
        """Device buffers: the blocking allgather (the stream is synchronised around MPI)."""
        return Completed(self.allgather(x, axes, spec))

    def reduce_scatter(self, x: Any, axes: tuple[str, ...], spec: ReduceScatterSpec) -> Any:
        """Collective: call on all ranks of the group."""
        if not self.ops.is_device(x):
            self.paths.host["reduce_scatter"] += 1
            return self.inner.reduce_scatter(x, axes, spec)
        self.ops.synchronize()
        x = self._contiguous_if_aware(x)
        mpi = self._direct(tuple(x.shape), x.dtype, True, True)
        counts = list(spec.counts)
        if not isinstance(mpi, str) and math.prod(x.shape[: spec.dim]) > 1:
            mpi = "scattered along an inner dim (the pieces would need packing)"
        if not isinstance(mpi, str) and min(counts) == 0:
            mpi = "a member's piece is empty"
        if not isinstance(mpi, str) and mpi.native_type(x, spec.op) is None:
            mpi = NOT_NATIVE
        if not isinstance(mpi, str) and mpi.folds_reduce_scatter(int(x.nbytes), len(counts)):
            mpi = FOLDED  # (as MpiComm does for host arrays: the calls must pair)
        if isinstance(mpi, str):
            return self._staged(
                "reduce_scatter", mpi, x, lambda h: self.inner.reduce_scatter(h, axes, spec)
            )
        comm = mpi.session.group(axes)
        shape = list(x.shape)
        shape[spec.dim] = spec.pieces[spec.position][1]
        out = self.ops.empty(tuple(shape), x.dtype)  # this member's piece, reduced in place
        mtype = mpi.native_type(x, spec.op)
        name, extra = reduce_scatter_call(counts)  # the call MpiComm makes for these counts
        mpi.call(
            comm,
            name,
            "reduce_scatter",
            axes,
            [x, mtype],
            [out, mtype],
            *extra,
            op=mpi.reduce_op(spec.op),
        )
        mpi.stats.record(
            "reduce_scatter", *reduce_scatter_traffic(int(x.nbytes), int(out.nbytes), len(counts))
        )
        self.paths.direct["reduce_scatter"] += 1
        return out

    def exchange(
        self, x: Any, axes: tuple[str, ...], spec: ExchangeSpec, what: str = "exchange"
    ) -> Any:
        """Collective: call on all ranks of the group."""
        if not self.ops.is_device(x):
            self.paths.host[what] += 1
            return self.inner.exchange(x, axes, spec, what)
        self.ops.synchronize()
        x = self._contiguous_if_aware(x)
        mpi = self._direct(tuple(x.shape), x.dtype, True, True)
        if not isinstance(mpi, str) and spec.max_count > mpi.limit:
            mpi = "a message above one MPI message (DTM_MAX_MSG_ELEMS)"  # group-wide
        plan = None if isinstance(mpi, str) else mpi.exchange_plan(spec, tuple(x.shape))
        if plan is not None and not (plan.send_run == (0, x.size) and plan.recv_in_place):
            mpi = "pieces not back to back (they would need packing)"
        if isinstance(mpi, str):
            # MpiComm's call for a rank that stages is an Alltoallv (non-uniform specs) or
            # the Alltoall every member makes (uniform ones): the same as the direct ranks'
            return self._staged(what, mpi, x, lambda h: self.inner.exchange(h, axes, spec, what))
        assert plan is not None
        comm = mpi.session.group(axes)
        out = self.ops.empty(tuple(spec.out_shape), x.dtype)  # every piece lands in place
        mtype = mpi.move_type(x.dtype.itemsize)
        if spec.uniform:
            mpi.call(comm, "Alltoall", what, axes, [x, mtype], [out, mtype])
        else:
            mpi.call(
                comm,
                "Alltoallv",
                what,
                axes,
                [x, (plan.sc, plan.sd), mtype],
                [out, (plan.rc, plan.rd), mtype],
            )
        mpi.stats.record(
            what, plan.traffic[0] * x.dtype.itemsize, plan.traffic[1] * x.dtype.itemsize
        )
        self.paths.direct[what] += 1
        return out

    def broadcast(self, x: Any, axes: tuple[str, ...], root: int) -> Any:
        """The root's own array on the root (as MpiComm: values are immutable), a new array
        elsewhere.

        Collective: call on all ranks of the group."""
        if not self.ops.is_device(x):
            self.paths.host["broadcast"] += 1
            return self.inner.broadcast(x, axes, root)
        self.ops.synchronize()
        mpi = self._direct(tuple(x.shape), x.dtype, _contiguous(x), True)
        if isinstance(mpi, str):
            if self.mesh.group_of(self.rank, axes).index(self.rank) != root:
                return self._staged(
                    "broadcast", mpi, x, lambda h: self.inner.broadcast(h, axes, root)
                )
            self._note_staged("broadcast", mpi)
            self.inner.broadcast(self._to_pinned(x), axes, root)
            return x
        comm = mpi.session.group(axes)
        is_root = int(comm.Get_rank()) == root
        buf = x if is_root else self.ops.empty(tuple(x.shape), x.dtype)
        mpi.call(
            comm, "Bcast", "broadcast", axes, [buf, mpi.move_type(x.dtype.itemsize)], root=root
        )
        mpi.stats.record(
            "broadcast", *broadcast_traffic(int(x.nbytes), int(comm.Get_size()), is_root)
        )
        self.paths.direct["broadcast"] += 1
        return buf

    def send(self, x: Any, peer: int, tag: int) -> None:
        """Point-to-point (not collective). A direct send keeps ``x`` until :meth:`flush`
        (values are immutable: the caller must not modify ``x`` before then); a staged or
        host send copies it, as MpiComm does."""
        if not self.ops.is_device(x):
            self.paths.host["send"] += 1
            self.inner.send(x, peer, tag)
            return
        self.ops.synchronize()
        mpi = self._direct(tuple(x.shape), x.dtype, _contiguous(x), False)
        if isinstance(mpi, str):
            self._note_staged("send", mpi)
            self.inner.send(self._to_pinned(x), peer, tag)  # copies: the buffer is free again
            return
        mpi.session.check()
        mpi.post_send(x, x.dtype.itemsize, peer, tag)  # MpiComm's flush waits for it (bounded)
        mpi.stats.record("send", int(x.nbytes), 0)
        self.paths.direct["send"] += 1

    def flush(self) -> None:
        """Wait (bounded) until every send of this rank, direct or staged, is delivered."""
        self.inner.flush()

    def transient(self, spec: object) -> None:
        self.inner.transient(spec)

    def recv(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype[np.generic],
        peer: int,
        tag: int,
        *,
        device: bool = True,
    ) -> Any:
        """Point-to-point (not collective): a device array (a host array with
        ``device=False``), whatever memory the sender sent from."""
        if not device:
            self.paths.host["recv"] += 1
            return self.inner.recv(shape, dtype, peer, tag)
        self.ops.synchronize()
        mpi = self._direct(tuple(shape), dtype, True, False)
        if isinstance(mpi, str):
            self._note_staged("recv", mpi)
            return self.ops.to_device(self.inner.recv(shape, dtype, peer, tag))
        out = self.ops.empty(tuple(shape), np.dtype(dtype))
        got, want = mpi.recv_into(out, np.dtype(dtype).itemsize, peer, tag), math.prod(shape)
        if got != want:
            raise CommError(
                f"rank {self.rank}: recv from rank {peer} tag {tag} got {got} elements, "
                f"expected {want}",
                rank=self.rank,
            )
        mpi.stats.record("recv", 0, int(out.nbytes))
        self.paths.direct["recv"] += 1
        return out


if TYPE_CHECKING:  # DeviceComm implements the Comm protocol (checked by mypy only)

    def _is_a_comm(c: DeviceComm) -> Comm:
        return c
