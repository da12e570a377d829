"""Wire frames (io/WIRE.md): the vectors, round trips, and fuzzing -- every way a frame can be
damaged is a ProtocolError naming the part, never another exception and never a wrong value."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtm_mpi.comm.frames import MAX_BODY, MessageType, crc32c, decode_frame, encode_frame
from dtm_mpi.comm.handshake import Hello, hello_frame, parse_hello
from dtm_mpi.errors import ProtocolError
from tests.depth import examples

VECTORS = Path(__file__).resolve().parents[2] / "io" / "vectors" / "wire"
VALID = sorted((VECTORS / "valid").glob("*.json"))
INVALID = sorted((VECTORS / "invalid").glob("*.json"))
FUZZ = settings(
    max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _values(v: dict[str, object]) -> dict[str, object]:
    return {k: tuple(x) if isinstance(x, list) else x for k, x in v.items()}


def test_crc32c_is_castagnoli() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value (RFC 3720)


@pytest.mark.parametrize("path", VALID, ids=[p.stem for p in VALID])
def test_valid_vectors_encode_to_their_bytes_and_decode_to_their_values(path: Path) -> None:
    doc = json.loads(path.read_text())
    frame = bytes.fromhex(doc["frame"])
    got = decode_frame(frame, expect=MessageType[doc["type"]])
    assert dict(got.values) == _values(doc["values"])
    if not doc.get("decode_only"):
        assert encode_frame(MessageType[doc["type"]], _values(doc["values"])) == frame


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_vectors_are_rejected_naming_their_part(path: Path) -> None:
    doc = json.loads(path.read_text())
    with pytest.raises(ProtocolError) as err:
        decode_frame(bytes.fromhex(doc["frame"]), expect=MessageType.HELLO)
    assert err.value.field == doc["part"], err.value


def test_the_vectors_cover_every_check() -> None:
    parts = {json.loads(p.read_text())["part"] for p in INVALID}
    assert {"length", "magic", "major", "crc", "type"} <= parts
    assert len(VALID) >= 2 and len(INVALID) >= 12


def _plain() -> bytes:
    return bytes.fromhex(json.loads((VECTORS / "valid" / "hello_plain.json").read_text())["frame"])


def test_every_single_bit_flip_and_every_truncation_is_caught() -> None:
    frame = _plain()
    for at in range(len(frame)):
        for bit in range(8):
            bad = bytearray(frame)
            bad[at] ^= 1 << bit
            with pytest.raises(ProtocolError) as err:
                decode_frame(bytes(bad), expect=MessageType.HELLO)
            assert err.value.field in ("magic", "major", "length", "crc"), (at, bit, err.value)
    for n in range(len(frame)):
        with pytest.raises(ProtocolError, match="truncated") as err:
            decode_frame(frame[:n])
        assert err.value.field == "length"


def test_an_oversized_length_is_refused_before_reading() -> None:
    head = b"DTMF" + struct.pack("<BBHI", 1, 0, 1, MAX_BODY + 1)
    with pytest.raises(ProtocolError, match="over the limit") as err:
        decode_frame(head + b"\0" * 4)
    assert err.value.field == "length"


def test_encoding_checks_the_values_against_the_schema() -> None:
    v = _values(json.loads((VECTORS / "valid" / "hello_plain.json").read_text())["values"])
    with pytest.raises(ProtocolError, match="field steps: an integer") as err:
        encode_frame(MessageType.HELLO, {**v, "steps": "many"})
    assert err.value.field == "steps"
    with pytest.raises(ProtocolError, match="does not fit u64"):
        encode_frame(MessageType.HELLO, {**v, "steps": -1})
    with pytest.raises(ProtocolError, match="field backend is missing"):
        encode_frame(MessageType.HELLO, {k: x for k, x in v.items() if k != "backend"})
    with pytest.raises(ProtocolError, match="no field"):
        encode_frame(MessageType.HELLO, {**v, "colour": "red"})


texts = st.text(max_size=40)
hellos = st.builds(
    Hello,
    protocol=st.integers(0, 2**64 - 1),
    version=texts,
    module_hash=texts,
    mesh=texts,
    capabilities=st.lists(texts, max_size=4).map(tuple),
    backend=texts,
    deterministic=st.booleans(),
    gpu_aware=texts,
    steps=st.integers(0, 2**64 - 1),
    buckets=st.integers(0, 2**64 - 1),
    pipeline=st.lists(texts, max_size=4).map(tuple),
    integrity=st.booleans(),
)


@FUZZ
@given(hello=hellos)
def test_any_hello_round_trips(hello: Hello) -> None:
    assert parse_hello(hello_frame(hello)) == hello


@FUZZ
@given(
    hello=hellos,
    edits=st.lists(
        st.tuples(
            st.sampled_from(["flip", "cut", "insert", "delete"]),
            st.integers(0, 10**6),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_a_damaged_frame_is_a_protocol_error_or_the_same_hello(
    hello: Hello, edits: list[tuple[str, int, int]]
) -> None:
    frame = bytearray(hello_frame(hello))
    for what, at, byte in edits:
        i = at % (len(frame) + 1)
        if what == "flip" and i < len(frame):
            frame[i] ^= byte or 1
        elif what == "cut":
            del frame[i:]
        elif what == "insert":
            frame[i:i] = bytes([byte])
        elif what == "delete" and i < len(frame):
            del frame[i]
    try:
        got = parse_hello(bytes(frame))
    except ProtocolError as err:
        assert err.field
        return
    assert got == hello  # only when the edits cancelled out


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_are_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_frame(data)


@FUZZ
@given(body=st.binary(max_size=200), minor=st.integers(0, 255))
def test_a_well_framed_random_body_is_a_protocol_error_or_a_hello(body: bytes, minor: int) -> None:
    """The fields' checks on their own (the CRC right, the body anything)."""
    head = b"DTMF" + struct.pack("<BBHI", 1, minor, 1, len(body)) + body
    frame = head + struct.pack("<I", crc32c(head))
    try:
        decode_frame(frame, expect=MessageType.HELLO)
    except ProtocolError as err:
        assert err.field
