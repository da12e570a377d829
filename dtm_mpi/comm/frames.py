"""DTM wire frames (``io/WIRE.md``): versioned, length-prefixed type-length-value messages with a
CRC32C trailer, for the messages ranks exchange about a run (the handshake first). Pure: bytes in,
values out; every way a frame can be wrong is a :class:`~dtm_mpi.errors.ProtocolError` naming
the part of the frame that is wrong (``magic``, ``major``, ``type``, ``length``, ``crc``, a field).

A frame::

    magic "DTMF" | major u8 | minor u8 | type u16 | length u32 | body (length bytes) | crc32c u32

and its body a sequence of fields, each ``tag u16 | kind u8 | size u32 | value``, tags strictly
increasing. Integers are little-endian. The CRC32C (Castagnoli, RFC 3720) covers every byte
before it. A decoder skips fields whose tag it does not know (a later minor version may add
them) and refuses a major version it does not know.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dtm_mpi.errors import ProtocolError

__all__ = [
    "FRAME_PARTS",
    "HEADER",
    "MAGIC",
    "MAJOR",
    "MAX_BODY",
    "MAX_VALUE",
    "MINOR",
    "Field",
    "Frame",
    "Kind",
    "MessageType",
    "crc32c",
    "decode_frame",
    "encode_frame",
]

MAGIC = b"DTMF"
MAJOR, MINOR = 1, 4
HEADER = struct.Struct("<4sBBHI")  # magic, major, minor, type, body length
TRAILER = struct.Struct("<I")  # crc32c
FIELD = struct.Struct("<HBI")  # tag, kind, size
MAX_BODY = 64 * 2**20
"""The largest body a frame may declare (64 MiB): a larger length is refused before reading."""
MAX_VALUE = 16 * 2**20
"""The largest single field value (16 MiB)."""
MAX_ITEMS = 65536
"""The most items in one ``strs`` or ``u64s`` field."""
FRAME_PARTS = ("magic", "major", "length", "crc", "type", "body")
"""The parts of a frame outside its fields that a :class:`ProtocolError` may name."""


def crc32c(data: Any) -> int:
    """CRC32C (Castagnoli) of ``data`` (any C-contiguous buffer: bytes, a memoryview, a numpy
    array), hardware-accelerated by the ``crc32c`` package (which releases the GIL on large
    buffers)."""
    import crc32c as _crc

    return int(_crc.crc32c(data))


class MessageType(enum.IntEnum):
    """What a frame carries (``type``)."""

    HELLO = 1
    """The handshake: what a rank runs (:class:`~dtm_mpi.comm.handshake.Hello`)."""
    FAILURES = 2
    """A failure notice on the control channel: ranks that failed, their phases, messages."""
    PING = 3
    """A liveness question on the control channel."""
    PONG = 4
    """Its answer: what the rank communicates now, its phase and phase count."""
    END = 5
    """A rank printed its last line (the error) and ends the job."""
    OUTCOME = 6
    """An agreement's first round (or an exchange): a rank's phase, whether it succeeded, its
    message."""
    VIEW = 7
    """An agreement's second round: the outcomes a rank heard, by rank."""
    OBJECT = 8
    """A value one implementation's ranks pass among themselves (a checkpoint's manifest
    pieces and verdicts, a live resize's call to a parked rank): what it is, and its bytes
    in that implementation's own encoding (dtm_mpi: pickle, read only once the frame
    verified)."""


class Kind(enum.IntEnum):
    """How a field's value is written (``kind``)."""

    U64 = 1  # 8 bytes, unsigned
    I64 = 2  # 8 bytes, two's complement
    BOOL = 3  # 1 byte, 0 or 1
    STR = 4  # UTF-8
    BYTES = 5
    STRS = 6  # u32 count, then per string u32 size and UTF-8 bytes
    U64S = 7  # u32 count, then 8 bytes per integer


Value = int | bool | str | bytes | tuple[str, ...] | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Field:
    """A field of a message type's schema: its ``tag``, ``name`` and ``kind``."""

    tag: int
    name: str
    kind: Kind


SCHEMAS: Mapping[MessageType, tuple[Field, ...]] = {
    MessageType.HELLO: (
        Field(1, "protocol", Kind.U64),
        Field(2, "version", Kind.STR),
        Field(3, "module_hash", Kind.STR),
        Field(4, "mesh", Kind.STR),
        Field(5, "capabilities", Kind.STRS),
        Field(6, "backend", Kind.STR),
        Field(7, "deterministic", Kind.BOOL),
        Field(8, "gpu_aware", Kind.STR),
        Field(9, "steps", Kind.U64),
        Field(10, "buckets", Kind.U64),
        Field(11, "pipeline", Kind.STRS),
        Field(12, "integrity", Kind.BOOL),
        Field(13, "audit_every", Kind.U64),
        Field(14, "quant_allreduce", Kind.U64),
        Field(15, "deterministic_matmul", Kind.STR),
        Field(16, "gemm", Kind.STR),
    ),
    MessageType.FAILURES: (
        Field(1, "reporter", Kind.U64),
        Field(2, "ranks", Kind.U64S),
        Field(3, "phases", Kind.STRS),
        Field(4, "messages", Kind.STRS),
    ),
    MessageType.PING: (Field(1, "rank", Kind.U64),),
    MessageType.PONG: (
        Field(1, "rank", Kind.U64),
        Field(2, "doing", Kind.STR),
        Field(3, "phase", Kind.STR),
        Field(4, "seq", Kind.U64),
    ),
    MessageType.END: (Field(1, "error", Kind.STR),),
    MessageType.OUTCOME: (
        Field(1, "phase", Kind.STR),
        Field(2, "ok", Kind.BOOL),
        Field(3, "message", Kind.STR),
    ),
    MessageType.VIEW: (
        Field(1, "ranks", Kind.U64S),
        Field(2, "oks", Kind.U64S),
        Field(3, "messages", Kind.STRS),
    ),
    MessageType.OBJECT: (
        Field(1, "what", Kind.STR),
        Field(2, "part", Kind.U64),
        Field(3, "parts", Kind.U64),
        Field(4, "payload", Kind.BYTES),
    ),
}
"""Each message type's fields (the one home of tags and kinds: ``io/WIRE.md`` lists them)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame: its message ``type``, ``minor`` version and field values by name
    (fields of its schema only; unknown tags skipped)."""

    type: MessageType
    minor: int
    values: Mapping[str, Value]


def _encode_value(f: Field, value: Value) -> bytes:
    kind = f.kind
    if kind is Kind.BOOL:
        if not isinstance(value, bool):
            raise ProtocolError(f"field {f.name}: a bool, got {value!r}", field=f.name)
        return b"\x01" if value else b"\x00"
    if kind in (Kind.U64, Kind.I64):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"field {f.name}: an integer, got {value!r}", field=f.name)
        try:
            return struct.pack("<Q" if kind is Kind.U64 else "<q", value)
        except struct.error:
            raise ProtocolError(
                f"field {f.name}: {value} does not fit {kind.name.lower()}", field=f.name
            ) from None
    if kind is Kind.STR:
        if not isinstance(value, str):
            raise ProtocolError(f"field {f.name}: a string, got {value!r}", field=f.name)
        return value.encode("utf-8")
    if kind is Kind.BYTES:
        if not isinstance(value, bytes):
            raise ProtocolError(f"field {f.name}: bytes, got {value!r}", field=f.name)
        return value
    if kind is Kind.U64S:
        if not isinstance(value, tuple | list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**64 for i in value
        ):
            raise ProtocolError(
                f"field {f.name}: a sequence of u64 integers, got {value!r}", field=f.name
            )
        if len(value) > MAX_ITEMS:
            raise ProtocolError(
                f"field {f.name}: {len(value)} integers (at most {MAX_ITEMS})", field=f.name
            )
        return struct.pack(f"<I{len(value)}Q", len(value), *value)
    if not isinstance(value, tuple | list) or not all(isinstance(s, str) for s in value):
        raise ProtocolError(f"field {f.name}: a sequence of strings, got {value!r}", field=f.name)
    if len(value) > MAX_ITEMS:
        raise ProtocolError(
            f"field {f.name}: {len(value)} strings (at most {MAX_ITEMS})", field=f.name
        )
    parts = [struct.pack("<I", len(value))]
    for s in value:
        data = str(s).encode("utf-8")
        parts += [struct.pack("<I", len(data)), data]
    return b"".join(parts)


def encode_frame(type: MessageType, values: Mapping[str, Value], *, minor: int = MINOR) -> bytes:
    """The frame of message ``type`` with field ``values`` (every field of its schema)."""
    schema = SCHEMAS[type]
    unknown = set(values) - {f.name for f in schema}
    if unknown:
        raise ProtocolError(
            f"{type.name}: no field(s) {', '.join(sorted(unknown))}", field=sorted(unknown)[0]
        )
    body = []
    for f in schema:
        if f.name not in values:
            raise ProtocolError(f"{type.name}: field {f.name} is missing", field=f.name)
        data = _encode_value(f, values[f.name])
        if len(data) > MAX_VALUE:
            raise ProtocolError(
                f"field {f.name}: {len(data)} bytes (at most {MAX_VALUE})", field=f.name
            )
        body += [FIELD.pack(f.tag, int(f.kind), len(data)), data]
    payload = b"".join(body)
    if len(payload) > MAX_BODY:
        raise ProtocolError(
            f"{type.name}: a body of {len(payload)} bytes (at most {MAX_BODY})", field="length"
        )
    head = HEADER.pack(MAGIC, MAJOR, minor, int(type), len(payload)) + payload
    return head + TRAILER.pack(crc32c(head))


def decode_frame(data: bytes | memoryview, *, expect: MessageType | None = None) -> Frame:
    """The frame in ``data`` (exactly one frame), checked: a :class:`ProtocolError` naming
    what is wrong, checked in this order: too short for a header (``length``), ``magic``,
    ``major``, a declared ``length`` over :data:`MAX_BODY` or other than the bytes given,
    ``crc``, ``type`` (unknown, or not ``expect``), then the fields (a truncated field, tags
    out of order, a value of another kind or size than its schema's, a missing field)."""
    buf = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    n = len(buf)
    if n < HEADER.size + TRAILER.size:
        raise ProtocolError(
            f"a frame of {n} bytes is truncated: the header and trailer take {HEADER.size + TRAILER.size}",
            field="length",
        )
    magic, major, minor, type_code, length = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad magic {bytes(magic)!r} (a DTM frame starts {MAGIC!r})", field="magic"
        )
    if major != MAJOR:
        raise ProtocolError(
            f"unknown major version {major} (this decoder reads {MAJOR})", field="major"
        )
    if length > MAX_BODY:
        raise ProtocolError(
            f"a body of {length} bytes is over the limit ({MAX_BODY})", field="length"
        )
    want = HEADER.size + length + TRAILER.size
    if n != want:
        raise ProtocolError(
            f"the header declares a {length}-byte body ({want} bytes in all); {n} bytes arrived"
            + (" (truncated)" if n < want else " (trailing bytes)"),
            field="length",
        )
    end = HEADER.size + length
    (stated,) = TRAILER.unpack_from(buf, end)
    actual = crc32c(buf[:end])
    if stated != actual:
        raise ProtocolError(
            f"CRC32C mismatch: the trailer says {stated:08x}, the bytes give {actual:08x} (corrupted)",
            field="crc",
        )
    try:
        mtype = MessageType(type_code)
    except ValueError:
        raise ProtocolError(f"unknown message type {type_code}", field="type") from None
    if expect is not None and mtype is not expect:
        raise ProtocolError(
            f"a {mtype.name} frame where a {expect.name} was expected", field="type"
        )
    return Frame(mtype, minor, _decode_fields(mtype, buf[HEADER.size : end]))


def _decode_fields(mtype: MessageType, body: memoryview) -> dict[str, Value]:
    by_tag = {f.tag: f for f in SCHEMAS[mtype]}
    out: dict[str, Value] = {}
    at, last = 0, 0
    while at < len(body):
        if len(body) - at < FIELD.size:
            raise ProtocolError(f"a field header at body offset {at} is truncated", field="body")
        tag, kind, size = FIELD.unpack_from(body, at)
        at += FIELD.size
        name = by_tag[tag].name if tag in by_tag else f"tag {tag}"
        if tag <= last:
            raise ProtocolError(
                f"field {name}: tag {tag} after tag {last} (tags increase)", field=name
            )
        last = tag
        if size > len(body) - at:
            raise ProtocolError(
                f"field {name}: {size} bytes declared, {len(body) - at} left in the body",
                field=name,
            )
        value = body[at : at + size]
        at += size
        f = by_tag.get(tag)
        if f is None:
            continue  # a later minor version's field
        if kind != f.kind:
            raise ProtocolError(
                f"field {f.name}: kind {kind}, its schema says {int(f.kind)} ({f.kind.name.lower()})",
                field=f.name,
            )
        out[f.name] = _decode_value(f, value)
    missing = [f.name for f in SCHEMAS[mtype] if f.name not in out]
    if missing:
        raise ProtocolError(f"{mtype.name}: field {missing[0]} is missing", field=missing[0])
    return out


def _utf8(f: Field, data: memoryview) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ProtocolError(f"field {f.name}: not UTF-8 ({err.reason})", field=f.name) from None


def _decode_value(f: Field, data: memoryview) -> Value:
    kind, n = f.kind, len(data)
    if kind in (Kind.U64, Kind.I64):
        if n != 8:
            raise ProtocolError(f"field {f.name}: {n} bytes, an integer takes 8", field=f.name)
        return int(struct.unpack("<Q" if kind is Kind.U64 else "<q", data)[0])
    if kind is Kind.BOOL:
        if n != 1 or data[0] > 1:
            raise ProtocolError(f"field {f.name}: a bool is one byte 0 or 1", field=f.name)
        return data[0] == 1
    if kind is Kind.STR:
        return _utf8(f, data)
    if kind is Kind.BYTES:
        return bytes(data)
    if kind is Kind.U64S:
        if n < 4:
            raise ProtocolError(f"field {f.name}: no count", field=f.name)
        (count,) = struct.unpack_from("<I", data, 0)
        if count > MAX_ITEMS or n != 4 + 8 * count:
            raise ProtocolError(
                f"field {f.name}: {n} bytes do not hold a count of {count} and its integers",
                field=f.name,
            )
        return tuple(int(i) for i in struct.unpack_from(f"<{count}Q", data, 4))
    if n < 4:
        raise ProtocolError(f"field {f.name}: no string count", field=f.name)
    (count,) = struct.unpack_from("<I", data, 0)
    if count > MAX_ITEMS:
        raise ProtocolError(f"field {f.name}: {count} strings (at most {MAX_ITEMS})", field=f.name)
    at, items = 4, []
    for i in range(count):
        if n - at < 4:
            raise ProtocolError(f"field {f.name}: string {i} of {count} is truncated", field=f.name)
        (size,) = struct.unpack_from("<I", data, at)
        at += 4
        if size > n - at:
            raise ProtocolError(f"field {f.name}: string {i} of {count} is truncated", field=f.name)
        items.append(_utf8(f, data[at : at + size]))
        at += size
    if at != n:
        raise ProtocolError(
            f"field {f.name}: {n - at} bytes after its {count} strings", field=f.name
        )
    return tuple(items)
