"""Damaged chunks of a store and where their bytes can come from again (``dtm store recover``,
degraded reads of ``dtm store get`` and ``dtm store export``).

A store keeps every committed checkpoint until retention removes it, and a copy-on-write save
(``dtm store put``, a task graph's commit) stores an unchanged tensor again chunk by chunk with
the same content hashes: an older checkpoint very often holds **the same bytes** of a chunk
that is damaged in the newer one. The recovery plan is a pure function of the manifests, the
damaged chunks and the task records; for each damaged chunk, in this order of preference:

1. ``replica``: a healthy chunk of any committed checkpoint (the newest first) with the same
   content hash, dtype and extent -- the same bytes;
2. ``parent``: the tensor is DERIVED and its parent is whole (or recoverable): rebuilt by its
   rebuild rule (``cast:f16``, ``copy``);
3. ``task``: a task of a graph wrote it (``STORE/tasks/*.json``): re-running that task
   rebuilds it (``dtm task run GRAPH --rerun``);
4. ``none``: unrecoverable.

A **degraded read** serves a tensor whose damaged chunks all have a replica (a warning names
each); **repair** (``dtm store recover`` without ``--dry-run``) writes a new checkpoint (the
damaged one is never modified) in which every tensor the plan can restore from replicas or
parents is whole again, and refuses, naming the tensors and tasks, when some cannot.
Serial: one process reads.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtm_mpi.errors import IntegrityError, StorageError

if TYPE_CHECKING:
    import numpy as np

    from dtm_mpi.io.backend import ShardBackend
    from dtm_mpi.io.manifest import ArtifactRecord, Manifest, ShardRecord

__all__ = [
    "ChunkRecovery",
    "ChunkRef",
    "Source",
    "manifests_of",
    "plan_recovery",
    "read_degraded",
    "read_served",
    "recovery_plan",
    "recovery_text",
    "repair",
    "scan_damage",
]


@dataclass(frozen=True, slots=True, order=True)
class ChunkRef:
    """Chunk ``chunk`` of shard ``shard`` (its id) of tensor ``tensor`` in checkpoint ``step``."""

    step: int
    tensor: str
    shard: str
    chunk: int

    def __str__(self) -> str:
        return f"step {self.step} tensor {self.tensor!r} shard {self.shard!r} chunk {self.chunk}"


class Source(enum.Enum):
    REPLICA = "replica"
    PARENT = "parent"
    TASK = "task"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class ChunkRecovery:
    damaged: ChunkRef
    source: Source
    replica: ChunkRef | None = None  # Source.REPLICA: the chunk with the same bytes
    parent: str | None = None  # Source.PARENT: the tensor it is rebuilt from
    task: str | None = None  # Source.TASK: the task that writes it

    def __str__(self) -> str:
        how = {
            Source.REPLICA: f"the same bytes in {self.replica}",
            Source.PARENT: f"rebuilt from its parent {self.parent!r}",
            Source.TASK: f"rebuilt by task {self.task!r} (`dtm store recover` leaves the "
            "tensor out, then `dtm task run GRAPH` recomputes it)",
            Source.NONE: "unrecoverable: no replica, parent or task",
        }[self.source]
        return f"{self.damaged}: {how}"


def _chunk_key(a: ArtifactRecord, s: ShardRecord, c: int) -> tuple[str, str, tuple[int, ...]]:
    region = s.chunk_region(c)
    extent = tuple(r.stop - r.start for r in region)
    return (s.chunks[c], a.dtype.value, extent)


def plan_recovery(
    manifests: Mapping[int, Manifest],
    damaged: Sequence[ChunkRef],
    producers: Mapping[str, str] | None = None,
) -> tuple[ChunkRecovery, ...]:
    """Where each damaged chunk's bytes come from (module docstring), ``manifests``: every
    committed checkpoint by step; ``producers``: store tensor -> the task that writes it.
    Pure: the same arguments give the same plan."""
    bad = set(damaged)
    index: dict[tuple[str, str, tuple[int, ...]], ChunkRef] = {}
    for step in sorted(manifests):  # the newest healthy copy wins
        for a in manifests[step].artifacts:
            for s in a.shards:
                for c in range(len(s.chunks)):
                    ref = ChunkRef(step, a.name, s.id, c)
                    if ref not in bad:
                        index[_chunk_key(a, s, c)] = ref
    whole_damaged = {(d.step, d.tensor) for d in damaged}
    out: list[ChunkRecovery] = []
    for d in sorted(bad):
        m = manifests[d.step]
        a = m.artifact(d.tensor)
        s = a.shard(d.shard)
        replica = index.get(_chunk_key(a, s, d.chunk))
        if replica is not None:
            out.append(ChunkRecovery(d, Source.REPLICA, replica=replica))
        elif (
            a.parent is not None
            and a.rebuild is not None
            and (d.step, a.parent) not in whole_damaged
        ):
            out.append(ChunkRecovery(d, Source.PARENT, parent=a.parent))
        elif producers and d.tensor in producers:
            out.append(ChunkRecovery(d, Source.TASK, task=producers[d.tensor]))
        else:
            out.append(ChunkRecovery(d, Source.NONE))
    return tuple(out)


def scan_damage(ckpt: Path, manifest: Manifest, backend: ShardBackend) -> list[ChunkRef]:
    """Every chunk of checkpoint ``ckpt`` that does not read back as its content hash says (a
    missing data file: every chunk it held)."""
    out = []
    with backend.open_reader(ckpt) as files:
        for a in manifest.artifacts:
            for s in a.shards:
                for c in range(len(s.chunks)):
                    try:
                        files.read_verified(a, s, c)
                    except IntegrityError:
                        out.append(ChunkRef(manifest.step, a.name, s.id, c))
    return out


def recovery_plan(store: Path, m: Manifest, backend: ShardBackend) -> tuple[ChunkRecovery, ...]:
    """The recovery plan of checkpoint ``m`` of ``store``: its damaged chunks (every chunk
    read back, :func:`scan_damage`) and where their bytes come from (:func:`plan_recovery`
    over every committed checkpoint and the task records)."""
    from dtm_mpi.io.store import committed_name

    damaged = scan_damage(store / committed_name(m.step), m, backend)
    return _plan_with(store, m, damaged, backend)


def _plan_with(
    store: Path, m: Manifest, damaged: Sequence[ChunkRef], backend: ShardBackend
) -> tuple[ChunkRecovery, ...]:
    """:func:`plan_recovery` of ``damaged`` chunks of checkpoint ``m`` against the store's
    committed checkpoints and task records."""
    from dtm_mpi.io.task_records import producers_of, read_records

    manifests = {**manifests_of(store, backend), m.step: m}
    return plan_recovery(manifests, damaged, producers_of(read_records(store)))


def manifests_of(store: Path, backend: ShardBackend) -> dict[int, Manifest]:
    """Every committed checkpoint's manifest by step (one that does not read offers no replicas)."""
    from dtm_mpi.io.store import committed_name, list_checkpoints
    from dtm_mpi.io.tools import read_manifest

    out = {}
    for e in list_checkpoints(store):
        if e.committed:
            try:
                out[e.step] = read_manifest(store / committed_name(e.step), backend)
            except StorageError:
                continue  # an unreadable manifest offers no replicas
    return out


def _read_chunk(store: Path, ref: ChunkRef, backend: ShardBackend) -> np.ndarray:
    from dtm_mpi.io.store import committed_name
    from dtm_mpi.io.tools import read_manifest

    ckpt = store / committed_name(ref.step)
    a = read_manifest(ckpt, backend).artifact(ref.tensor)
    with backend.open_reader(ckpt) as files:
        return files.read_verified(a, a.shard(ref.shard), ref.chunk)


def read_degraded(
    store: Path,
    step: int,
    name: str,
    *,
    backend: ShardBackend,
    warn: Callable[[str], None],
) -> np.ndarray:
    """The global value of tensor ``name`` of checkpoint ``step``: every chunk verified; a
    damaged chunk is served from a replica (``warn`` is told which) or, when there is none,
    the read fails with the chunk's :class:`IntegrityError` and what could rebuild it."""
    import numpy as np

    from dtm_mpi.io.store import committed_name
    from dtm_mpi.io.tools import read_manifest
    from dtm_mpi.ir.dtypes import np_dtype

    m = read_manifest(store / committed_name(step), backend)
    a = m.artifact(name)
    out = np.empty(a.shape, dtype=np_dtype(a.dtype))
    damaged: list[tuple[ChunkRef, IntegrityError]] = []
    with backend.open_reader(store / committed_name(step)) as files:
        for s in a.shards:
            for c in range(len(s.chunks)):
                try:
                    out[s.chunk_region(c)] = files.read_verified(a, s, c)
                except IntegrityError as err:
                    damaged.append((ChunkRef(step, name, s.id, c), err))
    if not damaged:
        return out
    plan = {r.damaged: r for r in _plan_with(store, m, [d for d, _ in damaged], backend)}
    for ref, bad in damaged:
        r = plan[ref]
        if r.source is not Source.REPLICA:
            raise IntegrityError(
                f"chunk {ref.chunk} is damaged and no other checkpoint holds its bytes, so it "
                f"cannot be served degraded ({bad}); {r}",
                tensor=bad.tensor,
                shard=bad.shard,
                file=bad.file,
            ) from None
        assert r.replica is not None
        s = a.shard(ref.shard)
        out[s.chunk_region(ref.chunk)] = _read_chunk(store, r.replica, backend)
        warn(
            f"warning: {ref} is damaged ({bad}); served from {r.replica} (the same bytes); "
            f"`dtm store recover {store}` writes a whole checkpoint"
        )
    return out


def read_served(
    store: Path,
    m: Manifest,
    name: str,
    *,
    backend: ShardBackend,
    warn: Callable[[str], None] | None,
) -> np.ndarray:
    """The global value of tensor ``name`` of checkpoint ``m`` of ``store``, every chunk
    verified (:func:`~dtm_mpi.io.tools.read_tensor`); with ``warn``, a damaged chunk is served
    from the same bytes in another checkpoint (:func:`read_degraded`), else it is the
    :class:`IntegrityError`."""
    from dtm_mpi.io.store import committed_name
    from dtm_mpi.io.tools import read_tensor

    try:
        return read_tensor(store / committed_name(m.step), name, m, backend)
    except IntegrityError:
        if warn is None:
            raise
        return read_degraded(store, m.step, name, backend=backend, warn=warn)


def recovery_text(plan: Sequence[ChunkRecovery]) -> str:
    if not plan:
        return "no damaged chunk: nothing to recover"
    counts = {src: sum(1 for r in plan if r.source is src) for src in Source}
    head = ", ".join(f"{n} by {src.value}" for src, n in counts.items() if n)
    return "\n".join([f"{len(plan)} damaged chunk(s): {head}", *(f"  {r}" for r in plan)])


def repair(
    store: Path,
    step: int,
    plan: Sequence[ChunkRecovery],
    comm: Any,
    *,
    backend: ShardBackend,
) -> tuple[Any, tuple[str, ...]]:
    """Write a new checkpoint: checkpoint ``step`` (the latest) with every damaged tensor whole
    again (its chunks from replicas, or rebuilt from its parent) and the damaged tensors only a
    task can rebuild left out (the task's record then no longer holds: ``dtm task run``
    recomputes them). Refuses, before writing, when a damaged tensor has no source at all.
    Returns the put's result and the tensors left out."""
    from dtm_mpi.io.checkpoint import rebuild_value
    from dtm_mpi.io.tools import bf16_bits, put_tensors
    from dtm_mpi.ir.types import DType

    lost = [r for r in plan if r.source is Source.NONE]
    if lost:
        raise StorageError(
            "cannot repair: " + "; ".join(str(r) for r in lost) + " (nothing was written)"
        )
    from dtm_mpi.io.store import committed_name
    from dtm_mpi.io.tools import read_manifest

    m = read_manifest(store / committed_name(step), backend)
    by_task = sorted({r.damaged.tensor for r in plan if r.source is Source.TASK})
    while True:  # a derived tensor of one left out goes too (its parent is not there)
        more = {a.name for a in m.artifacts if a.parent in by_task} - set(by_task)
        if not more:
            break
        by_task = sorted({*by_task, *more})
    derived = {
        r.damaged.tensor: r.parent
        for r in plan
        if r.source is Source.PARENT and r.damaged.tensor not in by_task
    }
    values: dict[str, np.ndarray] = {}
    for name in sorted({r.damaged.tensor for r in plan} - set(by_task) - set(derived)):
        values[name] = read_degraded(store, step, name, backend=backend, warn=lambda _msg: None)
    for name, parent in derived.items():
        assert parent is not None
        base = values.get(parent)
        if base is None:
            base = read_degraded(store, step, parent, backend=backend, warn=lambda _msg: None)
        values[name] = rebuild_value(m.artifact(name), base)
    put = put_tensors(
        store,
        comm,
        {n: bf16_bits(v) if m.artifact(n).dtype is DType.BF16 else v for n, v in values.items()},
        where={n: f"recovered {n!r}" for n in values},
        drop=by_task,
    )
    return put, tuple(by_task)
