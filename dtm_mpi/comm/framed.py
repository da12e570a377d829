"""Frames (``io/WIRE.md``) over MPI point to point, for the control channel and the
agreements: a frame's bytes go out in one buffer ``Isend``; a waiting one is taken by probing
for its size. What arrives is decoded by the caller (a damaged frame is a
:class:`~dtm_mpi.errors.ProtocolError` it turns into a failure naming the sender)."""

from __future__ import annotations

from typing import Any

import numpy as np

from dtm_mpi.comm.frames import MessageType, decode_frame
from dtm_mpi.errors import ProtocolError

__all__ = ["isend_frame", "recv_frame", "take_decoded", "take_frame"]


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
