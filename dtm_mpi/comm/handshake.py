"""The handshake ("Hello/JoinMesh"): before any data moves, every rank states what it runs
and all ranks check they agree.

Each rank contributes a :class:`Hello` (protocol version, dtm_mpi version, module hash, bound
mesh, capabilities, backend, deterministic mode and its matmul precision, ``--steps``, the
overlapped allreduces' bucket size). The hellos travel as HELLO frames (``io/WIRE.md``:
versioned, CRC32C-checked), exchanged with bounded non-blocking allgathers (lengths, then the
frames, then what each rank found wrong: a corrupted frame is named with its sender on every
rank) and compared field by field, so a mismatch raises the same
:class:`~dtm_mpi.errors.HandshakeError` everywhere, naming each differing field and which
ranks hold which value.

``gpu_aware`` is this rank's own answer to "does MPI take device buffers" (e.g.
``yes (vendor query)``, ``""`` when not asked): ranks may legitimately differ (nodes with
different MPI builds or drivers), and the handshake comes before any other collective, so
the field is carried for the run log and not compared (:data:`LOCAL_FIELDS`); the job's
decision is agreed afterwards by :func:`~dtm_mpi.comm.gpu_aware.agree_gpu_aware`. So is
``gemm``, the rank's GEMM provider per shape class, measured on its node: the job uses the
ranks' common choice, else numpy's (:func:`use_agreed_gemm`; the benchmarks' workers, which
run without a handshake, exchange it with :func:`agree_gemm`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dtm_mpi.comm.frames import FRAME_PARTS, SCHEMAS, MessageType, decode_frame, encode_frame
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.errors import HandshakeError, ProtocolError
from dtm_mpi.log import log_info, logger

__all__ = [
    "LOCAL_FIELDS",
    "PROTOCOL_VERSION",
    "Hello",
    "agree_gemm",
    "compare_hellos",
    "handshake",
    "hello_frame",
    "parse_hello",
    "use_agreed_gemm",
]

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
    integrity: bool = False  # payload integrity mode (DTM_INTEGRITY): both ends must check
    audit_every: int = 0  # the replica audit's period (DTM_AUDIT_EVERY): a collective, so alike
    quant_allreduce: int = 0  # quantized allreduce's block (DTM_QUANT_ALLREDUCE): other collectives
    deterministic_matmul: str = ""  # deterministic mode's matmul precision ("": not that mode)
    gemm: str = ""  # this rank's GEMM choice (kernels.gemm): the job uses the ranks' common one


LOCAL_FIELDS = frozenset({"gpu_aware", "gemm"})
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


def hello_frame(hello: Hello) -> bytes:
    """``hello`` as a HELLO frame (``io/WIRE.md``)."""
    return encode_frame(MessageType.HELLO, asdict(hello))


def parse_hello(data: bytes) -> Hello:
    """The :class:`Hello` of a HELLO frame (a :class:`ProtocolError` naming what is wrong)."""
    v = decode_frame(data, expect=MessageType.HELLO).values
    return Hello(**{k: v[k] for k in Hello.__dataclass_fields__})  # type: ignore[arg-type]


_WHAT = (*FRAME_PARTS, *(f.name for f in SCHEMAS[MessageType.HELLO]))
"""The parts of a HELLO frame a receiver can find wrong, by code (agreed between ranks)."""


def handshake(session: MpiSession, hello: Hello) -> list[Hello]:
    """Exchange and compare hellos (as frames: a corrupted one is named, with its sender, on
    every rank); returns every rank's hello.

    Collective: call on all ranks."""
    from dtm_mpi.faults import corrupted

    comm = session.comm
    data = corrupted(session.rank, "handshake", np.frombuffer(hello_frame(hello), dtype=np.uint8))
    lengths = np.zeros(session.size, dtype=np.int64)
    session.wait(comm.Iallgather(np.array([data.size], dtype=np.int64), lengths), "handshake")
    counts = [int(n) for n in lengths]
    displs = [int(d) for d in np.cumsum([0, *counts[:-1]])]
    everything = np.empty(sum(counts), dtype=np.uint8)
    session.wait(comm.Iallgatherv(data, [everything, (counts, displs)]), "handshake")
    hellos: list[Hello] = []
    mine = np.array([-1, -1], dtype=np.int64)  # the first corrupt sender here, what was wrong
    detail = ""
    for sender, (d, n) in enumerate(zip(displs, counts, strict=True)):
        try:
            hellos.append(parse_hello(everything[d : d + n].tobytes()))
        except ProtocolError as err:
            if mine[0] < 0:
                mine[:] = (sender, _WHAT.index(err.field) if err.field in _WHAT else len(_WHAT))
                detail = str(err)
    views = np.zeros(2 * session.size, dtype=np.int64)
    session.wait(comm.Iallgather(mine, views), "handshake")
    bad = [
        (r, int(views[2 * r]), int(views[2 * r + 1]))
        for r in range(session.size)
        if views[2 * r] >= 0
    ]
    if bad:
        at, sender, code = bad[0]
        what = _WHAT[code] if code < len(_WHAT) else "a field"
        if at == session.rank:
            log_info(session.rank, f"handshake: the hello frame from rank {sender}: {detail}")
        raise HandshakeError(
            f"handshake failed: the hello frame from rank {sender} arrived corrupt at rank(s) "
            f"{_ranks([r for r, _, _ in bad])} (wrong: {what})",
            phase="handshake",
        )
    compare_hellos(hellos)
    return hellos


def agree_gemm(comm: Any, setting: str, *, timeout_s: float) -> None:
    """For runs without a handshake (the benchmarks' workers): every rank's GEMM choice
    (``DTM_GEMM`` is ``setting``) exchanged, and the ranks' common one put in force, else
    numpy's (:func:`use_agreed_gemm`, as after a handshake).

    Collective: call on all ranks of ``comm``."""
    from dtm_mpi.comm.agreement import exchange_without_session
    from dtm_mpi.kernels.gemm import active_choice

    mine = active_choice(setting, own=True).text()
    texts = exchange_without_session(comm, mine, phase="GEMM choice", timeout_s=timeout_s)
    use_agreed_gemm(texts, int(comm.Get_rank()))


def use_agreed_gemm(texts: list[str], rank: int) -> None:
    """Put the job's GEMM choice in force from every rank's (``Hello.gemm``, in rank order:
    :func:`~dtm_mpi.kernels.gemm.agreed_choice`); rank 0 warns when the ranks chose
    differently."""
    from dtm_mpi.kernels.gemm import agreed_choice, use_choice

    choice, why = agreed_choice(texts)
    use_choice(choice)
    if why and rank == 0:
        logger().warning("[rank 0] dtm: %s", why)
