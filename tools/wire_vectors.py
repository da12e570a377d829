"""Write the wire-frame vectors of io/WIRE.md (io/vectors/wire/): valid frames with their exact
bytes, invalid ones with the part a reader must name. Run from the repository root after a
deliberate change of the format; the tests check the committed vectors, not this script."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from dtm_mpi.comm.frames import HEADER, MINOR, MessageType, crc32c, decode_frame, encode_frame
from dtm_mpi.errors import ProtocolError

OUT = Path("io/vectors/wire")

HELLOS = {
    "hello_plain": {
        "protocol": 1,
        "version": "0.1.0",
        "module_hash": "3f2a9c",
        "mesh": "[dp=2, tp=2]",
        "capabilities": [],
        "backend": "cpu",
        "deterministic": False,
        "gpu_aware": "",
        "steps": 100,
        "buckets": 0,
        "pipeline": [],
        "integrity": False,
        "audit_every": 0,
        "quant_allreduce": 0,
        "deterministic_matmul": "",
        "gemm": "float32:small=numpy,medium=numpy,large=numpy;float64:small=numpy,medium=numpy,large=numpy",
    },
    "hello_pipelined": {
        "protocol": 1,
        "version": "0.1.0",
        "module_hash": "e0d1",
        "mesh": "[pp=2, dp=1, tp=2]",
        "capabilities": ["CAP_QUANT"],
        "backend": "cuda",
        "deterministic": True,
        "gpu_aware": "yes (vendor query)",
        "steps": 18446744073709551615,
        "buckets": 4194304,
        "pipeline": [
            "schedule 1f1b over pp=2: 2 stages, 4 microbatches",
            "stage 0 -> 1 act: %x f32[2,8]",
        ],
        "integrity": True,
        "audit_every": 100,
        "quant_allreduce": 64,
        "deterministic_matmul": "fast",
        "gemm": "",
    },
}


def _values(v: dict[str, object]) -> dict[str, object]:
    return {k: tuple(x) if isinstance(x, list) else x for k, x in v.items()}


def _reframe(body: bytes, *, major: int = 1, type_: int = 1, length: int | None = None) -> bytes:
    head = HEADER.pack(b"DTMF", major, MINOR, type_, len(body) if length is None else length) + body
    return head + struct.pack("<I", crc32c(head))


def main() -> None:
    for d in ("valid", "invalid"):
        for f in (OUT / d).glob("*.json"):
            f.unlink()
    good = encode_frame(MessageType.HELLO, _values(HELLOS["hello_plain"]))
    body = good[12:-4]
    for name, values in HELLOS.items():
        frame = encode_frame(MessageType.HELLO, _values(values))
        doc = {"type": "HELLO", "values": values, "frame": frame.hex()}
        (OUT / "valid" / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    others = {
        "failures_two": (
            MessageType.FAILURES,
            {
                "reporter": 3,
                "ranks": [1, 2],
                "phases": ["step 7", "step 7"],
                "messages": ["injected failure", "in no communication while rank 3 waited"],
            },
        ),
        "ping": (MessageType.PING, {"rank": 0}),
        "pong_idle": (MessageType.PONG, {"rank": 2, "doing": "", "phase": "step 12", "seq": 40}),
        "end": (MessageType.END, {"error": "step 7 failed on rank(s) 1: injected failure"}),
        "outcome_failed": (
            MessageType.OUTCOME,
            {"phase": "load", "ok": False, "message": "no such file: w.npy"},
        ),
        "view": (
            MessageType.VIEW,
            {"ranks": [0, 1, 3], "oks": [1, 0, 1], "messages": ["", "bad 1", ""]},
        ),
    }
    for name, (mtype, values) in others.items():
        frame = encode_frame(mtype, _values(values))
        doc = {"type": mtype.name, "values": values, "frame": frame.hex()}
        (OUT / "valid" / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    flipped = bytearray(good)
    flipped[20] ^= 0x10
    extra_field = body + struct.pack("<HBI", 99, 4, 3) + b"new"  # an unknown tag: skipped
    (OUT / "valid" / "hello_unknown_field_skipped.json").write_text(
        json.dumps(
            {
                "type": "HELLO",
                "values": HELLOS["hello_plain"],
                "frame": _reframe(extra_field).hex(),
                "decode_only": True,
            },
            indent=2,
        )
        + "\n"
    )
    # the first field (protocol, u64) re-encoded with the wrong kind
    wrong_kind = bytearray(body)
    wrong_kind[2] = 4
    invalid = {
        "empty": (b"", "length"),
        "truncated_header": (good[:10], "length"),
        "truncated_body": (good[:-9], "length"),
        "trailing_byte": (good + b"\x00", "length"),
        "bad_magic": (b"DTMG" + good[4:], "magic"),
        "unknown_major": (_reframe(body, major=2), "major"),
        "oversized_length": (HEADER.pack(b"DTMF", 1, 1, 1, 2**26 + 1) + b"\x00" * 4, "length"),
        "bit_flipped_in_body": (bytes(flipped), "crc"),
        "crc_trailer_wrong": (good[:-4] + bytes([good[-4] ^ 1]) + good[-3:], "crc"),
        "unknown_type": (_reframe(body, type_=77), "type"),
        "field_kind_wrong": (_reframe(bytes(wrong_kind)), "protocol"),
        # the last byte of the last field's value gone
        "field_size_past_body": (_reframe(body[:-1]), "gemm"),
        "tags_out_of_order": (_reframe(body[15:] + body[:15]), "protocol"),
        "missing_field": (_reframe(body[: body.rindex(struct.pack("<HB", 12, 3))]), "integrity"),
        "bool_not_0_or_1": (
            _reframe(
                body.replace(struct.pack("<HBIB", 7, 3, 1, 0), struct.pack("<HBIB", 7, 3, 1, 2))
            ),
            "deterministic",
        ),
        "not_utf8": (_reframe(body.replace(b"cpu", b"c\xffu")), "backend"),
    }
    for name, (frame, part) in invalid.items():
        try:
            decode_frame(frame, expect=MessageType.HELLO)
        except ProtocolError as err:
            assert err.field == part, (name, err.field, err)
            doc = {"frame": frame.hex(), "part": part, "error": str(err)}
        else:
            raise AssertionError(f"{name} decodes")
        (OUT / "invalid" / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
