"""A checkpoint store on disk: one directory, serial operations (rank 0 or a tool).

Layout (io/FORMAT.md)::

    STORE/store.json                      {"format": "dtm-store", "version": 1,
                                           "quota_bytes": null | N, "keep_last": null | K}
    STORE/ckpt-00000005.h5                a committed checkpoint (step 5)
    STORE/ckpt-00000006.h5.partial-3f2a   a save in progress, cancelled or killed: incomplete
    STORE/latest                          "ckpt-00000005.h5\\n" (replaced atomically)

A checkpoint is committed by the rename of its partial file; ``latest`` is updated after that
(also by rename), so at every moment ``latest`` names a committed, verified checkpoint, and a
crash between the two renames leaves the older ``latest`` valid. Every write here is
fsynced, and so is the directory after every rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from dtm_mpi.errors import IntegrityError, ManifestError, StorageError, UsageError
from dtm_mpi.io.hashing import chunk_hash
from dtm_mpi.io.manifest import ArtifactClass, Manifest, parse_manifest, validate_manifest

__all__ = [
    "CheckpointEntry",
    "check_file_format",
    "StoreMeta",
    "committed_name",
    "disk_usage",
    "fsync_dir",
    "list_checkpoints",
    "read_latest",
    "read_manifest",
    "read_meta",
    "retired_files",
    "verify_checkpoint",
    "write_latest",
    "write_meta",
]

STORE_FORMAT = "dtm-store"
STORE_VERSION = 1
CKPT_FORMAT = "dtm-checkpoint"
_COMMITTED = re.compile(r"ckpt-(\d{8,})\.h5\Z")
_PARTIAL = re.compile(r"ckpt-(\d{8,})\.h5\.partial-([0-9a-f]+)\Z")


@dataclass(frozen=True, slots=True)
class StoreMeta:
    quota_bytes: int | None = None
    keep_last: int | None = None

    def to_json(self) -> dict[str, object]:
        return {"format": STORE_FORMAT, "version": STORE_VERSION,
                "quota_bytes": self.quota_bytes, "keep_last": self.keep_last}  # fmt: skip


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    step: int
    path: Path
    committed: bool  # False: a partial file (in progress, cancelled or killed)
    nbytes: int
    latest: bool


def committed_name(step: int) -> str:
    return f"ckpt-{step:08d}.h5"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_meta(store: Path) -> StoreMeta | None:
    """The store's settings, or None when ``store`` has no ``store.json`` yet."""
    p = store / "store.json"
    if not p.exists():
        return None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
        if doc.get("format") != STORE_FORMAT or doc.get("version") != STORE_VERSION:
            raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
        quota, keep = doc.get("quota_bytes"), doc.get("keep_last")
        for v in (quota, keep):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"quota_bytes and keep_last are null or integers >= 1, got {v!r}")
        return StoreMeta(quota, keep)
    except (OSError, ValueError) as exc:
        raise StorageError(f"{p}: not a dtm store settings file ({exc})") from None


def write_meta(store: Path, meta: StoreMeta) -> None:
    store.mkdir(parents=True, exist_ok=True)
    _write_atomic(store / "store.json", json.dumps(meta.to_json(), indent=1) + "\n")


def read_latest(store: Path) -> int | None:
    """The step ``latest`` names when that checkpoint exists, else the newest committed one
    (a crash between commit and pointer update), else None."""
    m = _COMMITTED.match(_pointer(store))
    if m and (store / m.group(0)).exists():
        return int(m.group(1))
    steps = [e.step for e in list_checkpoints(store) if e.committed]
    return max(steps) if steps else None


def write_latest(store: Path, step: int) -> None:
    _write_atomic(store / "latest", committed_name(step) + "\n")


def list_checkpoints(store: Path) -> list[CheckpointEntry]:
    """Committed and partial checkpoints, by step (partials after the committed one)."""
    if not store.is_dir():
        raise UsageError(f"{store}: no such store directory")
    named = _pointer(store)
    out = []
    for p in store.iterdir():
        m = _COMMITTED.match(p.name) or _PARTIAL.match(p.name)
        if m is None:
            continue
        committed = _COMMITTED.match(p.name) is not None
        out.append(CheckpointEntry(int(m.group(1)), p, committed, p.stat().st_size, committed and p.name == named))  # fmt: skip
    return sorted(out, key=lambda e: (e.step, not e.committed, e.path.name))


def _pointer(store: Path) -> str:
    """The file name ``latest`` holds ("" when it is missing or damaged: readers then fall
    back to the newest committed checkpoint)."""
    try:
        return (store / "latest").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def retired_files(store: Path) -> list[Path]:
    """Checkpoints retention has retired (``.deleting-*``) that are not deleted yet (a crash
    can leave them; the next retention or ``dtm ckpt rm --partial`` removes them)."""
    return sorted(store.glob(".deleting-ckpt-*"))


def disk_usage(store: Path) -> int:
    """Bytes of every checkpoint file in the store, partial ones and retired ones still being
    deleted included."""
    retiring = 0
    for p in retired_files(store):
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
            retiring += p.stat().st_size
    return retiring + sum(e.nbytes for e in list_checkpoints(store))


FORMAT_VERSION = 1


def check_file_format(f: h5py.File, path: Path) -> None:
    """Raise :class:`ManifestError` unless ``f`` is a dtm checkpoint of a version this reads."""
    if f.attrs.get("dtm_format") != CKPT_FORMAT:
        raise ManifestError(f"{path}: not a dtm checkpoint (no dtm_format={CKPT_FORMAT!r} attribute)")  # fmt: skip
    version = f.attrs.get("format_version")
    if version is None or int(version) != FORMAT_VERSION:
        raise ManifestError(f"{path}: checkpoint format version {version!r} is not supported (this reads version {FORMAT_VERSION})")  # fmt: skip


def read_manifest(path: Path) -> Manifest:
    """The validated manifest of the checkpoint file ``path`` (serial read)."""
    try:
        with h5py.File(path, "r") as f:
            check_file_format(f, path)
            if "manifest" not in f:
                raise ManifestError(f"{path}: no manifest: the checkpoint is incomplete")
            text = bytes(f["manifest"][()])
    except OSError as exc:
        raise ManifestError(f"{path}: cannot be read as HDF5 ({exc})") from None
    manifest = parse_manifest(text, str(path))
    validate_manifest(manifest, str(path))
    return manifest


def verify_checkpoint(path: Path) -> list[IntegrityError]:
    """Re-read every stored chunk of ``path`` and compare it with its content hash; returns
    one error per damaged shard (naming tensor, shard, chunk and file). Serial."""
    manifest = read_manifest(path)
    problems: list[IntegrityError] = []
    with h5py.File(path, "r") as f:
        for a in manifest.artifacts:
            if a.cls is ArtifactClass.EPHEMERAL or a.dataset is None:
                continue
            if a.dataset not in f:
                problems.append(IntegrityError("dataset is missing", tensor=a.name, shard="*", file=str(path)))  # fmt: skip
                continue
            dset = f[a.dataset]
            if tuple(dset.shape) != a.shape:
                problems.append(IntegrityError(f"dataset shape {list(dset.shape)} is not {list(a.shape)}", tensor=a.name, shard="*", file=str(path)))  # fmt: skip
                continue
            for s in a.shards:
                for c, want in enumerate(s.chunks):
                    got = chunk_hash(np.ascontiguousarray(dset[s.chunk_region(c)]))
                    if got != want:
                        problems.append(
                            IntegrityError(
                                f"chunk {c} content hash {got} does not match the manifest's {want}",
                                tensor=a.name,
                                shard=s.id,
                                file=str(path),
                            )
                        )
                        break
    return problems
