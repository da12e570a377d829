"""The handshake ("Hello/JoinMesh"): before any data moves, every rank states what it runs
and all ranks check they agree.

Each rank contributes a :class:`Hello` (protocol version, dtm_mpi version, module hash, bound
mesh, capabilities, backend, deterministic mode, ``--steps``, the overlapped allreduces' bucket
size). The hellos are exchanged with two bounded non-blocking allgathers (lengths, then JSON
bytes) and compared field by field on every rank,
so a mismatch raises the same :class:`~dtm_mpi.errors.HandshakeError` everywhere, naming each
differing field and which ranks hold which value.

``gpu_aware`` is this rank's own answer to "does MPI take device buffers" (e.g.
``yes (vendor query)``, ``""`` when not asked): ranks may legitimately differ (nodes with
different MPI builds or drivers), and the handshake comes before any other collective, so
the field is carried for the run log and not compared (:data:`LOCAL_FIELDS`); the job's
decision is agreed afterwards by :func:`~dtm_mpi.comm.gpu_aware.agree_gpu_aware`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.errors import HandshakeError

__all__ = ["LOCAL_FIELDS", "PROTOCOL_VERSION", "Hello", "compare_hellos", "handshake"]

PROTOCOL_VERSION = 1


@dataclass(frozen=True, slots=True)
class Hello:
    protocol: int
    version: str
    module_hash: str
    mesh: str
    capabilities: tuple[str, ...]
    backend: str
    deterministic: bool
    gpu_aware: str = ""
    steps: int = 0  # --steps: a rank told to run another number of steps would wait alone
    buckets: int = 0  # the overlapped allreduces' bucket bytes (0: none): plans them alike
    pipeline: tuple[str, ...] = ()  # a pipelined run's schedule and boundary values, per line


LOCAL_FIELDS = frozenset({"gpu_aware"})
"""Fields that describe one rank and may differ between ranks: not compared."""


def compare_hellos(hellos: list[Hello]) -> None:
    """Raise :class:`HandshakeError` naming every field on which the ranks differ (pure)."""
    problems = []
    for field in Hello.__dataclass_fields__:
        if field in LOCAL_FIELDS:
            continue
        values: dict[str, list[int]] = {}
        for rank, h in enumerate(hellos):
            values.setdefault(repr(getattr(h, field)), []).append(rank)
        if len(values) > 1 and field == "pipeline":
            problems.append(_first_difference([h.pipeline for h in hellos]))
        elif len(values) > 1:
            parts = [
                f"rank(s) {_ranks(rs)}: {v}"
                for v, rs in sorted(values.items(), key=lambda kv: kv[1][0])
            ]
            problems.append(f"{field} differs ({'; '.join(parts)})")
    if problems:
        raise HandshakeError("handshake failed: " + "; ".join(problems), phase="handshake")


def _first_difference(plans: list[tuple[str, ...]]) -> str:
    """The first line on which the ranks' pipeline plans differ, rank by rank."""
    at = next(
        i
        for i in range(max(len(p) for p in plans))
        if len({p[i] if i < len(p) else "(none)" for p in plans}) > 1
    )
    lines: dict[str, list[int]] = {}
    for rank, p in enumerate(plans):
        lines.setdefault(p[at] if at < len(p) else "(no such line)", []).append(rank)
    parts = [
        f"rank(s) {_ranks(rs)}: {line}"
        for line, rs in sorted(lines.items(), key=lambda kv: kv[1][0])
    ]
    return f"the pipeline plans differ (their stages were cut or traced differently) at line {at + 1}: {'; '.join(parts)}"


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def handshake(session: MpiSession, hello: Hello) -> list[Hello]:
    """Exchange and compare hellos; returns every rank's hello.

    Collective: call on all ranks."""
    comm = session.comm
    data = np.frombuffer(json.dumps(asdict(hello)).encode("utf-8"), dtype=np.uint8)
    lengths = np.zeros(session.size, dtype=np.int64)
    session.wait(comm.Iallgather(np.array([data.size], dtype=np.int64), lengths), "handshake")
    counts = [int(n) for n in lengths]
    displs = [int(d) for d in np.cumsum([0, *counts[:-1]])]
    everything = np.empty(sum(counts), dtype=np.uint8)
    session.wait(comm.Iallgatherv(data, [everything, (counts, displs)]), "handshake")
    hellos = []
    for d, n in zip(displs, counts, strict=True):
        raw = json.loads(everything[d : d + n].tobytes().decode("utf-8"))
        raw["capabilities"] = tuple(raw["capabilities"])
        raw["pipeline"] = tuple(raw.get("pipeline", ()))
        hellos.append(Hello(**raw))
    compare_hellos(hellos)
    return hellos
