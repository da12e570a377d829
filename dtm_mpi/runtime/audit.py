"""The replica audit (``DTM_AUDIT_EVERY=N``, ``dtm run --audit-every N``,
``fit(audit_every=N)``): after every N-th step, before every checkpoint and live resize and
after the last step, each state
tensor's blocks are compared by their CRC32C across the ranks that hold the same block of it
(its replicas). Replicas hold the same bits by construction, deterministic mode or not: the
ranks that differ only on mesh axes the tensor's layout does not use (dp replicas, and tp
replicas of a replicated tensor) compute its update from the same bits (every member of an
allreduce holds the same result). A mismatch -- a bit flipped in memory, a faulty core's
wrong result -- is one error on every rank naming the tensor, the step and the odd rank(s) by
majority, and no checkpoint after it is written, so ``--resume`` starts from the newest
checkpoint before it that verifies.

Planning is pure (:func:`replica_groups`, the same on every rank); the check is one
allreduce of a (ranks x audited tensors) table of checksums, and the verdict
(:func:`divergences`) is a pure function of that table. A tensor without replicas (sharded
over every axis) cannot be audited this way: :attr:`ReplicaAudit.unaudited` names them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dtm_mpi.comm.frames import crc32c
from dtm_mpi.errors import ReplicaDivergenceError, agreed
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.sharding.steps import allreduce_spec

if TYPE_CHECKING:
    from dtm_mpi.comm.interface import Comm
    from dtm_mpi.ir.nodes import Function
    from dtm_mpi.sharding.blocks import Pin
    from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["Audited", "ReplicaAudit", "divergences", "replica_audit", "replica_groups"]


@dataclass(frozen=True, slots=True)
class Audited:
    """One state tensor the audit compares: its entry parameter's position and name, and the
    groups of ranks holding the same block of it (each of two ranks or more)."""

    index: int
    name: str
    groups: tuple[tuple[int, ...], ...]


def replica_groups(
    entry: Function, mesh: MeshShape, pins: Mapping[str, Pin] | None = None
) -> tuple[tuple[Audited, ...], tuple[str, ...]]:
    """The state tensors of ``entry`` on ``mesh`` that have replicas, with their replica
    groups (ranks with the same coordinates on the axes the tensor's layout uses; with
    ``pins``, a pipelined run's, only the ranks of the stage holding it), and the names of
    those that have none (pure)."""
    audited, alone = [], []
    for i, p in enumerate(entry.params):
        if not p.state:
            continue
        name = p.name.lstrip("%")
        axes = p.type.layout.used_axes
        pin = pins.get(name) if pins else None
        by_block: dict[tuple[int, ...], list[int]] = {}
        for r in range(mesh.size):
            if pin is not None and mesh.index_along(r, (pin[0],)) != pin[1]:
                continue
            key = tuple(mesh.index_along(r, (a,)) for a in axes)
            by_block.setdefault(key, []).append(r)
        groups = tuple(tuple(g) for g in by_block.values() if len(g) > 1)
        if groups:
            audited.append(Audited(i, name, groups))
        else:
            alone.append(name)
    return tuple(audited), tuple(alone)


def divergences(table: np.ndarray, audited: Sequence[Audited]) -> list[str]:
    """Each replica group whose members' checksums differ (``table[rank, k]``: the checksum
    of rank ``rank``'s block of ``audited[k]``), as a sentence naming the tensor and the odd
    rank(s): those outside the majority, or every member where no checksum has one."""
    found = []
    for k, a in enumerate(audited):
        for group in a.groups:
            sums = [int(table[r, k]) for r in group]
            if len(set(sums)) == 1:
                continue
            (top, count), *_ = Counter(sums).most_common()
            if count <= len(group) // 2:  # no majority: every member is suspect
                found.append(
                    f"{a.name} differs across its replicas on ranks {_ranks(group)} (no majority: "
                    + ", ".join(f"rank {r} {s - 1:08x}" for r, s in zip(group, sums, strict=True))
                    + ")"
                )
                continue
            odd = [r for r, s in zip(group, sums, strict=True) if s != top]
            found.append(
                f"{a.name} on rank(s) {_ranks(odd)} differs from its replicas on ranks {_ranks(group)} "
                f"(CRC32C {top - 1:08x} on {count} of {len(group)}; "
                + ", ".join(f"rank {r} {int(table[r, k]) - 1:08x}" for r in odd)
                + ")"
            )
    return found


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


class ReplicaAudit:
    """The audit of one rank's state every ``every`` steps over ``comm`` (its mesh: the
    run's); ``entry``: the step's entry function (its state parameters, in the order of the
    step loop's blocks); ``pins``: a pipelined run's stage of each state tensor;
    ``to_host``: a block as a host array (a GPU backend's copy)."""

    def __init__(
        self,
        comm: Comm,
        entry: Function,
        every: int,
        pins: Mapping[str, Pin] | None = None,
        to_host: Callable[[Any], np.ndarray] = np.asarray,
    ) -> None:
        self.comm, self.every, self.to_host = comm, every, to_host
        self.rank, self.size = comm.rank, comm.mesh.size
        self.audited, self.unaudited = replica_groups(entry, comm.mesh, pins)
        self.axes = comm.mesh.axis_names
        self.spec = allreduce_spec(
            comm.mesh, comm.rank, self.axes, ReduceOp.SUM, self.size * len(self.audited)
        )
        self._mine = [
            k for k, a in enumerate(self.audited) if any(self.rank in g for g in a.groups)
        ]

    def due(self, done: int) -> bool:
        """Whether the audit runs after ``done`` steps (every ``every``-th)."""
        return self.every > 0 and done % self.every == 0

    def check(self, done: int, blocks: Sequence[Any]) -> None:
        """Compare this rank's blocks of the audited tensors with their replicas' after
        ``done`` steps; raises an agreed :class:`ReplicaDivergenceError` on every rank where
        any differ.

        Collective: call on all ranks."""
        if not self.audited:
            return
        table = np.zeros((self.size, len(self.audited)), dtype=np.int64)
        for k in self._mine:
            block = blocks[self.audited[k].index]
            host = np.ascontiguousarray(self.to_host(block))
            table[self.rank, k] = crc32c(host.reshape(-1).view(np.uint8)) + 1  # 0: not held
        total = self.comm.allreduce(table.reshape(-1), self.axes, self.spec)
        found = divergences(np.asarray(total).reshape(self.size, -1), self.audited)
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise agreed(
                ReplicaDivergenceError(
                    f"replica audit after step {done}: {found[0]}{more}; the state diverged in "
                    "compute or memory (resume from the newest checkpoint that verifies: --resume)"
                )
            )


def replica_audit(
    comm: Comm,
    entry: Function,
    pins: Mapping[str, Pin] | None = None,
    to_host: Callable[[Any], np.ndarray] = np.asarray,
) -> ReplicaAudit | None:
    """The run's replica audit every ``DTM_AUDIT_EVERY`` steps (None when that is 0): what
    both launchers' step loops run."""
    from dtm_mpi.config import get_config

    every = get_config().audit_every
    return ReplicaAudit(comm, entry, every, pins, to_host) if every else None
