"""The checkpoint manifest without MPI: a manifest built from real data (plan_save + chunk
hashes) validates, round-trips through its canonical JSON and matches io/manifest.schema.json;
every fail-closed rule of io/FORMAT.md §9 rejects it with a message naming the tensor and shard
(including the version-2 rules for each shard's data file and dataset, and the refusal of
version-1 manifests); the lifecycle allows exactly the moves of its table; recovery_actions
decides skip / none / rebuild / unrecoverable; the worked example of FORMAT.md §11 is a valid
manifest that dtm_mpi's plan builds exactly."""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import xxhash

from dtm_mpi.errors import LifecycleError, ManifestError
from dtm_mpi.io.ckpt_plan import TensorSpec, plan_manifest, plan_save
from dtm_mpi.io.hashing import canonical_json, chunk_hash, merkle_root, sha256_hex, shard_hash
from dtm_mpi.io.manifest import (
    FORMAT,
    TRANSITIONS,
    VERSION,
    ArtifactClass,
    ArtifactRecord,
    Lifecycle,
    Manifest,
    RecoveryAction,
    ShardRecord,
    data_file_name,
    layout_from_json,
    layout_to_json,
    parse_manifest,
    recovery_actions,
    shard_dataset,
    transition,
    validate_manifest,
)
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.sharding.mesh import MeshShape

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "io" / "manifest.schema.json").read_text(encoding="utf-8"))
MESH = MeshShape((("x", 2), ("y", 2)))
P, D, E = ArtifactClass.PRIMARY, ArtifactClass.DERIVED, ArtifactClass.EPHEMERAL


def xxh(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def build(
    entries: list[tuple[TensorSpec, np.ndarray | None]],
    mesh: MeshShape,
    chunk_bytes: int,
    step: int = 3,
    ranks_per_file: int = 1,
) -> Manifest:
    """A sealed manifest of ``entries`` (spec, global value) saved on ``mesh``: the shards of
    plan_save (data files of ``ranks_per_file`` ranks), each chunk hashed from the global array
    directly (rows of the shard)."""
    plan = plan_save([s for s, _ in entries], mesh, chunk_bytes, ranks_per_file)
    hashes: dict[tuple[int, int], tuple[str, ...]] = {}
    for i, ((_, g), per) in enumerate(zip(entries, plan.shards, strict=True)):
        for s in per:
            assert g is not None
            block = np.ascontiguousarray(g[s.region])
            if block.ndim == 0:
                hashes[(i, s.index)] = (xxh(block.tobytes()),)
            else:
                r = s.chunk_rows
                hashes[(i, s.index)] = tuple(
                    xxh(block[c * r : (c + 1) * r].tobytes()) for c in range(s.nchunks)
                )
    return plan_manifest(plan, step, hashes, "dtm-mh1:" + "ab" * 32, "0.1.0")


def _value(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(dtype)


W = _value((10, 7), "float32", 1)
ENTRIES: list[tuple[TensorSpec, np.ndarray | None]] = [
    (TensorSpec("w", TensorType(DType.F32, (10, 7), Layout((("x",), ())))), W),
    (
        TensorSpec("b", TensorType(DType.F16, (5,), Layout((("x", "y"),)))),
        _value((5,), "float16", 2),
    ),
    (TensorSpec("step_count", TensorType(DType.I64, (), Layout(()))), np.array(7, np.int64)),
    (
        TensorSpec("w16", TensorType(DType.F16, (10, 7), Layout((("x",), ()))), D, "w", "cast:f16"),
        W.astype(np.float16),
    ),
    (TensorSpec("scratch", TensorType(DType.F32, (3,), Layout(((),))), E), None),
    (
        TensorSpec("mask", TensorType(DType.BOOL, (3, 1, 4), Layout(((), (), ("y",))))),
        _value((3, 1, 4), "bool", 3),
    ),
]
VALUES = {spec.name: g for spec, g in ENTRIES}


@functools.cache
def manifest() -> Manifest:
    return build(ENTRIES, MESH, chunk_bytes=64)


def with_artifact(m: Manifest, name: str, **changes: Any) -> Manifest:
    return replace(
        m, artifacts=tuple(replace(a, **changes) if a.name == name else a for a in m.artifacts)
    )


def with_shard(m: Manifest, name: str, at: int, /, **changes: Any) -> Manifest:
    """``m`` with field ``changes`` made to shard ``at`` (its position) of tensor ``name``."""
    a = m.artifact(name)
    shards = tuple(replace(s, **changes) if i == at else s for i, s in enumerate(a.shards))
    return with_artifact(m, name, shards=shards)


def rehashed(doc: dict[str, Any]) -> bytes:
    """``doc`` as stored text with a manifest hash that matches it (a deliberate writer)."""
    body = {k: v for k, v in doc.items() if k != "manifest_hash"}
    return canonical_json({**body, "manifest_hash": sha256_hex(canonical_json(body))})


def schema_errors(doc: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    return [e.message for e in validator.iter_errors(doc)]


# --- the valid manifest ------------------------------------------------------------------------


def test_built_manifest_validates_and_has_the_expected_shards() -> None:
    m = manifest()
    validate_manifest(m)
    assert m.names == ("w", "b", "step_count", "w16", "scratch", "mask")
    owners = {a.name: [s.owner for s in a.shards] for a in m.artifacts}
    # lowest holder of each distinct non-empty block (mesh 2x2, rank = 2*x + y)
    assert owners == {
        "w": [0, 2],
        "b": [0, 1, 2],
        "step_count": [0],
        "w16": [0, 2],
        "scratch": [],
        "mask": [0, 1],
    }
    assert [s.region for s in m.artifact("b").shards] == [
        (slice(0, 2),),
        (slice(2, 4),),
        (slice(4, 5),),
    ]
    w0 = m.artifact("w").shards[0]
    assert (w0.chunk_rows, len(w0.chunks), w0.coords, w0.nbytes) == (2, 3, (0, 0), 5 * 7 * 4)
    # one data file per writing rank (the default): a shard lives in its owner's file
    for a in m.artifacts:
        for s in a.shards:
            assert s.file == data_file_name(s.owner) == f"data-{s.owner:06d}.h5"
            assert s.dataset == shard_dataset(a.name, s.index) == f"/shards/{a.name}/{s.index}"
    assert [s.file for s in m.artifact("b").shards] == [
        "data-000000.h5",
        "data-000001.h5",
        "data-000002.h5",
    ]
    assert m.artifact("scratch").dataset is None
    assert m.data_bytes == sum(VALUES[n].nbytes for n in ("w", "b", "step_count", "w16", "mask"))  # type: ignore[union-attr]


def test_chunk_region_matches_the_recorded_chunk_hashes() -> None:
    for a in manifest().artifacts:
        for s in a.shards:
            g = VALUES[a.name]
            assert g is not None
            for c, want in enumerate(s.chunks):
                assert chunk_hash(g[s.chunk_region(c)]) == want, (a.name, s.id, c)
            assert shard_hash(s.chunks) == s.hash


def test_round_trip_through_canonical_json() -> None:
    m = manifest()
    text = m.to_bytes()
    assert text == canonical_json(json.loads(text))  # stored form is canonical
    assert b" " not in text and b"\n" not in text
    back = parse_manifest(text)
    assert back == m
    validate_manifest(back)
    doc = json.loads(text)
    assert doc["format"] == FORMAT == "dtm-manifest" and doc["version"] == VERSION == 2
    assert doc["manifest_hash"] == sha256_hex(
        canonical_json({k: v for k, v in doc.items() if k != "manifest_hash"})
    )
    assert parse_manifest(text.decode()) == m  # str accepted as well


def test_layout_json_round_trip() -> None:
    for lay in (
        Layout(()),
        Layout((("x", "y"), ())),
        Layout(((), ("y",)), Partial(ReduceOp.MAX, ("x",))),
    ):
        doc = layout_to_json(lay)
        assert layout_from_json(json.loads(json.dumps(doc)), "here") == lay
    assert layout_to_json(Layout((("x",), ()))) == {"dims": [["x"], []], "partial": None}
    with pytest.raises(ManifestError, match="here: malformed layout"):
        layout_from_json({"dims": 5}, "here")
    with pytest.raises(ManifestError, match="malformed layout"):
        layout_from_json({"dims": [], "partial": {"op": "mean", "axes": ["x"]}}, "here")


def test_lookup_errors_name_what_is_missing() -> None:
    m = manifest()
    with pytest.raises(ManifestError, match="no tensor 'nope'"):
        m.artifact("nope")
    with pytest.raises(ManifestError, match="tensor 'w' has no shard 'w:shard:9'"):
        m.artifact("w").shard("w:shard:9")
    assert m.artifact("w").shard("w:shard:1").index == 1


@pytest.mark.parametrize(
    "state", [Lifecycle.ACTIVE, Lifecycle.STALE, Lifecycle.RECOVERING, Lifecycle.DEPRECATED]
)
def test_loadable_states_validate(state: Lifecycle) -> None:
    validate_manifest(with_artifact(manifest(), "w16", state=state))


# --- the JSON Schema ---------------------------------------------------------------------------


def test_schema_is_valid_and_accepts_the_manifest() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert schema_errors(manifest().to_json()) == []
    empty = Manifest(0, (("x", 1),), (), 1).sealed()
    assert schema_errors(empty.to_json()) == []


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        node: Any = doc
        for k in path[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return apply


_DELETE = object()
SCHEMA_BAD = {
    "chunk hash 31 hex": _set(("artifacts", 0, "shards", 0, "chunks", 0), "a" * 31),
    "uppercase shard hash": _set(("artifacts", 0, "shards", 0, "hash"), "A" * 32),
    "short merkle root": _set(("merkle_root",), "0" * 63),
    "manifest_hash not hex": _set(("manifest_hash",), "z" * 64),
    "extra top-level field": _set(("extra",), 1),
    "extra shard field": _set(("artifacts", 0, "shards", 0, "note"), "x"),
    "missing step": _set(("step",), _DELETE),
    "missing shard hash": _set(("artifacts", 0, "shards", 0, "hash"), _DELETE),
    "unknown class": _set(("artifacts", 0, "class"), "CACHED"),
    "unknown state": _set(("artifacts", 0, "state"), "ZOMBIE"),
    "unknown dtype": _set(("artifacts", 0, "dtype"), "f8"),
    "unknown hash algorithm": _set(("hash_algorithm",), "sha1"),
    "version 1": _set(("version",), 1),
    "version 3": _set(("version",), 3),
    "version true": _set(("version",), True),
    "format": _set(("format",), "other"),
    "negative step": _set(("step",), -1),
    "zero chunk_bytes": _set(("chunk_bytes",), 0),
    "bool step": _set(("step",), True),
    "zero extent": _set(("artifacts", 0, "shards", 0, "extent", 0), 0),
    "negative offset": _set(("artifacts", 0, "shards", 0, "offset", 0), -1),
    "zero bytes": _set(("artifacts", 0, "shards", 0, "bytes"), 0),
    "zero chunk_rows": _set(("artifacts", 0, "shards", 0, "chunk_rows"), 0),
    "no chunks": _set(("artifacts", 0, "shards", 0, "chunks"), []),
    "bad id": _set(("artifacts", 0, "shards", 0, "id"), "w-0"),
    "mesh size 0": _set(("mesh", 0, 1), 0),
    "mesh triple": _set(("mesh", 0), ["x", 2, 3]),
    "ephemeral with dataset": _set(("artifacts", 4, "dataset"), "/tensors/scratch"),
    "derived without parent": _set(("artifacts", 3, "parent"), None),
    "primary with rebuild": _set(("artifacts", 0, "rebuild"), "copy"),
    "partial without axes": _set(("artifacts", 0, "layout", "partial"), {"op": "sum", "axes": []}),
    "bad tensor name": _set(("artifacts", 0, "name"), "9w"),
    "shard without file": _set(("artifacts", 0, "shards", 0, "file"), _DELETE),
    "shard without dataset": _set(("artifacts", 0, "shards", 0, "dataset"), _DELETE),
    "file null": _set(("artifacts", 0, "shards", 0, "file"), None),
    "file in a subdirectory": _set(("artifacts", 0, "shards", 0, "file"), "d/data-000000.h5"),
    "file outside the checkpoint": _set(("artifacts", 0, "shards", 0, "file"), "../data-000000.h5"),
    "file absolute": _set(("artifacts", 0, "shards", 0, "file"), "/data-000000.h5"),
    "file with 5 digits": _set(("artifacts", 0, "shards", 0, "file"), "data-00000.h5"),
    "file not .h5": _set(("artifacts", 0, "shards", 0, "file"), "data-000000.hdf5"),
    "file empty": _set(("artifacts", 0, "shards", 0, "file"), ""),
    "dataset under /tensors": _set(("artifacts", 0, "shards", 0, "dataset"), "/tensors/w"),
    "dataset relative": _set(("artifacts", 0, "shards", 0, "dataset"), "shards/w/0"),
    "dataset without index": _set(("artifacts", 0, "shards", 0, "dataset"), "/shards/w"),
    "dataset padded index": _set(("artifacts", 0, "shards", 0, "dataset"), "/shards/w/00"),
    "dataset number": _set(("artifacts", 0, "shards", 0, "dataset"), 0),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_BAD))
def test_schema_rejects(case: str) -> None:
    doc = manifest().to_json()
    SCHEMA_BAD[case](doc)
    assert schema_errors(doc), f"the schema accepted: {case}"


# --- fail closed: validate_manifest -------------------------------------------------------------

OTHER_HEX = "0123456789abcdef" * 2
_EXPECTED_W1 = "expected a data file data-NNNNNN.h5 and dataset /shards/w/1"


def _overlap(m: Manifest) -> Manifest:
    # w: shards rows [0,5) and [5,10); move shard 1 up a row: overlap at row 4, hole at row 9
    return with_shard(m, "w", 1, offset=(4, 0))


def _drop_last_shard(m: Manifest) -> Manifest:
    a = m.artifact("b")
    return with_artifact(m, "b", shards=a.shards[:-1])


def _extra_chunk(m: Manifest) -> Manifest:
    s = m.artifact("w").shards[1]
    chunks = (*s.chunks, OTHER_HEX)
    return with_shard(m, "w", 1, chunks=chunks, hash=shard_hash(chunks))


def _shard_of_w_on(name: str) -> Callable[[Manifest], Manifest]:
    def apply(m: Manifest) -> Manifest:
        return with_artifact(m, name, shards=m.artifact("w").shards)

    return apply


# case -> (mutation, substrings the message must hold)
FAIL_CLOSED: dict[str, tuple[Callable[[Manifest], Manifest], tuple[str, ...]]] = {
    "shard hash missing": (
        lambda m: with_shard(m, "w", 1, hash=""),
        ("'w'", "'w:shard:1'", "missing or malformed content hash"),
    ),
    "shard hash uppercase": (
        lambda m: with_shard(m, "w", 1, hash=m.artifact("w").shards[1].hash.upper()),
        ("'w'", "'w:shard:1'", "malformed content hash"),
    ),
    "chunk hash short": (
        lambda m: with_shard(m, "w", 0, chunks=("abc", *m.artifact("w").shards[0].chunks[1:])),
        ("'w'", "'w:shard:0'", "malformed content hash"),
    ),
    "no chunk hashes": (
        lambda m: with_shard(m, "b", 2, chunks=()),
        ("'b'", "'b:shard:2'", "missing or malformed content hash"),
    ),
    "zero-size shard": (
        lambda m: with_shard(m, "w", 1, extent=(0, 7)),
        ("'w'", "'w:shard:1'", "empty or out-of-bounds hyperslab"),
    ),
    "out of bounds": (
        lambda m: with_shard(m, "w", 1, offset=(6, 0)),
        ("'w'", "'w:shard:1'", "out-of-bounds", "shape [10, 7]"),
    ),
    "negative offset": (
        lambda m: with_shard(m, "b", 0, offset=(-1,)),
        ("'b'", "'b:shard:0'", "out-of-bounds"),
    ),
    "hyperslab rank": (
        lambda m: with_shard(m, "w", 0, offset=(0,)),
        ("'w'", "'w:shard:0'", "hyperslab rank differs"),
    ),
    "nbytes mismatch": (
        lambda m: with_shard(m, "w", 1, nbytes=5 * 7 * 4 + 1),
        ("'w'", "'w:shard:1'", "141 bytes does not match extent [5, 7] of f32"),
    ),
    "nbytes of another dtype": (
        lambda m: with_shard(m, "w16", 0, nbytes=5 * 7 * 4),
        ("'w16'", "'w16:shard:0'", "does not match extent"),
    ),
    "wrong chunk count": (
        _extra_chunk,
        ("'w'", "'w:shard:1'", "4 chunk hashes for 5 rows in runs of 2"),
    ),
    "wrong chunk_rows": (
        lambda m: with_shard(m, "w", 0, chunk_rows=5),
        ("'w'", "'w:shard:0'", "3 chunk hashes for 5 rows in runs of 5"),
    ),
    "zero chunk_rows": (
        lambda m: with_shard(m, "w", 0, chunk_rows=0),
        ("'w'", "'w:shard:0'", "chunk hashes for"),
    ),
    "shard hash not matching chunks": (
        lambda m: with_shard(m, "w", 1, chunks=(OTHER_HEX, *m.artifact("w").shards[1].chunks[1:])),
        ("'w'", "'w:shard:1'", "shard hash does not match its chunk hashes"),
    ),
    "0-d shard hash not matching": (
        lambda m: with_shard(m, "step_count", 0, hash=OTHER_HEX),
        ("'step_count'", "'step_count:shard:0'", "shard hash does not match"),
    ),
    "wrong shard id": (
        lambda m: with_shard(m, "w", 1, id="w:shard:7"),
        ("'w'", "'w:shard:7'", "expected id w:shard:1"),
    ),
    "wrong shard index": (
        lambda m: with_shard(m, "b", 2, index=5),
        ("'b'", "'b:shard:2'", "expected id b:shard:2"),
    ),
    "overlapping shards": (_overlap, ("'w'", "'w:shard:0'", "'w:shard:1'", "overlap")),
    "shards not covering": (_drop_last_shard, ("'b'", "shards hold 4 elements, the tensor 5")),
    "DELETED artifact": (
        lambda m: with_artifact(m, "w", state=Lifecycle.DELETED),
        ("'w'", "is DELETED: not loadable"),
    ),
    "STAGING artifact": (
        lambda m: with_artifact(m, "mask", state=Lifecycle.STAGING),
        ("'mask'", "is STAGING: not loadable"),
    ),
    "DELETED ephemeral": (
        lambda m: with_artifact(m, "scratch", state=Lifecycle.DELETED),
        ("'scratch'", "DELETED"),
    ),
    "derived without parent": (
        lambda m: with_artifact(m, "w16", parent=None),
        ("'w16'", "needs a parent and a rebuild instruction"),
    ),
    "derived without rebuild": (
        lambda m: with_artifact(m, "w16", rebuild=None),
        ("'w16'", "needs a parent and a rebuild instruction"),
    ),
    "derived with ephemeral parent": (
        lambda m: with_artifact(m, "w16", parent="scratch"),
        ("'w16'", "parent 'scratch' is not a stored artifact"),
    ),
    "derived with unknown parent": (
        lambda m: with_artifact(m, "w16", parent="nope"),
        ("'w16'", "parent 'nope' is not a stored artifact"),
    ),
    "ephemeral with shards": (
        _shard_of_w_on("scratch"),
        ("'scratch'", "an ephemeral artifact has no stored data"),
    ),
    "ephemeral with dataset": (
        lambda m: with_artifact(m, "scratch", dataset="/tensors/scratch"),
        ("'scratch'", "no stored data"),
    ),
    "primary without dataset": (
        lambda m: with_artifact(m, "w", dataset=None),
        ("'w'", "no dataset"),
    ),
    "shape and layout": (
        lambda m: with_artifact(m, "w", layout=Layout((("x",),))),
        ("'w'", "shape [10, 7] and layout"),
    ),
    "negative shape": (
        lambda m: with_artifact(m, "scratch", shape=(-3,)),
        ("'scratch'", "shape [-3]"),
    ),
    "wrong artifact Merkle root": (
        lambda m: with_artifact(m, "w", merkle_root="0" * 64),
        ("'w'", "Merkle root does not match its shard hashes"),
    ),
    "artifact Merkle root of another": (
        lambda m: with_artifact(m, "w16", merkle_root=m.artifact("w").merkle_root),
        ("'w16'", "Merkle root does not match"),
    ),
    "wrong manifest Merkle root": (
        lambda m: replace(m, merkle_root="f" * 64),
        ("Merkle root does not match the artifacts' roots",),
    ),
    "missing manifest Merkle root": (
        lambda m: replace(m, merkle_root=""),
        ("Merkle root does not match the artifacts' roots",),
    ),
    "manifest root in manifest order": (
        lambda m: replace(
            m, merkle_root=merkle_root([a.merkle_root for a in m.artifacts if a.cls is not E])
        ),
        ("Merkle root does not match the artifacts' roots",),
    ),
    "duplicate tensor name": (
        lambda m: replace(m, artifacts=(*m.artifacts, m.artifact("w"))),
        ("a tensor name appears twice",),
    ),
    "unknown hash algorithm": (
        lambda m: replace(m, hash_algorithm="sha256"),
        ("content hash 'sha256' is not supported",),
    ),
    "negative step": (lambda m: replace(m, step=-1), ("step -1",)),
    "zero chunk_bytes": (lambda m: replace(m, chunk_bytes=0), ("chunk_bytes 0",)),
    # where a shard is stored (version 2): a data file of the checkpoint, its own dataset
    "file missing": (
        lambda m: with_shard(m, "w", 1, file=""),
        ("'w'", "'w:shard:1'", "stored in file ''", _EXPECTED_W1),
    ),
    "file in a subdirectory": (
        lambda m: with_shard(m, "w", 1, file="sub/data-000001.h5"),
        ("'w'", "'w:shard:1'", "'sub/data-000001.h5'", _EXPECTED_W1),
    ),
    "file outside the checkpoint": (
        lambda m: with_shard(m, "w", 1, file="../data-000001.h5"),
        ("'w'", "'w:shard:1'", "'../data-000001.h5'", _EXPECTED_W1),
    ),
    "file absolute": (
        lambda m: with_shard(m, "b", 0, file="/tmp/data-000000.h5"),
        ("'b'", "'b:shard:0'", "'/tmp/data-000000.h5'", "dataset /shards/b/0"),
    ),
    "file with a backslash": (
        lambda m: with_shard(m, "w", 1, file="x\\data-000001.h5"),
        ("'w'", "'w:shard:1'", _EXPECTED_W1),
    ),
    "file with 5 digits": (
        lambda m: with_shard(m, "w", 1, file="data-00001.h5"),
        ("'w'", "'w:shard:1'", "'data-00001.h5'", _EXPECTED_W1),
    ),
    "file named like the main file": (
        lambda m: with_shard(m, "step_count", 0, file="checkpoint.h5"),
        ("'step_count'", "'step_count:shard:0'", "'checkpoint.h5'"),
    ),
    "file with a suffix": (
        lambda m: with_shard(m, "w", 1, file="data-000001.h5.partial"),
        ("'w'", "'w:shard:1'", _EXPECTED_W1),
    ),
    "file with a newline": (
        lambda m: with_shard(m, "w", 1, file="data-000001.h5\n"),
        ("'w'", "'w:shard:1'", _EXPECTED_W1),
    ),
    "dataset missing": (
        lambda m: with_shard(m, "w", 1, dataset=""),
        ("'w'", "'w:shard:1'", "dataset ''", _EXPECTED_W1),
    ),
    "dataset of another shard": (
        lambda m: with_shard(m, "w", 1, dataset="/shards/w/0"),
        ("'w'", "'w:shard:1'", "dataset '/shards/w/0'", _EXPECTED_W1),
    ),
    "dataset of another tensor": (
        lambda m: with_shard(m, "w", 1, dataset="/shards/w16/1"),
        ("'w'", "'w:shard:1'", "'/shards/w16/1'", _EXPECTED_W1),
    ),
    "dataset under /tensors": (
        lambda m: with_shard(m, "w", 1, dataset="/tensors/w"),
        ("'w'", "'w:shard:1'", "'/tensors/w'", _EXPECTED_W1),
    ),
    "dataset without leading slash": (
        lambda m: with_shard(m, "mask", 1, dataset="shards/mask/1"),
        ("'mask'", "'mask:shard:1'", "dataset /shards/mask/1"),
    ),
    "dataset with padded index": (
        lambda m: with_shard(m, "w", 1, dataset="/shards/w/01"),
        ("'w'", "'w:shard:1'", _EXPECTED_W1),
    ),
    "0-d dataset": (
        lambda m: with_shard(m, "step_count", 0, dataset="/shards/step_count"),
        ("'step_count'", "'step_count:shard:0'", "dataset /shards/step_count/0"),
    ),
}


@pytest.mark.parametrize("case", list(FAIL_CLOSED))
def test_validate_fails_closed(case: str) -> None:
    mutate, needles = FAIL_CLOSED[case]
    bad = mutate(manifest())
    with pytest.raises(ManifestError) as info:
        validate_manifest(bad, "ckpt-00000003.h5")
    msg = str(info.value)
    assert msg.startswith("ckpt-00000003.h5: "), msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    # the same manifest written and read back (a writer with the bug) fails the same way:
    # the parser keeps every value the rules judge
    back = parse_manifest(bad.to_bytes(), "ckpt-00000003.h5")
    assert back == bad
    with pytest.raises(ManifestError) as again:
        validate_manifest(back, "ckpt-00000003.h5")
    assert str(again.value) == msg


def test_missing_hash_keys_in_the_json_fail_closed() -> None:
    doc = manifest().to_json()
    del doc["artifacts"][0]["shards"][1]["hash"]
    m = parse_manifest(rehashed(doc))
    with pytest.raises(
        ManifestError, match=r"tensor 'w' shard 'w:shard:1': missing or malformed content hash"
    ):
        validate_manifest(m)
    doc = manifest().to_json()
    del doc["artifacts"][1]["merkle_root"]
    with pytest.raises(ManifestError, match=r"tensor 'b': Merkle root does not match"):
        validate_manifest(parse_manifest(rehashed(doc)))
    doc = manifest().to_json()
    del doc["merkle_root"]
    with pytest.raises(ManifestError, match="Merkle root does not match the artifacts' roots"):
        validate_manifest(parse_manifest(rehashed(doc)))


def test_overlap_is_refused_with_many_shards() -> None:
    n = 258
    g = np.arange(n, dtype=np.float32)
    shards = []
    for i in range(n):
        off = 0 if i == 1 else i  # shard 1 repeats element 0; element 1 is never stored
        c = (chunk_hash(g[off : off + 1]),)
        shards.append(
            ShardRecord(
                f"t:shard:{i}",
                i,
                i,
                (i,),
                (off,),
                (1,),
                4,
                1,
                c,
                shard_hash(c),
                data_file_name(i),
                shard_dataset("t", i),
            )
        )
    a = ArtifactRecord(
        "t",
        P,
        Lifecycle.ACTIVE,
        DType.F32,
        (n,),
        Layout((("x",),)),
        "/tensors/t",
        shards=tuple(shards),
    )
    with pytest.raises(ManifestError, match="overlap"):
        validate_manifest(Manifest(1, (("x", n),), (a,), 64).sealed())


# --- fail closed: parse_manifest ---------------------------------------------------------------


def test_altered_manifest_text_is_a_hash_mismatch() -> None:
    text = manifest().to_bytes()
    assert b'"step":3' in text
    for old, new in [
        (b'"step":3', b'"step":4'),
        (b'"owner":2', b'"owner":3'),
        (b'"dtype":"f32"', b'"dtype":"f64"'),
    ]:
        changed = text.replace(old, new, 1)
        assert changed != text
        with pytest.raises(
            ManifestError, match=r"ckpt\.h5: manifest hash mismatch .*altered or truncated"
        ):
            parse_manifest(changed, "ckpt.h5")
    # one hex digit of one chunk hash
    h = manifest().artifact("w").shards[0].chunks[1]
    flipped = h[:5] + ("0" if h[5] != "0" else "1") + h[6:]
    with pytest.raises(ManifestError, match="manifest hash mismatch"):
        parse_manifest(text.replace(h.encode(), flipped.encode()))
    # an added field is covered by the hash as well
    doc = json.loads(text)
    doc["note"] = "x"
    with pytest.raises(ManifestError, match="manifest hash mismatch"):
        parse_manifest(canonical_json(doc))


@pytest.mark.parametrize("cut", [1, 2, 100, 1000])
def test_truncated_json_is_refused(cut: int) -> None:
    text = manifest().to_bytes()
    with pytest.raises(ManifestError, match=r"ckpt\.h5: not valid JSON"):
        parse_manifest(text[:-cut], "ckpt.h5")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (b"", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'"dtm-manifest"', "expected a JSON object"),
        (b"{}", "format None is not 'dtm-manifest'"),
    ],
)
def test_not_a_manifest(text: bytes, needle: str) -> None:
    with pytest.raises(ManifestError, match=re.escape(needle)):
        parse_manifest(text)


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("format", "dtm-store", "format 'dtm-store' is not 'dtm-manifest'"),
        ("format", None, "format None is not"),
        ("version", 1, "manifest version 1 is not supported (this is version 2)"),
        ("version", 3, "manifest version 3 is not supported (this is version 2)"),
        ("version", 0, "manifest version 0 is not supported"),
        ("version", "2", "manifest version '2' is not supported"),
        ("version", 2.0, "manifest version 2.0 is not supported"),
        ("version", None, "manifest version None is not supported"),
    ],
)
def test_unknown_format_or_version(key: str, value: Any, needle: str) -> None:
    doc = manifest().to_json()
    doc[key] = value
    with pytest.raises(ManifestError, match=re.escape(needle)):
        parse_manifest(rehashed(doc))


def test_missing_manifest_hash() -> None:
    doc = manifest().to_json()
    del doc["manifest_hash"]
    with pytest.raises(ManifestError, match="missing field 'manifest_hash'"):
        parse_manifest(canonical_json(doc))


def _edit(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = manifest().to_json()
    _set(path, value)(doc)
    return doc


@pytest.mark.parametrize(
    ("path", "value", "needles"),
    [
        (("step",), "3", ("field 'step' has the wrong type (str)",)),
        (("step",), True, ("field 'step' has the wrong type (bool)",)),
        (("chunk_bytes",), _DELETE, ("missing field 'chunk_bytes'",)),
        (("artifacts",), {}, ("field 'artifacts' has the wrong type",)),
        (("artifacts", 0), [], ("artifacts[0]: expected an object",)),
        (("artifacts", 0, "name"), 5, ("artifacts[0]", "field 'name'")),
        (
            ("artifacts", 0, "class"),
            "CACHED",
            ("tensor 'w'", "'CACHED' is not a valid ArtifactClass"),
        ),
        (("artifacts", 0, "state"), None, ("tensor 'w'", "Lifecycle")),
        (("artifacts", 1, "dtype"), "f8", ("tensor 'b'", "'f8'")),
        (("artifacts", 0, "shape"), [10, "7"], ("tensor 'w' shape", "list of integers")),
        (("artifacts", 0, "layout"), None, ("tensor 'w'", "malformed layout")),
        (("artifacts", 0, "shards"), _DELETE, ("tensor 'w'", "missing field 'shards'")),
        (("artifacts", 0, "shards", 1), "x", ("tensor 'w' shards[1]: expected an object",)),
        (("artifacts", 0, "shards", 1, "owner"), "2", ("tensor 'w' shards[1]", "field 'owner'")),
        (("artifacts", 0, "shards", 1, "bytes"), 1.5, ("tensor 'w' shards[1]", "field 'bytes'")),
        (
            ("artifacts", 0, "shards", 1, "offset"),
            [5, True],
            ("tensor 'w' shards[1] offset", "list of integers"),
        ),
        (
            ("artifacts", 0, "shards", 1, "chunks"),
            "abc",
            ("tensor 'w' shards[1]", "field 'chunks'"),
        ),
        (
            ("artifacts", 0, "shards", 1, "file"),
            _DELETE,
            ("tensor 'w' shards[1]: missing field 'file'",),
        ),
        (
            ("artifacts", 3, "shards", 0, "dataset"),
            _DELETE,
            ("tensor 'w16' shards[0]: missing field 'dataset'",),
        ),
        (
            ("artifacts", 0, "shards", 1, "file"),
            None,
            ("tensor 'w' shards[1]", "field 'file' has the wrong type (NoneType)"),
        ),
        (
            ("artifacts", 1, "shards", 2, "dataset"),
            ["/shards/b/2"],
            ("tensor 'b' shards[2]", "field 'dataset' has the wrong type (list)"),
        ),
    ],
)
def test_malformed_fields_are_manifest_errors(
    path: tuple[Any, ...], value: Any, needles: tuple[str, ...]
) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(rehashed(_edit(path, value)), "f.h5")
    msg = str(info.value)
    assert msg.startswith("f.h5"), msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_malformed_mesh_entry_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="mesh"):
        parse_manifest(rehashed(_edit(("mesh", 0), ["x", 2, 3])))


def test_version_true_is_refused() -> None:
    with pytest.raises(ManifestError, match="version"):
        parse_manifest(rehashed(_edit(("version",), True)))


# --- lifecycle ---------------------------------------------------------------------------------

S = Lifecycle
ALLOWED = {
    (S.STAGING, S.ACTIVE),
    (S.STAGING, S.DELETED),
    (S.ACTIVE, S.STALE),
    (S.ACTIVE, S.RECOVERING),
    (S.ACTIVE, S.DEPRECATED),
    (S.STALE, S.RECOVERING),
    (S.STALE, S.DEPRECATED),
    (S.RECOVERING, S.ACTIVE),
    (S.RECOVERING, S.STALE),
    (S.RECOVERING, S.DEPRECATED),
    (S.DEPRECATED, S.DELETED),
}
PAIRS = list(itertools.product(Lifecycle, Lifecycle))


def test_transitions_table_is_the_documented_one() -> None:
    assert len(PAIRS) == 36
    assert {(a, b) for a, nexts in TRANSITIONS.items() for b in nexts} == ALLOWED
    assert set(TRANSITIONS) == set(Lifecycle)


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
def test_transition(old: Lifecycle, new: Lifecycle) -> None:
    a = replace(manifest().artifact("w"), state=old)
    if (old, new) in ALLOWED:
        b = transition(a, new)
        assert b.state is new and a.state is old
        assert replace(b, state=old) == a
    else:
        with pytest.raises(LifecycleError) as info:
            transition(a, new)
        msg = str(info.value)
        assert f"tensor 'w': lifecycle {old.value} -> {new.value} is not allowed" in msg
        allowed = sorted(s.value for s in TRANSITIONS[old]) or ["none"]
        assert msg.endswith(f"(from {old.value}: {', '.join(allowed)})"), msg
        assert isinstance(info.value, ManifestError)


# --- recovery ----------------------------------------------------------------------------------


def _art(
    name: str,
    cls: ArtifactClass,
    parent: str | None = None,
    state: Lifecycle = S.ACTIVE,
    rebuild: str | None = "copy",
) -> ArtifactRecord:
    return ArtifactRecord(
        name,
        cls,
        state,
        DType.F32,
        (2,),
        Layout(((),)),
        None if cls is E else f"/tensors/{name}",
        parent,
        rebuild if cls is D else None,
    )


def _chain(**states: Lifecycle) -> Manifest:
    """p (primary) <- d (derived) <- dd (derived), plus e (ephemeral) and de (derived of e)."""
    arts = (
        _art("p", P),
        _art("d", D, "p", states.get("d", S.ACTIVE)),
        _art("dd", D, "d", states.get("dd", S.ACTIVE)),
        _art("e", E),
        _art("de", D, "e"),
    )
    return Manifest(1, (("x", 1),), arts, 64)


N, R, K, U = (
    RecoveryAction.NONE,
    RecoveryAction.REBUILD,
    RecoveryAction.SKIP,
    RecoveryAction.UNRECOVERABLE,
)


@pytest.mark.parametrize(
    ("healthy", "want"),
    [
        # all healthy: restore as stored; the ephemeral one is skipped
        ({"p": 1, "d": 1, "dd": 1, "e": 1, "de": 1}, {"p": N, "d": N, "dd": N, "e": K, "de": N}),
        # primary unhealthy: unrecoverable; its healthy children still restore as stored
        ({"p": 0, "d": 1, "dd": 1}, {"p": U, "d": N, "dd": N}),
        # derived unhealthy with a healthy primary parent: rebuilt
        ({"p": 1, "d": 0, "dd": 1}, {"p": N, "d": R, "dd": N}),
        # derived unhealthy with an unhealthy primary parent: unrecoverable
        ({"p": 0, "d": 0, "dd": 1}, {"p": U, "d": U, "dd": N}),
        # chain derived <- derived <- primary: both rebuilt from the primary
        ({"p": 1, "d": 0, "dd": 0}, {"p": N, "d": R, "dd": R}),
        ({"p": 0, "d": 0, "dd": 0}, {"p": U, "d": U, "dd": U}),
        ({"p": 0, "d": 1, "dd": 0}, {"p": U, "d": N, "dd": R}),
        # missing from the health map: not healthy
        ({}, {"p": U, "d": U, "dd": U, "e": K, "de": U}),
        # a derived artifact of an ephemeral one cannot be rebuilt
        ({"p": 1, "d": 1, "dd": 1, "e": 1, "de": 0}, {"de": U, "e": K}),
    ],
)
def test_recovery_actions(healthy: dict[str, int], want: dict[str, RecoveryAction]) -> None:
    got = recovery_actions(_chain(), {k: bool(v) for k, v in healthy.items()})
    assert set(got) == {"p", "d", "dd", "e", "de"}
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("state", [S.STALE, S.RECOVERING, S.DEPRECATED])
def test_recovery_rebuilds_a_healthy_derived_that_is_not_active(state: Lifecycle) -> None:
    all_ok = dict.fromkeys(("p", "d", "dd", "e", "de"), True)
    got = recovery_actions(_chain(d=state), all_ok)
    assert got["d"] is R and got["dd"] is N and got["p"] is N


def test_recovery_without_rebuild_instruction_or_with_a_cycle_is_unrecoverable() -> None:
    arts = (
        _art("p", P),
        _art("d", D, "p", rebuild=None),
        _art("a", D, "b"),
        _art("b", D, "a"),
        _art("s", D, "s"),
    )
    got = recovery_actions(Manifest(1, (("x", 1),), arts, 64), {"p": True})
    assert got == {"p": N, "d": U, "a": U, "b": U, "s": U}
    # healthy members of a cycle are still restored as stored
    got = recovery_actions(Manifest(1, (("x", 1),), arts, 64), {"a": True, "b": False})
    assert got["a"] is N and got["b"] is R


# --- the worked example of FORMAT.md -----------------------------------------------------------


FORMAT_MD = (ROOT / "io" / "FORMAT.md").read_text(encoding="utf-8")
EXAMPLE_W = np.arange(15, dtype=np.float32).reshape(5, 3)
EXAMPLE_ENTRIES: list[tuple[TensorSpec, np.ndarray | None]] = [
    (TensorSpec("w", TensorType(DType.F32, (5, 3), Layout((("x",), ())))), EXAMPLE_W),
    (
        TensorSpec("w16", TensorType(DType.F16, (5, 3), Layout((("x",), ()))), D, "w", "cast:f16"),
        EXAMPLE_W.astype(np.float16),
    ),
    (TensorSpec("step_count", TensorType(DType.I64, (), Layout(()))), np.array(7, np.int64)),
    (TensorSpec("scratch", TensorType(DType.F32, (5, 3), Layout((("x",), ()))), E), None),
]


def _worked_example() -> tuple[str, dict[str, Any]]:
    """§11 of FORMAT.md (its text) and the manifest in its JSON block."""
    section = FORMAT_MD[FORMAT_MD.index("## 11. Worked example") :]
    section = section[: section.index("\n## 12.")]
    start = section.index("```json\n") + 8
    return section, json.loads(section[start : section.index("\n```", start)])


def test_format_md_worked_example_is_a_valid_manifest() -> None:
    section, doc = _worked_example()
    stored = canonical_json(doc)
    m = parse_manifest(stored, "FORMAT.md")
    validate_manifest(m, "FORMAT.md")
    assert schema_errors(doc) == []
    assert (
        m.step == 42 and m.mesh == (("x", 2),) and m.names == ("w", "w16", "step_count", "scratch")
    )
    assert doc["version"] == VERSION == 2
    size = f"{len(stored):,}".replace(",", " ")
    assert f"JSON of §8.1, {size} bytes" in section  # the size the text states
    assert m.to_bytes() == stored


def test_format_md_worked_example_is_what_dtm_mpi_builds() -> None:
    """The block is dtm_mpi's own manifest of the values the text describes (plan_save +
    plan_manifest with the default of one data file per writing rank), hash for hash."""
    section, doc = _worked_example()
    want = build(EXAMPLE_ENTRIES, MeshShape((("x", 2),)), chunk_bytes=24, step=42)
    want = replace(want, module_hash=None).sealed()
    assert want.to_json() == doc
    assert want.to_json()["manifest_hash"] == doc["manifest_hash"]
    # where the shards are stored, as the directory listing of the text says
    files = {(a.name, s.index): (s.file, s.dataset) for a in want.artifacts for s in a.shards}
    assert files == {
        ("w", 0): ("data-000000.h5", "/shards/w/0"),
        ("w", 1): ("data-000001.h5", "/shards/w/1"),
        ("w16", 0): ("data-000000.h5", "/shards/w16/0"),
        ("w16", 1): ("data-000001.h5", "/shards/w16/1"),
        ("step_count", 0): ("data-000000.h5", "/shards/step_count/0"),
    }
    listing = section[section.index("ckpt-00000042/") : section.index("```json")]
    for name, dataset in files.values():
        assert name in listing and dataset in listing, (name, dataset)
    plan = plan_save([s for s, _ in EXAMPLE_ENTRIES], MeshShape((("x", 2),)), 24)
    assert plan.files == (0, 1)
    # the content hashes do not depend on where shards are stored: every root but the
    # manifest hash is the one of the version-1 example (FORMAT.md §11, last paragraph)
    assert doc["merkle_root"] == "e997d9df645e8fd2b797b97c5dc426961bc21a3c13e707961d1eaad8db4b1ebf"
    assert doc["artifacts"][0]["merkle_root"] == (
        "dad9e45b8ec3d1c97b6ca6326fe825c56f2391015aa6ef2616cc0f068da29de1"
    )
    # the hand check of the text: chunk 0 of w:shard:1 is rows [3,5) of w
    w1 = want.artifact("w").shards[1]
    assert w1.chunk_region(0) == (slice(3, 5), slice(0, 3))
    assert w1.local_chunk_region(0) == (slice(0, 2), slice(0, 3))
    assert chunk_hash(EXAMPLE_W[3:5]) == w1.chunks[0]


def test_format_md_and_schema_state_the_code_s_name_rules() -> None:
    """The data-file pattern of FORMAT.md, the schema and the code agree."""
    pattern = r"^data-[0-9]{6,}\.h5$"
    assert f"`{pattern}`" in FORMAT_MD
    shard = SCHEMA["$defs"]["shard"]
    assert shard["properties"]["file"]["pattern"] == pattern
    assert {"file", "dataset"} <= set(shard["required"])
    assert shard["additionalProperties"] is False
    assert SCHEMA["properties"]["version"]["const"] == VERSION
    for index in (0, 1, 999_999, 1_000_000, 1_234_567):
        name = data_file_name(index)
        assert re.match(pattern, name), name
        assert int(name[5:-3]) == index
    assert data_file_name(0) == "data-000000.h5" and data_file_name(1_234_567) == "data-1234567.h5"
    for name in ("w", "a.b-c_1", "_x"):
        for i in (0, 7, 12):
            ds = shard_dataset(name, i)
            assert ds == f"/shards/{name}/{i}"
            assert re.match(shard["properties"]["dataset"]["pattern"], ds), ds


def _as_version_1(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as a version-1 writer stored it: no shard files or datasets, version 1."""
    doc = json.loads(json.dumps(doc))
    for a in doc["artifacts"]:
        for s in a["shards"]:
            del s["file"], s["dataset"]
    doc["version"] = 1
    return doc


def test_a_version_1_manifest_is_refused() -> None:
    """A manifest of the single-file format (a correct version-1 document, its hash
    included) is not loaded: the version is refused before anything else."""
    old = _as_version_1(manifest().to_json())
    text = rehashed(old)
    with pytest.raises(
        ManifestError,
        match=re.escape("ckpt.h5: manifest version 1 is not supported (this is version 2)"),
    ):
        parse_manifest(text, "ckpt.h5")
    assert schema_errors(json.loads(text))
    # the version-1 worked example (FORMAT.md version 1, §11) as stored then
    _, doc = _worked_example()
    v1 = _as_version_1(doc)
    assert (
        rehashed(v1).count(b"5131ad3d6752cbf703d5d9ac5655e6ca980073876325a48e3ab19a9f4f0ba9d6") == 1
    )
    with pytest.raises(ManifestError, match="manifest version 1 is not supported"):
        parse_manifest(rehashed(v1))
    # a version-2 document without the new fields is refused too (not read as version 1)
    v2_without = {**v1, "version": 2}
    with pytest.raises(ManifestError, match=r"tensor 'w' shards\[0\]: missing field 'file'"):
        parse_manifest(rehashed(v2_without))


@pytest.mark.parametrize(
    ("ranks_per_file", "files"),
    [
        (1, {"w": [0, 2], "w16": [0, 2], "b": [0, 1, 2], "step_count": [0], "mask": [0, 1]}),
        (2, {"w": [0, 1], "w16": [0, 1], "b": [0, 0, 1], "step_count": [0], "mask": [0, 0]}),
        (3, {"w": [0, 0], "w16": [0, 0], "b": [0, 0, 0], "step_count": [0], "mask": [0, 0]}),
        (0, {"w": [0, 0], "w16": [0, 0], "b": [0, 0, 0], "step_count": [0], "mask": [0, 0]}),
    ],
)
def test_shards_name_the_file_of_their_owner_s_group(
    ranks_per_file: int, files: dict[str, list[int]]
) -> None:
    """Data file = owner // G (G = 0: all ranks share file 0); the content hashes and roots do
    not depend on G, the manifest hash does (it covers file)."""
    m = build(ENTRIES, MESH, chunk_bytes=64, ranks_per_file=ranks_per_file)
    validate_manifest(m)
    assert schema_errors(m.to_json()) == []
    got = {a.name: [int(s.file[5:-3]) for s in a.shards] for a in m.artifacts if a.shards}
    assert got == files
    assert m.merkle_root == manifest().merkle_root
    assert [a.merkle_root for a in m.artifacts] == [a.merkle_root for a in manifest().artifacts]
    if ranks_per_file != 1:
        assert m.to_json()["manifest_hash"] != manifest().to_json()["manifest_hash"]
