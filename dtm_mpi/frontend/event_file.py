"""TensorBoard event files, written without TensorBoard: a run's metrics as scalars
(``fit(tensorboard=DIR)``, ``examples/llama.py --tensorboard DIR``), which ``tensorboard
--logdir DIR`` draws.

The format is TensorFlow's record file of ``Event`` protocol buffers, as TensorBoard's own
writer (and torch's ``SummaryWriter``) writes it:

* a **record**: ``length`` (u64, little-endian) | masked CRC32C of those 8 bytes (u32) |
  ``data`` (``length`` bytes) | masked CRC32C of ``data`` (u32); the mask is
  ``((crc >> 15) | (crc << 17)) + 0xa282ead8`` modulo 2**32;
* the first record's ``Event`` holds ``file_version = "brain.Event:2"``; each later one a
  ``wall_time`` (field 1, double), the ``step`` (field 2, int64) and a ``Summary`` (field 5)
  of ``Value`` messages, each a ``tag`` (field 1, string) and a ``simple_value`` (field 2,
  float).

The protocol buffers are encoded here (five fields; no protobuf runtime needed). A file is
named ``events.out.tfevents.<seconds>.<host>.<pid>.000.dtm`` in the directory (``.001``, ...
for another in the same second): TensorBoard reads the files in the order of their names, so
a resumed run writes a second file after the first and TensorBoard shows both as one run.
Each step's record is flushed: a killed run keeps every step it wrote. :func:`read_events` reads the
files back (the tests' check of the framing; TensorBoard's own reader is the other).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from dtm_mpi.comm.frames import crc32c
from dtm_mpi.errors import UsageError

__all__ = ["EventWriter", "read_events"]

FILE_VERSION = "brain.Event:2"
"""The first event of every file: the format's version, as TensorBoard's writer puts it."""
_MASK_DELTA = 0xA282EAD8
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # (int64 as protobuf encodes it: two's complement, 10 bytes if < 0)
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field_bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _record(data: bytes) -> bytes:
    head = _U64.pack(len(data))
    return head + _U32.pack(_masked_crc(head)) + data + _U32.pack(_masked_crc(data))


def encode_event(
    wall_time: float, *, step: int | None = None, scalars: Mapping[str, float] | None = None
) -> bytes:
    """One ``Event`` message: its wall time, step and scalar values (``file_version`` when
    neither is given: the file's first event)."""
    out = bytearray(_varint(1 << 3 | 1) + struct.pack("<d", wall_time))
    if step is not None:
        out += _varint(2 << 3 | 0) + _varint(step)
    if scalars is None:
        out += _field_bytes(3, FILE_VERSION.encode())
        return bytes(out)
    values = b"".join(
        _field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", v))
        for tag, v in scalars.items()
    )
    out += _field_bytes(5, values)
    return bytes(out)


def _new_file(where: Path) -> tuple[Path, BinaryIO]:
    """A file of this second, host and process that does not exist yet, opened (``.000``;
    ``.001``, ... for another writer within the same second)."""
    stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    for n in range(1000):
        path = where / f"{stem}.{n:03d}.dtm"
        try:
            return path, path.open("xb")
        except FileExistsError:
            continue
    raise FileExistsError(f"{stem}.*.dtm: a thousand files of this second exist")


class EventWriter:
    """Scalars per step to a new event file in ``directory`` (made if missing)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        where = Path(directory)
        try:
            where.mkdir(parents=True, exist_ok=True)
            self.path, out = _new_file(where)
            out.write(_record(encode_event(time.time())))
            out.flush()
        except OSError as exc:
            raise UsageError(f"tensorboard directory {where}: {exc.strerror or exc}") from None
        self.out: BinaryIO | None = out

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """The values of ``step``, each its own tag (a non-finite value is kept as it is)."""
        if self.out is None:
            return
        self.out.write(_record(encode_event(time.time(), step=step, scalars=values)))
        self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None


# -- reading back ----------------------------------------------------------------------------


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("a varint runs past the end of its message")
        b = buf[i]
        n |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return n, i


def _fields(buf: bytes) -> Iterator[tuple[int, int, bytes | int]]:
    """The (field, wire type, value) of a protobuf message: varints as ints, the rest as
    their bytes."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(buf, i)
            yield field, wire, v
        elif wire == 1:
            yield field, wire, buf[i : i + 8]
            i += 8
        elif wire == 2:
            n, i = _read_varint(buf, i)
            yield field, wire, buf[i : i + n]
            i += n
        elif wire == 5:
            yield field, wire, buf[i : i + 4]
            i += 4
        else:
            raise ValueError(f"wire type {wire} is not one an Event uses")
        if i > len(buf):
            raise ValueError("a field runs past the end of its message")


def _decode_event(data: bytes) -> dict[str, object]:
    event: dict[str, object] = {}
    for field, _wire, v in _fields(data):
        if field == 1 and isinstance(v, bytes):
            event["wall_time"] = struct.unpack("<d", v)[0]
        elif field == 2 and isinstance(v, int):
            event["step"] = v - (1 << 64) if v >> 63 else v
        elif field == 3 and isinstance(v, bytes):
            event["file_version"] = v.decode()
        elif field == 5 and isinstance(v, bytes):
            scalars: dict[str, float] = {}
            for f, _w, value in _fields(v):
                if f != 1 or not isinstance(value, bytes):
                    continue
                parts = {ff: vv for ff, _ww, vv in _fields(value)}
                tag, simple = parts.get(1), parts.get(2)
                if isinstance(tag, bytes) and isinstance(simple, bytes):
                    scalars[tag.decode()] = struct.unpack("<f", simple)[0]
            event["scalars"] = scalars
    return event


def read_events(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """The events of one event file, each a dict of ``wall_time``, ``step``,
    ``file_version`` and ``scalars`` (those it has); a record whose length or checksum is
    wrong is an error naming the file and the record's offset."""
    p = Path(path)
    data = p.read_bytes()
    out, i = [], 0
    while i < len(data):
        head = data[i : i + 8]
        if len(head) < 8 or len(data) < i + 12:
            raise UsageError(f"{p}: a record cut short at byte {i}")
        if _U32.unpack_from(data, i + 8)[0] != _masked_crc(head):
            raise UsageError(f"{p}: the length checksum of the record at byte {i} is wrong")
        (n,) = _U64.unpack(head)
        body = data[i + 12 : i + 12 + n]
        if len(body) < n or len(data) < i + 16 + n:
            raise UsageError(f"{p}: the record at byte {i} is cut short")
        if _U32.unpack_from(data, i + 12 + n)[0] != _masked_crc(body):
            raise UsageError(f"{p}: the data checksum of the record at byte {i} is wrong")
        try:
            out.append(_decode_event(body))
        except ValueError as exc:
            raise UsageError(f"{p}: the record at byte {i} is not an Event ({exc})") from None
        i += 16 + n
    return out
