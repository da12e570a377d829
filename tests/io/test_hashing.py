"""The hash definitions of io/FORMAT.md §8, recomputed independently of dtm_mpi.io.hashing:
chunk hashes (XXH3-128 of C-order bytes), shard hashes (over the 16-byte chunk digests), the
SHA-256 Merkle root (0x00 leaves, 0x01 inner nodes, odd node promoted, empty = sha256("")),
artifact and manifest roots (content only: not where a shard is stored), the manifest hash (over
everything, each shard's data file and dataset included) and canonical JSON. Also pins the test
vectors that FORMAT.md §8.7 publishes."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm_mpi.errors import ManifestError
from dtm_mpi.io.hashing import (
    CONTENT_HASH,
    canonical_json,
    chunk_hash,
    merkle_root,
    sha256_hex,
    shard_hash,
)
from dtm_mpi.io.manifest import (
    ArtifactClass,
    ArtifactRecord,
    Lifecycle,
    Manifest,
    ShardRecord,
    data_file_name,
    parse_manifest,
    shard_dataset,
    validate_manifest,
)
from dtm_mpi.ir.types import DType, Layout
from tests.depth import examples

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


# --- an independent reference (hashlib / xxhash only) ------------------------------------------


def ref_xxh(data: bytes) -> str:
    """XXH3-128, canonical (big-endian) 16 bytes as hex, computed from the integer digest."""
    return xxhash.xxh3_128_intdigest(data).to_bytes(16, "big").hex()


def ref_leaf(h: str) -> bytes:
    return hashlib.sha256(b"\x00" + bytes.fromhex(h)).digest()


def ref_inner(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def ref_merkle(leaves: list[str]) -> str:
    """Level by level; an odd node moves up unchanged."""
    if not leaves:
        return hashlib.sha256(b"").hexdigest()
    level = [ref_leaf(h) for h in leaves]
    while len(level) > 1:
        nxt = []
        i = 0
        while i + 1 < len(level):
            nxt.append(ref_inner(level[i], level[i + 1]))
            i += 2
        if i < len(level):
            nxt.append(level[i])
        level = nxt
    return level[0].hex()


def leaves_of(n: int) -> list[str]:
    return [hashlib.md5(bytes([i])).hexdigest() for i in range(n)]  # any 16-byte values


# --- Merkle root -------------------------------------------------------------------------------


def test_merkle_root_by_hand_for_0_1_2_3_5_leaves() -> None:
    h = leaves_of(5)
    L = [ref_leaf(x) for x in h]
    assert merkle_root([]) == EMPTY_SHA256
    assert merkle_root(h[:1]) == L[0].hex()
    assert merkle_root(h[:2]) == ref_inner(L[0], L[1]).hex()
    assert merkle_root(h[:3]) == ref_inner(ref_inner(L[0], L[1]), L[2]).hex()
    four = ref_inner(ref_inner(L[0], L[1]), ref_inner(L[2], L[3]))
    assert merkle_root(h[:4]) == four.hex()
    assert merkle_root(h) == ref_inner(four, L[4]).hex()


@pytest.mark.parametrize("n", [*range(0, 18), 31, 32, 33, 100])
def test_merkle_root_matches_the_reference(n: int) -> None:
    assert merkle_root(leaves_of(n)) == ref_merkle(leaves_of(n))


def test_merkle_root_single_leaf_is_not_the_leaf_and_order_matters() -> None:
    h = leaves_of(3)
    assert merkle_root(h[:1]) != h[0]
    assert merkle_root(h) != merkle_root([h[1], h[0], h[2]])
    # domain separation: a leaf can never pose as an inner node
    pair = ref_inner(ref_leaf(h[0]), ref_leaf(h[1]))
    assert merkle_root([pair.hex()]) != merkle_root(h[:2])


def test_merkle_root_accepts_both_hash_widths() -> None:
    """Artifact roots are over 16-byte shard hashes, the manifest root over 32-byte roots."""
    wide = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
    assert merkle_root(wide) == ref_merkle(wide)


# --- chunk and shard hashes --------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint16", "bool"]
)
def test_chunk_hash_is_xxh3_128_of_the_c_order_bytes(dtype: str) -> None:
    a = (np.arange(60) % 7).astype(dtype).reshape(3, 4, 5)
    assert chunk_hash(a) == ref_xxh(a.tobytes(order="C"))
    assert chunk_hash(a) == xxhash.xxh3_128_hexdigest(a.tobytes())


def test_chunk_hash_of_non_contiguous_arrays_equals_the_contiguous_copy() -> None:
    a = np.arange(7 * 6 * 5, dtype=np.float32).reshape(7, 6, 5)
    views = [a.T, a[:, ::2], a[::-1], a[1:5, 2:4, ::-2], np.asfortranarray(a), a[:, 3]]
    for v in views:
        copy = np.ascontiguousarray(v)
        assert chunk_hash(v) == chunk_hash(copy) == ref_xxh(copy.tobytes())
    # the logical C order decides, not the memory order: a transpose hashes differently
    assert chunk_hash(a.T) != chunk_hash(a)


def test_chunk_hash_of_0d_empty_bytes_and_memoryview() -> None:
    s = np.array(7, dtype=np.int64)
    assert chunk_hash(s) == ref_xxh((7).to_bytes(8, "little"))
    assert chunk_hash(np.zeros((0, 3), np.float32)) == ref_xxh(b"")
    raw = np.arange(10, dtype=np.int32)
    assert chunk_hash(raw.tobytes()) == chunk_hash(memoryview(raw)) == chunk_hash(raw)
    assert chunk_hash(np.array([True, False, True])) == ref_xxh(b"\x01\x00\x01")


def test_shard_hash_is_over_the_16_byte_digests() -> None:
    chunks = [ref_xxh(bytes([i]) * 10) for i in range(4)]
    joined = b"".join(bytes.fromhex(c) for c in chunks)
    assert len(joined) == 64
    assert shard_hash(chunks) == ref_xxh(joined)
    assert shard_hash(chunks) != shard_hash(chunks[::-1])
    assert shard_hash([]) == ref_xxh(b"")
    # not a hash of the hex text
    assert shard_hash(chunks) != ref_xxh("".join(chunks).encode())


@settings(max_examples=examples(30), deadline=None)
@given(st.binary(max_size=300), st.integers(1, 7))
def test_chunks_then_shard_hash_property(data: bytes, pieces: int) -> None:
    step = max(1, math.ceil(len(data) / pieces))
    parts = [data[i : i + step] for i in range(0, len(data), step)] or [b""]
    chunks = [chunk_hash(p) for p in parts]
    assert chunks == [ref_xxh(p) for p in parts]
    assert shard_hash(chunks) == ref_xxh(b"".join(xxhash.xxh3_128_digest(p) for p in parts))


# --- the vectors published in FORMAT.md §8.7 ---------------------------------------------------


def test_format_md_test_vectors() -> None:
    z, o, t = "00" * 16, "11" * 16, "22" * 16
    assert CONTENT_HASH == "xxh3-128"
    assert chunk_hash(b"") == "99aa06d3014798d86001c324468d497f" == ref_xxh(b"")
    assert chunk_hash(b"abc") == "06b05ab6733a618578af5f94892f3950"
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert w.astype("<f4").tobytes().hex() == "000000000000803f0000004000004040000080400000a040"
    assert chunk_hash(w) == "2d0408b485dd77b108c27fcd95d1fea5"
    assert shard_hash([z, o]) == "33de58d316500a1d5a83fbb6a5c12794"
    assert merkle_root([]) == EMPTY_SHA256
    want = {
        1: "0a88111852095cae045340ea1f0b279944b2a756a213d9b50107d7489771e159",
        2: "080ec838066425f5ee2f0496c0f9712c10b54509784e8aecb94afc06e9d80912",
        3: "1626c6b2603b31d6458408f0d409fb14ff92878cbbe46dca120406ed3f768b86",
    }
    for n, root in want.items():
        assert merkle_root([z, o, t][:n]) == root == ref_merkle([z, o, t][:n])


# --- canonical JSON and the manifest hash ------------------------------------------------------


def test_canonical_json_sorted_compact_utf8() -> None:
    doc = {"b": [1, {"z": None, "a": True}], "a": 'é\n"/', "A": -3}
    text = canonical_json(doc)
    assert text == '{"A":-3,"a":"é\\n\\"/","b":[1,{"a":true,"z":null}]}'.encode()
    assert text.decode("utf-8") == json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    assert b" " not in canonical_json({"k": [1, 2, {"x": 3}]})
    assert canonical_json({"c": "\x01"}) == b'{"c":"\\u0001"}'


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_canonical_json_rejects_nan_and_infinities(bad: float) -> None:
    with pytest.raises(ValueError):
        canonical_json({"x": [1, bad]})


def test_sha256_hex() -> None:
    assert sha256_hex(b"") == EMPTY_SHA256
    assert sha256_hex(b"abc") == hashlib.sha256(b"abc").hexdigest()


def _shard(name: str, i: int, n: int, data: np.ndarray) -> ShardRecord:
    c = (ref_xxh(data.tobytes()),)
    return ShardRecord(
        f"{name}:shard:{i}",
        i,
        i,
        (i,),
        (i * n,),
        (n,),
        data.nbytes,
        n,
        c,
        shard_hash(c),
        data_file_name(i),
        shard_dataset(name, i),
    )


def test_artifact_and_manifest_roots_and_manifest_hash_recomputed() -> None:
    """Artifact root over shard hashes in index order; manifest root over the non-ephemeral
    artifacts' roots sorted by name (not in manifest order); manifest hash = sha256 of the
    canonical JSON without the manifest_hash field."""
    x = np.arange(8, dtype=np.float32)
    lay = Layout((("x",),))

    def art(name: str, cls: ArtifactClass = ArtifactClass.PRIMARY) -> ArtifactRecord:
        if cls is ArtifactClass.EPHEMERAL:
            return ArtifactRecord(name, cls, Lifecycle.ACTIVE, DType.F32, (8,), lay, None)
        shards = (_shard(name, 0, 4, x[:4] + len(name)), _shard(name, 1, 4, x[4:] + len(name)))
        return ArtifactRecord(
            name, cls, Lifecycle.ACTIVE, DType.F32, (8,), lay, f"/tensors/{name}", shards=shards
        )

    arts = (art("zeta"), art("alpha"), art("eph", ArtifactClass.EPHEMERAL), art("mid"))
    m = Manifest(3, (("x", 2),), arts, 16).sealed()
    validate_manifest(m)
    roots = {a.name: a.merkle_root for a in m.artifacts}
    for a in m.artifacts:
        assert a.merkle_root == ref_merkle([s.hash for s in a.shards])
    assert roots["eph"] == EMPTY_SHA256
    assert m.merkle_root == ref_merkle([roots["alpha"], roots["mid"], roots["zeta"]])
    assert m.merkle_root != ref_merkle([roots["zeta"], roots["alpha"], roots["mid"]])
    doc = m.to_json()
    stated = doc.pop("manifest_hash")
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert stated == hashlib.sha256(body).hexdigest()
    assert (
        m.to_bytes()
        == json.dumps(
            {**doc, "manifest_hash": stated}, sort_keys=True, separators=(",", ":")
        ).encode()
    )


def test_roots_cover_content_the_manifest_hash_covers_where_it_is_stored() -> None:
    """Storing the same shards in other data files (another ranks_per_file) keeps every Merkle
    root and changes only the manifest hash (FORMAT.md §8.5); a changed file or dataset in the
    stored text without a new manifest hash is an altered manifest."""
    x = np.arange(8, dtype=np.float32)
    shards = (_shard("t", 0, 4, x[:4]), _shard("t", 1, 4, x[4:]))
    art = ArtifactRecord(
        "t",
        ArtifactClass.PRIMARY,
        Lifecycle.ACTIVE,
        DType.F32,
        (8,),
        Layout((("x",),)),
        "/tensors/t",
        shards=shards,
    )
    m = Manifest(3, (("x", 2),), (art,), 16).sealed()
    one_file = tuple(replace(s, file=data_file_name(0)) for s in shards)  # G = 2: one file
    shared = replace(m, artifacts=(replace(art, shards=one_file),)).sealed()
    validate_manifest(m)
    validate_manifest(shared)
    assert [s.file for s in m.artifacts[0].shards] == ["data-000000.h5", "data-000001.h5"]
    assert [s.file for s in shared.artifacts[0].shards] == ["data-000000.h5", "data-000000.h5"]
    assert shared.artifacts[0].merkle_root == m.artifacts[0].merkle_root
    assert shared.merkle_root == m.merkle_root == ref_merkle([m.artifacts[0].merkle_root])
    h1, h2 = m.to_json()["manifest_hash"], shared.to_json()["manifest_hash"]
    assert h1 != h2
    for doc, stated in ((m.to_json(), h1), (shared.to_json(), h2)):
        body = {k: v for k, v in doc.items() if k != "manifest_hash"}
        assert stated == hashlib.sha256(canonical_json(body)).hexdigest()
        assert body["artifacts"][0]["shards"][1]["dataset"] == "/shards/t/1"
    # the stored text of one with the other's file: the hash no longer matches
    text = m.to_bytes()
    moved = text.replace(b'"file":"data-000001.h5"', b'"file":"data-000000.h5"', 1)
    assert moved != text
    with pytest.raises(ManifestError, match="manifest hash mismatch"):
        parse_manifest(moved)


def test_the_streaming_chunk_hasher_equals_the_chunk_hash() -> None:
    """Restore hashes a chunk piece by piece as it reads it; the digest must be the chunk's."""
    from dtm_mpi.io.hashing import chunk_hash, chunk_hasher

    rng = np.random.default_rng(5)
    for n in (0, 1, 4095, 1 << 20, (1 << 20) + 17):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        for piece in (1, 4096, 1 << 19):
            h = chunk_hasher()
            for i in range(0, n, piece):
                h.update(data[i : i + piece])
            assert h.hexdigest() == chunk_hash(data), (n, piece)
