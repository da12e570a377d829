"""Frames (``io/WIRE.md``) over MPI point to point, for the control channel and the
agreements: a frame's bytes go out in one buffer ``Isend``; a waiting one is taken by probing
for its size. What arrives is decoded by the caller (a damaged frame is a
:class:`~dtm_mpi.errors.ProtocolError` it turns into a failure naming the sender)."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from dtm_mpi.comm.frames import HEADER, TRAILER, MessageType, decode_frame
from dtm_mpi.errors import CommError, ProtocolError

__all__ = [
    "isend_frame",
    "object_frame",
    "object_of",
    "recv_frame",
    "take_decoded",
    "take_frame",
]


def isend_frame(comm: Any, mpi: Any, frame: bytes, dest: int, tag: int) -> tuple[Any, Any]:
    """Post ``frame`` to ``dest``; returns (the request, the buffer to keep alive until it
    completes)."""
    buf = np.frombuffer(frame, dtype=np.uint8)
    return comm.Isend([buf, mpi.BYTE], dest=dest, tag=tag), buf


def recv_frame(comm: Any, mpi: Any, status: Any) -> bytes:
    """The frame ``status`` (of a successful probe) announces, received."""
    n = status.Get_count(mpi.BYTE)
    buf = bytearray(n)
    comm.Recv([buf, mpi.BYTE], source=status.Get_source(), tag=status.Get_tag())
    return bytes(buf)


def take_frame(comm: Any, mpi: Any, source: int, tag: int, status: Any) -> bytes | None:
    """A frame from ``source`` (``mpi.ANY_SOURCE``: any) with ``tag`` if one is waiting
    (``status`` then says who sent it), else None; does not wait."""
    if not comm.Iprobe(source, tag, status):
        return None
    return recv_frame(comm, mpi, status)


def take_decoded(
    comm: Any, mpi: Any, source: int, tag: int, status: Any, kind: MessageType
) -> tuple[int, dict[str, Any] | ProtocolError] | None:
    """:func:`take_frame`, decoded as a ``kind`` frame: (its sender, its fields, or the
    :class:`ProtocolError` saying how it arrived damaged, its ``rank`` the sender); None if
    none waits."""
    data = take_frame(comm, mpi, source, tag, status)
    if data is None:
        return None
    sender = int(status.Get_source())
    try:
        return sender, dict(decode_frame(data, expect=kind).values)
    except ProtocolError as err:
        err.rank = sender
        return sender, err


OBJECT_PART = 8 * 2**20
"""The payload bytes of one OBJECT frame: a larger value travels as consecutive frames."""


def object_frame(obj: Any, what: str, rank: int) -> np.ndarray:
    """``obj`` as OBJECT frames (``io/WIRE.md``; its payload pickled, cut into parts of
    :data:`OBJECT_PART` bytes, one frame each, back to back), the bytes this rank sends.
    ``DTM_FAULT=RANK:object:corrupt`` flips one bit of them, as in flight."""
    from dtm_mpi.comm.frames import encode_frame
    from dtm_mpi.faults import corrupt_in_place

    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    parts = max(1, -(-len(payload) // OBJECT_PART))
    frames = [
        encode_frame(
            MessageType.OBJECT,
            {
                "what": what,
                "part": k,
                "parts": parts,
                "payload": payload[k * OBJECT_PART : (k + 1) * OBJECT_PART],
            },
        )
        for k in range(parts)
    ]
    buf = np.frombuffer(b"".join(frames), np.uint8).copy()
    corrupt_in_place(rank, "object", buf)
    return buf


def object_of(data: Any, sender: int, rank: int, what: str, phase: str) -> Any:
    """The object in the OBJECT frames ``data`` from rank ``sender``, unpickled only once
    every frame verified and the parts are all there, in order; a damaged one is a
    :class:`~dtm_mpi.errors.CommError` naming the sender, what it carried and the check
    that caught it."""
    view = memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1).tobytes())
    chunks: list[bytes] = []
    try:
        at, parts = 0, 1
        while len(chunks) < parts:
            if len(view) - at < HEADER.size:
                raise ProtocolError(
                    f"part {len(chunks)} is truncated ({len(view) - at} bytes)", field="length"
                )
            end = at + HEADER.size + HEADER.unpack_from(view, at)[4] + TRAILER.size
            values = decode_frame(view[at:end], expect=MessageType.OBJECT).values
            part, count, payload = values["part"], values["parts"], values["payload"]
            assert isinstance(part, int) and isinstance(count, int), "the schema's u64s"
            assert isinstance(payload, bytes), "the schema's bytes"
            parts = count
            if part != len(chunks):
                raise ProtocolError(
                    f"part {part} of {parts} where part {len(chunks)} was due", field="part"
                )
            chunks.append(payload)
            at = end
        if at != len(view):
            raise ProtocolError(f"{len(view) - at} bytes after the last part", field="length")
    except ProtocolError as err:
        raise CommError(
            f"rank {rank}: {what} from rank {sender} arrived corrupt ({err}; wrong: {err.field})",
            rank=rank,
            phase=phase,
        ) from None
    return pickle.loads(b"".join(chunks))
