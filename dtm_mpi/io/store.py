"""A checkpoint store on disk: one directory, serial operations (rank 0 or a tool).

Layout (io/FORMAT.md §2)::

    STORE/store.json                        {"format": "dtm-store", "version": 2,
                                             "quota_bytes": null | N, "keep_last": null | K,
                                             "backend": "hdf5"}
    STORE/ckpt-00000005/                    a committed checkpoint (step 5): a directory of
                                            checkpoint.h5 and data-NNNNNN.h5 files (io/ckpt_files.py)
    STORE/ckpt-00000006.partial-3f2a9c01/   a save in progress, cancelled or killed: incomplete
    STORE/latest                            "ckpt-00000005\\n" (replaced atomically)

A checkpoint is committed by the rename of its partial directory; ``latest`` is updated after
that (also by rename), so at every moment ``latest`` names a committed, verified checkpoint,
and a crash between the two renames leaves the older ``latest`` valid. Every write is fsynced,
and so is the directory after every rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dtm_mpi.errors import StorageError, UsageError

__all__ = [
    "DEFAULT_BACKEND",
    "CheckpointEntry",
    "StoreMeta",
    "committed_name",
    "disk_usage",
    "fsync_path",
    "legacy_files",
    "list_checkpoints",
    "meta_outdated",
    "partial_name",
    "read_latest",
    "read_meta",
    "remove_path",
    "replace_dir",
    "retired_files",
    "tree_bytes",
    "write_latest",
    "write_meta",
    "write_text_atomic",
]

STORE_FORMAT = "dtm-store"
STORE_VERSION = 2
_READS = (1, 2)  # store.json versions read (1: the same settings, rewritten as 2 on open)
_COMMITTED = re.compile(r"ckpt-([0-9]{8,})\Z")
_PARTIAL = re.compile(r"ckpt-([0-9]{8,})\.partial-([0-9a-f]+)\Z")
_LEGACY = re.compile(r"ckpt-([0-9]{8,})\.h5(\.partial-[0-9a-f]+)?\Z")

DEFAULT_BACKEND = "hdf5"
"""The storage backend (:mod:`dtm_mpi.io.backend`, by name) of a store whose ``store.json``
records none: every store written before the field existed, and a store without
``store.json``."""


@dataclass(frozen=True, slots=True)
class StoreMeta:
    quota_bytes: int | None = None
    keep_last: int | None = None
    backend: str = DEFAULT_BACKEND  # the name of the backend its checkpoints are stored with

    def to_json(self) -> dict[str, object]:
        return {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "quota_bytes": self.quota_bytes,
            "keep_last": self.keep_last,
            "backend": self.backend,
        }


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    step: int
    path: Path
    committed: bool  # False: a partial checkpoint (in progress, cancelled or killed)
    nbytes: int
    latest: bool


def committed_name(step: int) -> str:
    return f"ckpt-{step:08d}"


def partial_name(step: int, token: str) -> str:
    return f"{committed_name(step)}.partial-{token}"


def tree_bytes(path: Path) -> int:
    """Bytes of the file ``path``, or of every file under the directory ``path`` (0 when it
    vanished meanwhile)."""
    try:
        if not path.is_dir():
            return path.stat().st_size
        total = 0
        for p in path.rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size if p.is_file() else 0
        return total
    except FileNotFoundError:
        return 0


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the system or file system cannot."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd = -100
    rc = fn(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not here; fall back
        return False
    raise OSError(err, os.strerror(err), str(a))


def replace_dir(new: Path, final: Path, old: Path) -> Path:
    """Put directory ``new`` in place of the existing ``final``, moving the replaced one to
    ``old``; returns where the replaced one is. Atomic where the system swaps names (Linux):
    at every moment ``final`` is one complete checkpoint. Elsewhere two renames (a crash
    between them leaves ``final`` absent; readers then fall back to the newest committed
    checkpoint), undone if the second fails. Raises only while ``final`` is still the old
    checkpoint."""
    if _exchange(new, final):
        try:
            os.replace(new, old)  # ``new`` now names the replaced checkpoint
        except OSError:
            return new  # committed all the same; the old one stays under the partial name
        return old
    os.replace(final, old)
    try:
        os.replace(new, final)
    except OSError:
        os.replace(old, final)
        raise
    return old


def remove_path(path: Path) -> None:
    """Delete the file or directory tree ``path`` (nothing when it is gone)."""
    if path.is_dir() and not path.is_symlink():
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile (another remover)
            shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    """``fsync`` the file or directory ``path`` (a directory: its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically (a temporary file, fsync, rename, fsync of the
    directory): a crash leaves the old content or the new, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_meta(store: Path) -> StoreMeta | None:
    """The store's settings, or None when ``store`` has no ``store.json`` yet (a
    ``store.json`` without ``backend`` records :data:`DEFAULT_BACKEND`)."""
    p = store / "store.json"
    if not p.exists():
        return None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON object is expected, got {type(doc).__name__}")
        if (
            doc.get("format") != STORE_FORMAT
            or doc.get("version") not in _READS
            or type(doc.get("version")) is not int
        ):
            raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
        quota, keep = doc.get("quota_bytes"), doc.get("keep_last")
        for v in (quota, keep):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"quota_bytes and keep_last are null or integers >= 1, got {v!r}")
        backend = doc.get("backend", DEFAULT_BACKEND)
        if not isinstance(backend, str) or not backend:
            raise ValueError(
                f"backend is the name of a storage backend (a string), got {backend!r}"
            )
        return StoreMeta(quota, keep, backend)
    except (OSError, ValueError) as exc:
        raise StorageError(f"{p}: not a dtm store settings file ({exc})") from None


def meta_outdated(store: Path) -> bool:
    """True when ``store.json`` exists in an older version this reads (rewrite it)."""
    try:
        doc = json.loads((store / "store.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("version") != STORE_VERSION


def write_meta(store: Path, meta: StoreMeta) -> None:
    """Write ``store.json``, creating the store directory (and its parents) first."""
    _make_store_dir(store)
    write_text_atomic(store / "store.json", json.dumps(meta.to_json(), indent=1) + "\n")


def _make_store_dir(store: Path) -> None:
    """Create the directory ``store``; a :class:`StorageError` saying which path is in the
    way when it, or one of its parents, is not a directory."""
    for p in (store, *store.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == store else f"cannot be created: {p} is a file"
            raise StorageError(f"{what}, not a directory")
    store.mkdir(parents=True, exist_ok=True)


def read_latest(store: Path) -> int | None:
    """The step ``latest`` names when that checkpoint exists, else the newest committed one
    (a crash between commit and pointer update), else None."""
    m = _COMMITTED.match(_pointer(store))
    if m and (store / m.group(0)).is_dir():
        return int(m.group(1))
    steps = [e.step for e in list_checkpoints(store) if e.committed]
    return max(steps) if steps else None


def write_latest(store: Path, step: int) -> None:
    write_text_atomic(store / "latest", committed_name(step) + "\n")


def list_checkpoints(store: Path) -> list[CheckpointEntry]:
    """Committed and partial checkpoints (directories), by step (partials after the
    committed one)."""
    if not store.is_dir():
        raise UsageError(f"{store}: no such store directory")
    named = _pointer(store)
    out = []
    for p in store.iterdir():
        m = _COMMITTED.match(p.name) or _PARTIAL.match(p.name)
        if m is None or not p.is_dir():
            continue
        committed = _COMMITTED.match(p.name) is not None
        out.append(
            CheckpointEntry(
                int(m.group(1)), p, committed, tree_bytes(p), committed and p.name == named
            )
        )
    return sorted(out, key=lambda e: (e.step, not e.committed, e.path.name))


def _pointer(store: Path) -> str:
    """The file name ``latest`` holds ("" when it is missing or damaged: readers then fall
    back to the newest committed checkpoint)."""
    try:
        return (store / "latest").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def legacy_files(store: Path) -> list[Path]:
    """Single-file checkpoints of format version 1 (``ckpt-N.h5``), which this version does not
    read; they are not part of the store but are listed and count against its quota."""
    return sorted(p for p in store.iterdir() if _LEGACY.match(p.name) and p.is_file())


def retired_files(store: Path) -> list[Path]:
    """Checkpoints retention has retired (``.deleting-*``) that are not deleted yet (a crash
    can leave them; the next retention or ``dtm ckpt rm --partial`` removes them)."""
    return sorted(store.glob(".deleting-ckpt-*"))


def disk_usage(store: Path) -> int:
    """Bytes of every checkpoint in the store, partial ones, retired ones still being
    deleted and version-1 files included."""
    other = sum(tree_bytes(p) for p in retired_files(store) + legacy_files(store))
    return other + sum(e.nbytes for e in list_checkpoints(store))
