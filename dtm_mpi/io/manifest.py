"""The manifest of a checkpoint: what is stored, where, in which state, with which hashes.

Pure values (frozen dataclasses and enums), their JSON form (io/manifest.schema.json) and the
rules that decide whether a manifest may be loaded. After the storage module of the seeds:

* **Artifact classes.** ``PRIMARY`` (the truth: cannot be recomputed), ``DERIVED`` (computable
  from a parent artifact by a rebuild instruction, e.g. ``cast:f16``), ``EPHEMERAL`` (recorded,
  never persisted: no shards).
* **Lifecycle.** ``STAGING -> ACTIVE -> STALE | RECOVERING -> DEPRECATED -> DELETED``
  (:data:`TRANSITIONS` lists every allowed move; :func:`transition` rejects the others).
* **Shard records** ``<tensor>:shard:<i>``: the owner rank and its mesh coordinates at write
  time, the hyperslab (offset, extent), the bytes, the chunk hashes (runs of ``chunk_rows``
  rows of the shard), the shard hash over them, and where its bytes are: the data file of
  the checkpoint (``data-NNNNNN.h5``) and the dataset in it (``/shards/<tensor>/<i>``).
* **Roots.** Each artifact has a Merkle root over its shard hashes, the manifest one over its
  artifacts' roots, and the manifest hash covers everything (io/hashing.py).

:func:`validate_manifest` fails closed: a missing or malformed hash, a zero-size shard, shards
that do not tile the tensor, a ``DELETED`` or ``STAGING`` artifact, a derived artifact without
parent or rebuild instruction, or a root that does not match makes the manifest unloadable,
with an error naming the tensor and shard.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dtm_mpi.errors import LifecycleError, ManifestError
from dtm_mpi.io.hashing import CONTENT_HASH, canonical_json, merkle_root, sha256_hex, shard_hash
from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp

__all__ = [
    "FORMAT",
    "TRANSITIONS",
    "VERSION",
    "ArtifactClass",
    "ArtifactRecord",
    "Lifecycle",
    "Manifest",
    "RecoveryAction",
    "ShardRecord",
    "data_file_name",
    "layout_from_json",
    "layout_to_json",
    "parse_loadable_manifest",
    "parse_manifest",
    "recovery_actions",
    "shard_dataset",
    "stored_itemsize",
    "transition",
    "validate_manifest",
]

FORMAT = "dtm-manifest"
VERSION = 2
_DATA_FILE = re.compile(r"data-[0-9]{6,}\.h5\Z")
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def data_file_name(index: int) -> str:
    """The name of data file ``index`` of a checkpoint directory."""
    return f"data-{index:06d}.h5"


def shard_dataset(tensor: str, index: int) -> str:
    """The dataset holding shard ``index`` of ``tensor`` in its data file."""
    return f"/shards/{tensor}/{index}"


def stored_itemsize(dtype: DType) -> int:
    """Bytes per stored element: the runtime's representation, so a restore is bit-identical
    to the saved state (bf16 is held, and stored, as IEEE binary32: spec Q12)."""
    from dtm_mpi.ir.dtypes import held_itemsize

    return held_itemsize(dtype)


class ArtifactClass(enum.Enum):
    PRIMARY = "PRIMARY"
    DERIVED = "DERIVED"
    EPHEMERAL = "EPHEMERAL"


class Lifecycle(enum.Enum):
    STAGING = "STAGING"
    ACTIVE = "ACTIVE"
    STALE = "STALE"
    RECOVERING = "RECOVERING"
    DEPRECATED = "DEPRECATED"
    DELETED = "DELETED"


TRANSITIONS: Mapping[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.STAGING: frozenset({Lifecycle.ACTIVE, Lifecycle.DELETED}),  # commit / cancel
    Lifecycle.ACTIVE: frozenset({Lifecycle.STALE, Lifecycle.RECOVERING, Lifecycle.DEPRECATED}),
    Lifecycle.STALE: frozenset({Lifecycle.RECOVERING, Lifecycle.DEPRECATED}),
    Lifecycle.RECOVERING: frozenset({Lifecycle.ACTIVE, Lifecycle.STALE, Lifecycle.DEPRECATED}),
    Lifecycle.DEPRECATED: frozenset({Lifecycle.DELETED}),
    Lifecycle.DELETED: frozenset(),
}
"""Every allowed lifecycle move; anything else is a :class:`LifecycleError`."""

LOADABLE = frozenset(
    {Lifecycle.ACTIVE, Lifecycle.STALE, Lifecycle.RECOVERING, Lifecycle.DEPRECATED}
)
"""States whose data may be read (STALE and RECOVERING derived data is rebuilt, not trusted)."""


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """One stored block of a tensor (a hyperslab of its global dataset)."""

    id: str  # "<tensor>:shard:<index>"
    index: int
    owner: int  # the rank that wrote it
    coords: tuple[int, ...]  # the owner's mesh coordinates at write time
    offset: tuple[int, ...]
    extent: tuple[int, ...]
    nbytes: int
    chunk_rows: int  # rows (along dim 0 of the shard) per chunk; 0-d shards: 1
    chunks: tuple[str, ...]  # XXH3-128 of each chunk
    hash: str  # XXH3-128 over the chunk digests
    file: str = ""  # the data file holding it, relative to the checkpoint directory
    dataset: str = ""  # its dataset in that file: /shards/<tensor>/<index>, shape = extent

    def local_chunk_region(self, i: int) -> tuple[slice, ...]:
        """Chunk ``i`` in the coordinates of the shard's own dataset."""
        return tuple(
            slice(r.start - o, r.stop - o)
            for r, o in zip(self.chunk_region(i), self.offset, strict=True)
        )

    @property
    def region(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + e) for o, e in zip(self.offset, self.extent, strict=True))

    def chunk_region(self, i: int) -> tuple[slice, ...]:
        """The global hyperslab of chunk ``i`` (rows ``[i*chunk_rows, ...)`` of the shard)."""
        if not self.extent:
            return ()
        lo = self.offset[0] + i * self.chunk_rows
        hi = min(self.offset[0] + self.extent[0], lo + self.chunk_rows)
        return (slice(lo, hi), *self.region[1:])


@dataclass(frozen=True, slots=True)
class ArtifactRecord:
    name: str
    cls: ArtifactClass
    state: Lifecycle
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout  # at write time, on the manifest's mesh
    dataset: str | None  # HDF5 path of the global dataset; None for ephemeral artifacts
    parent: str | None = None
    rebuild: str | None = None  # e.g. "cast:f16", "copy"
    shards: tuple[ShardRecord, ...] = ()
    merkle_root: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * stored_itemsize(self.dtype)

    def shard(self, shard_id: str) -> ShardRecord:
        for s in self.shards:
            if s.id == shard_id:
                return s
        raise ManifestError(f"tensor {self.name!r} has no shard {shard_id!r}")


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    mesh: tuple[tuple[str, int], ...]
    artifacts: tuple[ArtifactRecord, ...]
    chunk_bytes: int
    module_hash: str | None = None
    dtm_version: str = ""
    hash_algorithm: str = CONTENT_HASH
    merkle_root: str = ""

    def artifact(self, name: str) -> ArtifactRecord:
        for a in self.artifacts:
            if a.name == name:
                return a
        raise ManifestError(f"the manifest has no tensor {name!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.artifacts)

    @property
    def data_bytes(self) -> int:
        return sum(s.nbytes for a in self.artifacts for s in a.shards)

    def sealed(self) -> Manifest:
        """The manifest with every Merkle root computed from its shard hashes."""
        arts = tuple(
            replace(a, merkle_root=merkle_root([s.hash for s in a.shards])) for a in self.artifacts
        )
        persisted = sorted(
            (a for a in arts if a.cls is not ArtifactClass.EPHEMERAL), key=lambda a: a.name
        )
        return replace(
            self, artifacts=arts, merkle_root=merkle_root([a.merkle_root for a in persisted])
        )

    def to_json(self) -> dict[str, Any]:
        doc = _manifest_doc(self)
        doc["manifest_hash"] = sha256_hex(canonical_json(doc))
        return doc

    def to_bytes(self) -> bytes:
        """The canonical JSON text stored in a checkpoint file."""
        return canonical_json(self.to_json())


# --- lifecycle and recovery -------------------------------------------------------------------


def transition(artifact: ArtifactRecord, new: Lifecycle) -> ArtifactRecord:
    """``artifact`` in state ``new``; raises :class:`LifecycleError` for a move that
    :data:`TRANSITIONS` does not allow."""
    if new not in TRANSITIONS[artifact.state]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[artifact.state])) or "none"
        raise LifecycleError(
            f"tensor {artifact.name!r}: lifecycle {artifact.state.value} -> {new.value} is not "
            f"allowed (from {artifact.state.value}: {allowed})"
        )
    return replace(artifact, state=new)


class RecoveryAction(enum.Enum):
    NONE = "none"  # healthy: restore as stored
    REBUILD = "rebuild"  # derived: recompute from the parent
    SKIP = "skip"  # ephemeral: never recovered; recomputed by whoever needs it
    UNRECOVERABLE = "unrecoverable"  # primary (or derived without healthy parent)


def recovery_actions(manifest: Manifest, healthy: Mapping[str, bool]) -> dict[str, RecoveryAction]:
    """What restore does with each artifact given which ones verified (``healthy[name]``).

    Ephemeral artifacts are never recovered; a derived artifact that is unhealthy, STALE or
    RECOVERING is rebuilt from its parent when the parent (recursively) can be restored; a
    primary artifact without a healthy copy is unrecoverable."""
    out: dict[str, RecoveryAction] = {}

    def decide(name: str, seen: tuple[str, ...]) -> RecoveryAction:
        if name in out:
            return out[name]
        a = manifest.artifact(name)
        if a.cls is ArtifactClass.EPHEMERAL:
            act = RecoveryAction.SKIP
        elif a.cls is ArtifactClass.PRIMARY:
            act = RecoveryAction.NONE if healthy.get(name, False) else RecoveryAction.UNRECOVERABLE
        elif healthy.get(name, False) and a.state is Lifecycle.ACTIVE:
            act = RecoveryAction.NONE
        elif a.parent is None or a.parent in seen or a.rebuild is None:
            act = RecoveryAction.UNRECOVERABLE
        else:
            parent = decide(a.parent, (*seen, name))
            ok = parent in (RecoveryAction.NONE, RecoveryAction.REBUILD)
            act = RecoveryAction.REBUILD if ok else RecoveryAction.UNRECOVERABLE
        out[name] = act
        return act

    for a in manifest.artifacts:
        decide(a.name, ())
    return out


# --- JSON -------------------------------------------------------------------------------------


def layout_to_json(layout: Layout) -> dict[str, Any]:
    partial = None
    if layout.partial is not None:
        partial = {"op": layout.partial.op.value, "axes": list(layout.partial.axes)}
    return {"dims": [list(d) for d in layout.dims], "partial": partial}


def layout_from_json(doc: Any, where: str) -> Layout:
    try:
        dims = tuple(tuple(str(a) for a in d) for d in doc["dims"])
        p = doc.get("partial")
        partial = None if p is None else Partial(ReduceOp(p["op"]), tuple(p["axes"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{where}: malformed layout {doc!r} ({exc})") from None
    return Layout(dims, partial)


def _shard_doc(s: ShardRecord) -> dict[str, Any]:
    return {
        "id": s.id,
        "index": s.index,
        "owner": s.owner,
        "coords": list(s.coords),
        "offset": list(s.offset),
        "extent": list(s.extent),
        "bytes": s.nbytes,
        "chunk_rows": s.chunk_rows,
        "chunks": list(s.chunks),
        "hash": s.hash,
        "file": s.file,
        "dataset": s.dataset,
    }


def _artifact_doc(a: ArtifactRecord) -> dict[str, Any]:
    return {
        "name": a.name,
        "class": a.cls.value,
        "state": a.state.value,
        "dtype": a.dtype.value,
        "shape": list(a.shape),
        "layout": layout_to_json(a.layout),
        "dataset": a.dataset,
        "parent": a.parent,
        "rebuild": a.rebuild,
        "merkle_root": a.merkle_root,
        "shards": [_shard_doc(s) for s in a.shards],
    }


def _manifest_doc(m: Manifest) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": m.step,
        "mesh": [[a, n] for a, n in m.mesh],
        "module_hash": m.module_hash,
        "dtm_version": m.dtm_version,
        "hash_algorithm": m.hash_algorithm,
        "chunk_bytes": m.chunk_bytes,
        "merkle_root": m.merkle_root,
        "artifacts": [_artifact_doc(a) for a in m.artifacts],
    }


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    ):
        raise ManifestError(f"{what}: expected a list of integers, got {v!r}")
    return tuple(v)


def _get(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise ManifestError(f"{where}: missing field {key!r}")
    v = doc[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
        raise ManifestError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def parse_manifest(text: bytes | str, where: str = "manifest") -> Manifest:
    """The manifest in ``text`` (JSON); raises :class:`ManifestError` naming ``where`` for
    malformed JSON, unknown format or version, missing fields or a wrong manifest hash. Does
    not judge loadability: see :func:`validate_manifest`."""
    try:
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected a JSON object")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"{where}: format {doc.get('format')!r} is not {FORMAT!r}")
    if type(doc.get("version")) is not int or doc.get("version") != VERSION:
        raise ManifestError(
            f"{where}: manifest version {doc.get('version')!r} is not supported (this is version {VERSION})"
        )
    stated = doc.pop("manifest_hash", None)
    if stated is None:
        raise ManifestError(f"{where}: missing field 'manifest_hash'")
    actual = sha256_hex(canonical_json(doc))
    if stated != actual:
        raise ManifestError(
            f"{where}: manifest hash mismatch (stored {stated}, computed {actual}): the manifest was altered or truncated"
        )
    arts = []
    for i, ad in enumerate(_get(doc, "artifacts", list, where)):
        aw = f"{where}: artifacts[{i}]"
        if not isinstance(ad, dict):
            raise ManifestError(f"{aw}: expected an object")
        name = _get(ad, "name", str, aw)
        aw = f"{where}: tensor {name!r}"
        try:
            cls, state = ArtifactClass(ad.get("class")), Lifecycle(ad.get("state"))
            dtype = DType(ad.get("dtype"))
        except ValueError as exc:
            raise ManifestError(f"{aw}: {exc}") from None
        shards = []
        for j, sd in enumerate(_get(ad, "shards", list, aw)):
            sw = f"{aw} shards[{j}]"
            if not isinstance(sd, dict):
                raise ManifestError(f"{sw}: expected an object")
            chunks = _get(sd, "chunks", list, sw)
            shard = ShardRecord(
                _get(sd, "id", str, sw),
                _get(sd, "index", int, sw),
                _get(sd, "owner", int, sw),
                _ints(sd.get("coords"), f"{sw} coords"),
                _ints(sd.get("offset"), f"{sw} offset"),
                _ints(sd.get("extent"), f"{sw} extent"),
                _get(sd, "bytes", int, sw),
                _get(sd, "chunk_rows", int, sw),
                tuple(str(c) for c in chunks),
                str(sd.get("hash") or ""),
                _get(sd, "file", str, sw),
                _get(sd, "dataset", str, sw),
            )
            shards.append(shard)
        art = ArtifactRecord(
            name,
            cls,
            state,
            dtype,
            _ints(ad.get("shape"), f"{aw} shape"),
            layout_from_json(ad.get("layout"), aw),
            ad.get("dataset"),
            ad.get("parent"),
            ad.get("rebuild"),
            tuple(shards),
            str(ad.get("merkle_root") or ""),
        )
        arts.append(art)
    mesh_doc = _get(doc, "mesh", list, where)
    if not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int
        for e in mesh_doc
    ):
        raise ManifestError(f"{where}: mesh must be a list of [axis, size] pairs, got {mesh_doc!r}")
    mesh = tuple((str(a), int(n)) for a, n in mesh_doc)
    return Manifest(
        _get(doc, "step", int, where),
        mesh,
        tuple(arts),
        _get(doc, "chunk_bytes", int, where),
        doc.get("module_hash"),
        str(doc.get("dtm_version", "")),
        _get(doc, "hash_algorithm", str, where),
        str(doc.get("merkle_root") or ""),
    )


# --- validation (fail closed) -----------------------------------------------------------------


def _check_shards(a: ArtifactRecord, where: str) -> None:
    total = 0
    for i, s in enumerate(a.shards):
        sw = f"{where}: tensor {a.name!r} shard {s.id!r}"
        if s.id != f"{a.name}:shard:{i}" or s.index != i:
            raise ManifestError(f"{sw}: expected id {a.name}:shard:{i}")
        if not _HEX32.match(s.hash) or not s.chunks or not all(_HEX32.match(c) for c in s.chunks):
            raise ManifestError(f"{sw}: missing or malformed content hash")
        if len(s.offset) != len(a.shape) or len(s.extent) != len(a.shape):
            raise ManifestError(f"{sw}: hyperslab rank differs from the tensor's {len(a.shape)}")
        if any(
            o < 0 or e <= 0 or o + e > n
            for o, e, n in zip(s.offset, s.extent, a.shape, strict=True)
        ):
            raise ManifestError(
                f"{sw}: empty or out-of-bounds hyperslab offset {list(s.offset)} extent {list(s.extent)} of shape {list(a.shape)}"
            )
        if s.nbytes <= 0 or s.nbytes != math.prod(s.extent) * stored_itemsize(a.dtype):
            raise ManifestError(
                f"{sw}: {s.nbytes} bytes does not match extent {list(s.extent)} of {a.dtype}"
            )
        rows = s.extent[0] if s.extent else 1
        if s.chunk_rows <= 0 or len(s.chunks) != -(-rows // s.chunk_rows):
            raise ManifestError(
                f"{sw}: {len(s.chunks)} chunk hashes for {rows} rows in runs of {s.chunk_rows}"
            )
        if shard_hash(s.chunks) != s.hash:
            raise ManifestError(f"{sw}: shard hash does not match its chunk hashes")
        if not _DATA_FILE.match(s.file) or s.dataset != shard_dataset(a.name, i):
            raise ManifestError(
                f"{sw}: stored in file {s.file!r} dataset {s.dataset!r}; expected a data file data-NNNNNN.h5 and dataset {shard_dataset(a.name, i)}"
            )
        total += math.prod(s.extent)
    if total != math.prod(a.shape):
        raise ManifestError(
            f"{where}: tensor {a.name!r}: shards hold {total} elements, the tensor {math.prod(a.shape)}"
        )
    # pairwise disjoint (with the count above: an exact tiling). Sorted by the first offset,
    # a shard can only meet those that start before it ends along dimension 0.
    order = sorted(a.shards, key=lambda sh: sh.offset[:1])
    for i, s in enumerate(order):
        for t in order[i + 1 :]:
            if s.extent and t.offset[0] >= s.offset[0] + s.extent[0]:
                break
            if all(
                so < to + te and to < so + se
                for so, se, to, te in zip(s.offset, s.extent, t.offset, t.extent, strict=True)
            ):
                raise ManifestError(
                    f"{where}: tensor {a.name!r}: shards {s.id!r} and {t.id!r} overlap"
                )


def validate_manifest(m: Manifest, where: str = "manifest") -> None:
    """Raise :class:`ManifestError` unless ``m`` may be loaded (module doc)."""
    if m.hash_algorithm != CONTENT_HASH:
        raise ManifestError(
            f"{where}: content hash {m.hash_algorithm!r} is not supported ({CONTENT_HASH})"
        )
    if m.step < 0 or m.chunk_bytes <= 0:
        raise ManifestError(
            f"{where}: step {m.step} and chunk_bytes {m.chunk_bytes} must be >= 0 and > 0"
        )
    names = [a.name for a in m.artifacts]
    if len(set(names)) != len(names):
        raise ManifestError(f"{where}: a tensor name appears twice")
    by_name = {a.name: a for a in m.artifacts}
    for a in m.artifacts:
        aw = f"{where}: tensor {a.name!r}"
        if a.state in (Lifecycle.DELETED, Lifecycle.STAGING):
            raise ManifestError(f"{aw} is {a.state.value}: not loadable")
        if any(n < 0 for n in a.shape) or len(a.layout.dims) != len(a.shape):
            raise ManifestError(f"{aw}: shape {list(a.shape)} and layout {a.layout} do not match")
        if a.cls is ArtifactClass.EPHEMERAL:
            if a.shards or a.dataset is not None:
                raise ManifestError(f"{aw}: an ephemeral artifact has no stored data")
            continue
        if a.cls is ArtifactClass.DERIVED:
            if a.parent is None or a.rebuild is None:
                raise ManifestError(
                    f"{aw}: a derived artifact needs a parent and a rebuild instruction"
                )
            parent = by_name.get(a.parent)
            if parent is None or parent.cls is ArtifactClass.EPHEMERAL:
                raise ManifestError(
                    f"{aw}: parent {a.parent!r} is not a stored artifact of this manifest"
                )
        if not a.dataset:
            raise ManifestError(f"{aw}: no dataset")
        _check_shards(a, where)
        if a.merkle_root != merkle_root([s.hash for s in a.shards]):
            raise ManifestError(f"{aw}: Merkle root does not match its shard hashes")
    if not _HEX64.match(m.merkle_root) or m.merkle_root != m.sealed().merkle_root:
        raise ManifestError(f"{where}: Merkle root does not match the artifacts' roots")


def parse_loadable_manifest(text: bytes | str, where: str = "manifest") -> Manifest:
    """The manifest in ``text``, parsed (:func:`parse_manifest`) and judged loadable
    (:func:`validate_manifest`): what every reader of a stored checkpoint needs."""
    manifest = parse_manifest(text, where)
    validate_manifest(manifest, where)
    return manifest
