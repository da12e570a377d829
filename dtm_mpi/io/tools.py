"""The store's serial tools as a public API: what ``dtm ckpt`` and ``dtm store`` do, for any
caller (the CLI in :mod:`dtm_mpi.cli_store` only parses arguments and prints these results).

* :func:`store_dir`, :func:`checkpoint_path`: a store directory and one of its committed
  checkpoints, as a user names them (a :class:`UsageError` when they do not exist);
* :func:`store_backend`: the storage backend the store records (``store.json``), by which
  every tool here reads and removes its checkpoints; :func:`read_manifest` and
  :func:`read_manifest_bytes` through it;
* :func:`verify_checkpoints`: re-read and re-hash every chunk of one checkpoint or of every
  checkpoint of a store, each in a child process (:func:`verify_isolated`): damaged metadata
  can make the format's library itself crash or loop (HDF5 does), and that is reported as
  damage of the tensor, shard and file being read, like any other;
* :func:`remove_checkpoint`, :func:`remove_incomplete`: tidy a store (atomically: never a
  half-deleted checkpoint under its committed name);
* :func:`read_tensor`: one tensor's global value, every chunk verified;
* :func:`put_tensor`: a new checkpoint with one tensor added or replaced (copy-on-write), its
  derived tensors rebuilt, saved through :class:`~dtm_mpi.io.checkpoint.CheckpointStore` on
  the communicator the caller gives (one process).

Everything here is serial and bounded: a verification child that stops answering is ended
after ``timeout_s`` seconds without progress.
"""

from __future__ import annotations

import enum
import faulthandler
import importlib
import json
import os
import secrets
import select
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import IntegrityError, ManifestError, StorageError, UsageError
from dtm_mpi.io.backend import ShardBackend, parse_backend_name
from dtm_mpi.io.manifest import (
    ArtifactClass,
    ArtifactRecord,
    Lifecycle,
    Manifest,
    parse_loadable_manifest,
    transition,
)
from dtm_mpi.io.store import (
    DEFAULT_BACKEND,
    CheckpointEntry,
    committed_name,
    fsync_path,
    list_checkpoints,
    read_latest,
    read_meta,
    retired_files,
    write_latest,
)
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.types import DType

__all__ = [
    "TensorRows",
    "INCOMPLETE_NOTE",
    "CheckStatus",
    "CheckpointCheck",
    "PutResult",
    "bf16_bits",
    "checkpoint_path",
    "committed",
    "dtm_dtype",
    "put_tensor",
    "put_tensors",
    "read_manifest",
    "read_manifest_bytes",
    "read_tensor",
    "reason",
    "remove_checkpoint",
    "remove_incomplete",
    "store_backend",
    "store_dir",
    "stored",
    "verify_checkpoints",
    "verify_isolated",
]

INCOMPLETE_NOTE = "a save in progress, cancelled or killed; not loadable"


# --- naming a store and a checkpoint ----------------------------------------------------------


def store_dir(text: str | os.PathLike[str]) -> Path:
    """The store directory ``text``; a :class:`UsageError` if it is not a directory."""
    path = Path(text)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise UsageError(f"store {text} {what}")
    return path


def committed(store: Path) -> list[CheckpointEntry]:
    """The committed checkpoints of ``store``, by step."""
    return [e for e in list_checkpoints(store) if e.committed]


def checkpoint_path(store: Path, step: int | None) -> Path:
    """The committed checkpoint ``step`` of ``store`` (default: the one ``latest`` names)."""
    if step is not None and step < 0:
        raise UsageError(f"--step must be >= 0; got {step}")
    if step is None:
        latest = read_latest(store)
        if latest is None:
            raise StorageError(f"store {store} has no committed checkpoint")
        return store / committed_name(latest)
    path = store / committed_name(step)
    if not path.is_dir():
        have = ", ".join(str(e.step) for e in committed(store)) or "none"
        raise UsageError(f"store {store} has no committed checkpoint {step} (it has: {have})")
    return path


def reason(exc: Exception, path: Path, backend: ShardBackend | None = None) -> str:
    """``exc``'s message without the leading name of checkpoint ``path``'s main file (read
    through ``backend``; default: its store's) or of ``path`` (the checkpoint is named beside
    it)."""
    index = _backend_of(path, backend).index_path(path)
    return str(exc).removeprefix(f"{index}: ").removeprefix(f"{path}: ")


def stored(m: Manifest) -> list[ArtifactRecord]:
    """The artifacts of ``m`` that have data in the checkpoint (not ephemeral)."""
    return [a for a in m.artifacts if a.cls is not ArtifactClass.EPHEMERAL]


# --- the store's backend and its manifests ----------------------------------------------------


def _recorded_backend(store: Path) -> str:
    """The name of the storage backend ``store`` records (``hdf5`` when none)."""
    meta = read_meta(store)
    return meta.backend if meta is not None else DEFAULT_BACKEND


def store_backend(store: Path) -> ShardBackend:
    """The storage backend ``store`` records in its ``store.json`` (``hdf5`` when it records
    none or has no ``store.json``); a :class:`StorageError` naming the store and the backend
    when this process has none of that name, or when ``store.json`` is not valid."""
    return parse_backend_name(_recorded_backend(store), store)


def _backend_of(ckpt: Path, backend: ShardBackend | None) -> ShardBackend:
    """``backend``, else the backend of the store that holds checkpoint directory ``ckpt``."""
    return backend if backend is not None else store_backend(ckpt.parent)


def read_manifest_bytes(ckpt: Path, backend: ShardBackend | None = None) -> bytes:
    """The manifest text stored in checkpoint directory ``ckpt``, as stored (fields this
    version does not know included; format checked, not parsed), read through ``backend``
    (default: the backend of the store holding ``ckpt``); a :class:`ManifestError` naming the
    file when it cannot be read."""
    return _backend_of(ckpt, backend).read_index(ckpt)


def read_manifest(ckpt: Path, backend: ShardBackend | None = None) -> Manifest:
    """The validated manifest of checkpoint directory ``ckpt`` (serial read; ``backend`` as
    for :func:`read_manifest_bytes`); a :class:`ManifestError` naming the file if it is not
    one."""
    b = _backend_of(ckpt, backend)
    where = str(b.index_path(ckpt))
    return parse_loadable_manifest(b.read_index(ckpt), where)


# --- verify -----------------------------------------------------------------------------------


class CheckStatus(enum.Enum):
    OK = "ok"
    DAMAGED = "DAMAGED"  # readable manifest; some tensor, shard or file is not as it says
    INVALID = "INVALID"  # no valid manifest: nothing in it can be trusted
    INCOMPLETE = "INCOMPLETE"  # a partial (uncommitted) checkpoint directory


@dataclass(frozen=True, slots=True)
class CheckpointCheck:
    """The verdict on one checkpoint directory: ``problems`` are one line each (for DAMAGED,
    ``<file>: tensor 't' shard 's': <what>``; for INVALID, why)."""

    path: Path
    status: CheckStatus
    problems: tuple[str, ...] = ()
    tensors: int = 0  # stored tensors (OK)
    data_bytes: int = 0  # bytes verified (OK)


def verify_checkpoints(
    store: Path, step: int | None = None, every: bool = False, *, timeout_s: float = 300.0
) -> list[CheckpointCheck]:
    """Verify checkpoint ``step`` of ``store`` (default: the latest), or with ``every`` all of
    its committed checkpoints, incomplete ones reported as such; one verdict per checkpoint."""
    store_backend(store)  # a store this process cannot read is one error, before any verdict
    if not every:
        return [verify_isolated(checkpoint_path(store, step), timeout_s=timeout_s)]
    entries = list_checkpoints(store)
    out = [verify_isolated(e.path, timeout_s=timeout_s) for e in entries if e.committed]
    out += [
        CheckpointCheck(e.path, CheckStatus.INCOMPLETE, (INCOMPLETE_NOTE,))
        for e in entries
        if not e.committed
    ]
    return out


def _child(ckpt: Path, start: int, fd: int, backend: ShardBackend) -> None:  # pragma: no cover
    """The verification child (it runs in the child: no coverage): its findings as JSON lines
    on ``fd``, from item ``start``."""

    def emit(*msg: Any) -> None:
        os.write(fd, (json.dumps(msg) + "\n").encode())

    try:
        manifest = read_manifest(ckpt, backend)
    except ManifestError as exc:
        emit("invalid", reason(exc, ckpt, backend))
        return
    items = backend.verify_items(ckpt, manifest)
    emit("manifest", len(items), len(stored(manifest)), manifest.data_bytes)
    with backend.open_verifier(ckpt, manifest) as v:
        for k in range(start, len(items)):
            emit("at", k)
            err = v.check(items[k])
            if err is not None:
                emit("damage", k, str(err))
    emit("done")


def _in_mpi() -> bool:
    """Whether this process has initialised MPI (never initialising it)."""
    from dtm_mpi.comm.abort import mpi_world

    return mpi_world() is not None


def _fork_child(ckpt: Path, start: int, r: int, w: int, backend: ShardBackend) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (the child)
        code = 0
        try:
            os.close(r)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)  # a crash report of the format's library is not ours to print
            faulthandler.disable()  # (it may write to a copy of stderr)
            faulthandler.cancel_dump_traceback_later()
            _child(ckpt, start, w, backend)
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    return pid


def _spawn_child(
    ckpt: Path, start: int, w: int, errors: str, backend: ShardBackend, name: str
) -> int:
    """``python -m dtm_mpi.io.tools CKPT START FD NAME MODULE`` with MPI off and stderr in the
    file ``errors`` (no Python runs in the child before the new interpreter: safe in an MPI
    process). The child imports MODULE, the one defining ``backend``'s class (which registers
    it), and reads through the backend registered as NAME."""
    import dtm_mpi

    os.set_inheritable(w, True)
    env = dict(os.environ)
    env["MPI4PY_RC_INITIALIZE"] = "0"  # the child reads files serially: no MPI
    root = str(Path(dtm_mpi.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        [root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    module = type(backend).__module__
    argv = [sys.executable, "-m", "dtm_mpi.io.tools", str(ckpt), str(start), str(w), name, module]
    aside = [(os.POSIX_SPAWN_OPEN, 2, errors, os.O_WRONLY | os.O_TRUNC, 0)]
    return os.posix_spawn(sys.executable, argv, env, file_actions=aside)


def _run_child(
    ckpt: Path,
    start: int,
    timeout_s: float,
    on: Callable[[list[Any]], None],
    backend: ShardBackend,
    name: str,
) -> str | None:
    """Run :func:`_child` in a child process, passing each message to ``on``; returns None
    when it finished, else how it ended (a signal, an exit code, or silence for
    ``timeout_s``). A fork, except where this process has initialised MPI (forking an MPI
    process is unsafe): then a new interpreter, which never initialises MPI. ``backend``
    reads the checkpoint (registered as ``name``: how the new interpreter finds it)."""
    errors = None
    r, w = os.pipe()
    try:
        if _in_mpi():
            fd, errors = tempfile.mkstemp(prefix="dtm-verify-", suffix=".err")
            os.close(fd)
            pid = _spawn_child(ckpt, start, w, errors, backend, name)
        else:
            pid = _fork_child(ckpt, start, r, w, backend)
    except OSError:
        os.close(r)
        os.close(w)
        raise
    os.close(w)
    try:
        return _watch_child(pid, r, timeout_s, on, errors, backend.format_name)
    finally:
        if errors is not None:
            with suppress(OSError):
                os.unlink(errors)


def _watch_child(
    pid: int,
    r: int,
    timeout_s: float,
    on: Callable[[list[Any]], None],
    errors: str | None,
    format_name: str,
) -> str | None:
    """Read the child's messages from ``r`` until it finishes, crashes (reported as a crash
    of the ``format_name`` library) or falls silent."""
    buf, done, ended = b"", False, None
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                ended = f"no progress within {timeout_s:g} s"
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([r], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            deadline = time.monotonic() + timeout_s
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                done = done or msg[0] == "done"
                on(msg)
    finally:
        os.close(r)
        reaped, status = os.waitpid(pid, os.WNOHANG)
        if reaped == 0:  # still running: left by an exception here (Ctrl-C) or at the deadline
            if ended is None and not done:
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)  # it exits: killed, or done and closing
    if ended is None and not done:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            ended = f"the {format_name} library crashed ({signal.Signals(sig).name})"
        else:
            ended = f"the verification ended early (exit code {os.waitstatus_to_exitcode(status)})"
            said = _last_line(errors)
            if said:  # a spawned child that could not run (its interpreter's last words)
                ended += f": {said}"
    return ended


def _last_line(path: str | None) -> str:
    """The last non-empty line of the file ``path`` ('' if none or unreadable)."""
    if path is None:
        return ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def verify_isolated(ckpt: Path, *, timeout_s: float = 300.0) -> CheckpointCheck:
    """Verify checkpoint directory ``ckpt`` through its store's backend (every item of its
    ``verify_items``), in a child process: if the format's library (HDF5) crashes or makes no
    progress for ``timeout_s`` seconds while reading a file (damaged metadata can do both),
    the tensor, shard and file it was reading are reported damaged, and the rest is checked by
    a new child. Without ``os.fork`` (not POSIX), in this process."""
    name = _recorded_backend(ckpt.parent)
    backend = parse_backend_name(name, ckpt.parent)
    if not hasattr(os, "fork"):
        return _verify_here(ckpt, backend)
    state: dict[str, Any] = {"items": None, "at": -1, "invalid": None, "stored": 0, "bytes": 0}
    problems: list[str] = []

    def on(msg: list[Any]) -> None:
        kind = msg[0]
        if kind == "invalid":
            state["invalid"] = msg[1]
        elif kind == "manifest":
            state["items"], state["stored"], state["bytes"] = msg[1], msg[2], msg[3]
        elif kind == "at":
            state["at"] = msg[1]
        elif kind == "damage":
            problems.append(msg[2])

    start = 0
    while True:
        state["at"] = start - 1
        ended = _run_child(ckpt, start, timeout_s, on, backend, name)
        if ended is None:
            break
        if state["items"] is None:  # before the manifest was read: the main file is damaged
            return CheckpointCheck(
                ckpt,
                CheckStatus.INVALID,
                (f"{backend.index_path(ckpt).name} cannot be read: {ended} reading it",),
            )
        k = state["at"]
        if k < start:  # between items (opening nothing): nothing to name; stop here
            problems.append(f"{ckpt}: {ended}")
            break
        items = backend.verify_items(ckpt, read_manifest(ckpt, backend))  # the child parsed it
        item = items[k]
        problems.append(
            str(
                IntegrityError(
                    f"{ended} reading it: its {backend.format_name} metadata is damaged",
                    tensor=item.tensor,
                    shard=item.shard,
                    file=str(item.file),
                )
            )
        )
        start = k + 1
        if start >= state["items"]:
            break
    if state["invalid"] is not None:
        return CheckpointCheck(ckpt, CheckStatus.INVALID, (state["invalid"],))
    if problems:
        return CheckpointCheck(ckpt, CheckStatus.DAMAGED, tuple(problems))
    return CheckpointCheck(ckpt, CheckStatus.OK, (), state["stored"], state["bytes"])


def _verify_here(ckpt: Path, backend: ShardBackend) -> CheckpointCheck:
    try:
        m = read_manifest(ckpt, backend)
    except ManifestError as exc:
        return CheckpointCheck(ckpt, CheckStatus.INVALID, (reason(exc, ckpt, backend),))
    with backend.open_verifier(ckpt, m) as v:
        found = (v.check(item) for item in backend.verify_items(ckpt, m))
        damaged = [e for e in found if e is not None]
    if damaged:
        return CheckpointCheck(ckpt, CheckStatus.DAMAGED, tuple(str(e) for e in damaged))
    return CheckpointCheck(ckpt, CheckStatus.OK, (), len(stored(m)), m.data_bytes)


# --- remove -----------------------------------------------------------------------------------


def remove_incomplete(store: Path) -> list[Path]:
    """Remove every partial (``*.partial-*``) checkpoint and every retired one of ``store``;
    returns what was removed."""
    backend = store_backend(store)
    gone = [e.path for e in list_checkpoints(store) if not e.committed] + retired_files(store)
    for p in gone:
        backend.remove(p)
    if gone:
        fsync_path(store)
    return gone


def remove_checkpoint(store: Path, step: int, force: bool = False) -> tuple[Path, str | None]:
    """Remove committed checkpoint ``step`` of ``store``; the one ``latest`` names only with
    ``force`` (``latest`` then moves to the newest remaining one first: at every moment it names
    a committed checkpoint). Returns the removed path and, for the latest, where ``latest``
    points now."""
    path = checkpoint_path(store, step)
    backend = store_backend(store)
    after = None
    if step == read_latest(store):
        rest = [e.step for e in committed(store) if e.step != step]
        after = f"'latest' names checkpoint {max(rest)}" if rest else "no checkpoint remains"
        if not force:
            raise UsageError(
                f"store {store}: checkpoint {step} is the latest one; add --force to remove it (then {after})"
            )
        if rest:
            write_latest(store, max(rest))
        else:
            (store / "latest").unlink(missing_ok=True)
    gone = store / f".deleting-{path.name}-{secrets.token_hex(4)}"
    os.replace(path, gone)  # out of the checkpoint namespace at once, then deleted
    fsync_path(store)
    backend.remove(gone)
    fsync_path(store)
    return path, after


# --- read one tensor --------------------------------------------------------------------------


def _artifact(m: Manifest, name: str, path: Path) -> ArtifactRecord:
    if name not in m.names:
        raise UsageError(f"{path}: no tensor {name!r} (it has: {', '.join(m.names) or 'none'})")
    a = m.artifact(name)
    if a.cls is ArtifactClass.EPHEMERAL or a.dataset is None:
        raise UsageError(f"{path}: tensor {name!r} is ephemeral: recorded, never stored")
    return a


def read_tensor(
    path: Path, name: str, manifest: Manifest | None = None, backend: ShardBackend | None = None
) -> np.ndarray:
    """The global value of tensor ``name`` of checkpoint ``path`` (serial), every chunk read
    from its data file (through ``backend``; default: its store's) and checked against the
    manifest's content hash; raises :class:`IntegrityError` naming tensor, shard and file on a
    mismatch or a missing file. bf16 comes back as stored (float32)."""
    backend = _backend_of(path, backend)
    a = _artifact(manifest if manifest is not None else read_manifest(path, backend), name, path)
    out = np.empty(a.shape, dtype=np_dtype(a.dtype))
    with backend.open_reader(path) as files:
        for s in a.shards:
            for c in range(len(s.chunks)):
                out[s.chunk_region(c)] = files.read_verified(a, s, c)
    return out


class TensorRows:
    """Slices of a stored 1-D tensor of checkpoint ``path`` (``view[a:b]``), read through the
    store's backend chunk by chunk, each chunk checked against its content hash as it is read
    (an :class:`IntegrityError` naming tensor, shard and file), the last ``cache`` chunks
    kept: what a token loader reads windows of, without loading the whole tensor."""

    def __init__(self, path: Path, name: str, cache: int = 16) -> None:
        backend = _backend_of(path, None)
        self.manifest = read_manifest(path, backend)
        self.artifact = a = _artifact(self.manifest, name, path)
        if len(a.shape) != 1:
            raise UsageError(f"{path}: tensor {name!r} is {list(a.shape)}, not 1-D")
        self._reader = backend.open_reader(path)
        self._reader.__enter__()
        self._chunks: dict[tuple[int, int], np.ndarray] = {}
        self._cache = cache
        # (global start, stop, shard, chunk) of every chunk, in order
        self._spans = [
            (reg[0].start, reg[0].stop, s, c)
            for s in a.shards
            for c in range(len(s.chunks))
            for reg in (s.chunk_region(c),)
        ]
        self._starts = [sp[0] for sp in self._spans]
        self.shape = a.shape
        self.dtype = np_dtype(a.dtype)

    def _chunk(self, k: int) -> np.ndarray:
        _, _, s, c = self._spans[k]
        key = (s.index, c)
        got = self._chunks.pop(key, None)
        if got is None:
            got = self._reader.read_verified(self.artifact, s, c)
            while len(self._chunks) >= self._cache:
                self._chunks.pop(next(iter(self._chunks)))
        self._chunks[key] = got  # (most recent last)
        return got

    def __getitem__(self, sl: slice) -> np.ndarray:
        import bisect

        start, stop, step = sl.indices(self.shape[0])
        if step != 1:
            raise UsageError("TensorRows reads contiguous slices")
        parts = []
        k = max(0, bisect.bisect_right(self._starts, start) - 1)
        while start < stop and k < len(self._spans):
            lo, hi, _, _ = self._spans[k]
            if hi > start:
                block = self._chunk(k)
                parts.append(block[start - lo : min(stop, hi) - lo])
                start = min(stop, hi)
            k += 1
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def close(self) -> None:
        self._reader.close()


# --- put one tensor ---------------------------------------------------------------------------

_NPY_KINDS: dict[tuple[str, int], str] = {
    ("f", 2): "f16",
    ("f", 4): "f32",
    ("f", 8): "f64",
    ("i", 1): "i8",
    ("i", 4): "i32",
    ("i", 8): "i64",
    ("u", 1): "u8",
    ("b", 1): "bool",
    ("u", 2): "bf16",
}
"""numpy (kind, itemsize) -> dtm dtype; uint16 holds the raw bits of bfloat16."""


def dtm_dtype(value: np.ndarray, where: str) -> DType:
    """The dtm dtype a numpy array of ``value``'s dtype stores as (uint16: bf16 bits)."""
    dt = value.dtype
    name = (
        _NPY_KINDS.get((dt.kind, dt.itemsize))
        if dt.fields is None and dt.subdtype is None
        else None
    )
    if name is None:
        allowed = (
            "float16, float32, float64, int8, int32, int64, uint8, bool, uint16 (the bits of bf16)"
        )
        raise UsageError(f"{where}: dtype {dt} is not a dtm dtype; use one of {allowed}")
    return DType(name)


def bf16_bits(value: np.ndarray) -> np.ndarray:
    """bf16 values as the runtime holds them (binary32) as their 16 bits (uint16): what a put
    takes and other tools' files store (the inverse of :func:`_as_block`'s conversion)."""
    bits: np.ndarray = (np.ascontiguousarray(value, np.float32).view(np.uint32) >> 16).astype(
        np.uint16
    )
    return bits


def _as_block(value: np.ndarray, dtype: DType) -> np.ndarray:
    """``value`` in the array type a save of a ``dtype`` tensor takes (native byte order,
    C order); bf16 bits (uint16) become the binary32 values the runtime holds bf16 in."""
    want = np_dtype(dtype)
    if dtype is DType.BF16 and want == np.dtype(np.float32):
        bits = np.array(value, dtype=np.uint32, order="C")
        bits <<= np.uint32(16)  # in place: a 0-d array stays an array
        return bits.view(np.float32)
    return np.array(value, dtype=want, order="C")  # native order; 0-d stays 0-d


@dataclass(frozen=True, slots=True)
class PutResult:
    path: Path  # the new checkpoint
    step: int
    base: int | None  # the step it copies, None for a store's first checkpoint
    tensors: int
    replaced: bool  # NAME was in the base checkpoint
    dtype: DType | None  # None: a put that only left tensors out
    shape: tuple[int, ...]
    cls: ArtifactClass | None
    rebuilt: tuple[str, ...]  # derived tensors recomputed from the new value


def _depth(m: Manifest, name: str, ancestor: str) -> int:
    """How many parent links lead from artifact ``name`` of ``m`` up to ``ancestor`` (0: it
    does not derive from it)."""
    seen: set[str] = set()
    a, depth = m.artifact(name), 0
    while a.parent is not None and a.parent not in seen:
        depth += 1
        if a.parent == ancestor:
            return depth
        seen.add(a.parent)
        a = m.artifact(a.parent)
    return 0


def _put_class(
    name: str,
    cls: str | None,
    parent: str | None,
    rebuild: str | None,
    replaced: Any,
    kept: list[Any],
) -> tuple[ArtifactClass, str | None, str | None]:
    """The class of tensor ``name`` a put stores (with its parent and rebuild rule): as given,
    else the ``replaced`` tensor's (when it was stored), else primary; a parent must be
    another stored tensor of the checkpoint (``kept``: its other tensors)."""
    if cls is not None:
        kind = ArtifactClass(cls.upper())
    elif parent is not None or rebuild is not None:
        kind = ArtifactClass.DERIVED
    elif replaced is not None and replaced.cls is not ArtifactClass.EPHEMERAL:
        kind, parent, rebuild = replaced.cls, replaced.parent, replaced.rebuild
    else:
        kind = ArtifactClass.PRIMARY
    if kind is ArtifactClass.DERIVED and (parent is None or rebuild is None):
        raise UsageError(f"tensor {name!r}: a derived artifact needs --parent and --rebuild")
    if kind is ArtifactClass.PRIMARY and (parent is not None or rebuild is not None):
        raise UsageError(f"tensor {name!r}: --parent and --rebuild are for --class derived only")
    stored_names = {a.name for a in kept if a.cls is not ArtifactClass.EPHEMERAL} | {name}
    if parent is not None and (parent == name or parent not in stored_names):
        raise UsageError(
            f"tensor {name!r}: parent {parent!r} is not another stored tensor of the checkpoint (stored: {', '.join(sorted(stored_names - {name})) or 'none'})"
        )
    return kind, parent, rebuild


def put_tensor(
    store: Path,
    comm: Any,
    name: str,
    value: np.ndarray,
    *,
    cls: str | None = None,
    parent: str | None = None,
    rebuild: str | None = None,
    step: int | None = None,
    where: str = "input",
) -> PutResult:
    """Save a new checkpoint of ``store``: the latest one with tensor ``name`` set to ``value``
    (added or replaced; copy-on-write: the old checkpoint stays), its derived tensors rebuilt
    from it, as step ``step`` (default: one past the newest committed one). ``cls``
    (``primary``/``derived``) defaults to the replaced tensor's, else primary. ``comm``: a
    one-process communicator (the self communicator); the store's quota and retention apply
    as for any save."""
    return put_tensors(
        store,
        comm,
        {name: value},
        cls=cls,
        parent=parent,
        rebuild=rebuild,
        step=step,
        where={name: where},
    )


def put_tensors(
    store: Path,
    comm: Any,
    values: Mapping[str, np.ndarray],
    *,
    cls: str | None = None,
    parent: str | None = None,
    rebuild: str | None = None,
    step: int | None = None,
    where: Mapping[str, str] | None = None,
    drop: Sequence[str] = (),
    states: Mapping[str, Lifecycle] | None = None,
) -> PutResult:
    """:func:`put_tensor` for several tensors at once, in one new checkpoint (``cls``,
    ``parent`` and ``rebuild`` only with one tensor; several keep each replaced tensor's class,
    else primary). ``where`` names each value's origin for errors; ``drop``: tensors of the
    latest checkpoint the new one leaves out (not the parent of one it keeps); ``states``:
    lifecycle moves of kept tensors (``DEPRECATED``; checked against the lifecycle's
    transitions), the others keep their state and new values are ACTIVE. The result
    describes the first tensor of ``values``; ``rebuilt`` lists every derived tensor
    recomputed."""
    from dtm_mpi.io.checkpoint import CheckpointStore, rebuild_value
    from dtm_mpi.io.ckpt_plan import CHUNK_BYTES, TensorSpec
    from dtm_mpi.ir.types import Layout, TensorType
    from dtm_mpi.sharding.mesh import MeshShape

    if not values and not drop and not states:
        raise UsageError("put_tensors: no tensors given")
    if len(values) > 1 and (cls, parent, rebuild) != (None, None, None):
        raise UsageError("put_tensors: a class, parent or rebuild rule is for one tensor")
    if step is not None and step < 0:
        raise UsageError(f"--step must be >= 0; got {step}")
    if int(comm.Get_size()) != 1:
        raise UsageError("put_tensor: the communicator must hold one process")
    dtypes = {n: dtm_dtype(v, (where or {}).get(n, "input")) for n, v in values.items()}
    newest = max((e.step for e in committed(store)), default=-1)
    step = step if step is not None else newest + 1
    if step <= newest:
        raise UsageError(
            f"store {store}: --step {step} must be newer than every committed checkpoint (the newest is {newest}); a put never replaces a checkpoint"
        )
    base = read_latest(store)
    old = (
        read_manifest(store / committed_name(base), store_backend(store))
        if base is not None
        else None
    )
    gone = set(drop)
    kept = (
        [a for a in old.artifacts if a.name not in values and a.name not in gone]
        if old is not None
        else []
    )
    moved = {a.name: transition(a, states[a.name]) for a in kept if states and a.name in states}
    unknown = sorted(set(states or ()) - {a.name for a in kept})
    if unknown:
        have = ", ".join(sorted(a.name for a in kept)) or "none"
        raise UsageError(f"store {store}: no tensor {unknown[0]!r} to move (it has: {have})")
    kept = [moved.get(a.name, a) for a in kept]
    held = {a.name: a for a in kept}
    orphans = [a.name for a in kept if a.parent in gone]
    if orphans:
        raise UsageError(f"cannot leave out the parent of the kept derived tensor {orphans[0]!r}")
    new: dict[str, tuple[TensorSpec, np.ndarray]] = {}
    for name, value in values.items():
        replaced = old.artifact(name) if old is not None and name in old.names else None
        kind, par, rule = _put_class(name, cls, parent, rebuild, replaced, kept)
        t = TensorType(dtypes[name], tuple(value.shape), Layout.replicated(value.ndim))
        new[name] = (TensorSpec(name, t, kind, par, rule), _as_block(value, dtypes[name]))

    mesh = MeshShape((("x", 1),))
    rebuilt: list[str] = []
    specs: list[tuple[TensorSpec, np.ndarray | None]] = []
    ckpt = CheckpointStore(
        store, comm, chunk_bytes=old.chunk_bytes if old is not None else CHUNK_BYTES
    )
    try:
        targets = [
            (a.name, TensorType(a.dtype, a.shape, Layout.replicated(len(a.shape))))
            for a in kept
            if a.cls is not ArtifactClass.EPHEMERAL
        ]
        current: dict[str, np.ndarray] = {}
        if targets:
            assert base is not None
            current = dict(ckpt.restore(mesh, targets, step=base).values)
        current.update({n: block for n, (_, block) in new.items()})
        if old is not None:  # derived from a new value, directly or not: recompute, parents first
            depth = {
                a.name: min((d for n in new if (d := _depth(old, a.name, n)) > 0), default=0)
                for a in old.artifacts
                if a.name not in new
            }
            for a in sorted((a for a in kept if depth[a.name] > 0), key=lambda a: depth[a.name]):
                assert a.parent is not None
                current[a.name] = rebuild_value(a, current[a.parent])
                rebuilt.append(a.name)
        for a in old.artifacts if old is not None else ():
            if a.name in gone:
                continue
            if a.name in new:
                specs.append(new[a.name])
                continue
            t = TensorType(a.dtype, a.shape, Layout.replicated(len(a.shape)))
            state = (
                Lifecycle.ACTIVE if a.name in rebuilt else held[a.name].state
            )  # (moved, or kept)
            spec = TensorSpec(a.name, t, a.cls, a.parent, a.rebuild, state=state)
            specs.append((spec, current.get(a.name)))
        specs += [new[n] for n in new if old is None or n not in old.names]
        path = ckpt.save(
            step, mesh, specs, module_hash=old.module_hash if old is not None else None
        )
    finally:
        ckpt.close()
    if not values:  # only left out tensors: the result describes the checkpoint
        return PutResult(path, step, base, len(specs), False, None, (), None, tuple(rebuilt))
    first = next(iter(values))
    spec = new[first][0]
    return PutResult(
        path,
        step,
        base,
        len(specs),
        old is not None and first in old.names,
        spec.type.dtype,
        spec.type.shape,
        spec.cls,
        tuple(rebuilt),
    )


def _spawned(argv: list[str]) -> None:  # pragma: no cover  (the spawned verification child)
    """``CKPT START FD NAME MODULE`` (see :func:`_spawn_child`)."""
    ckpt, start, fd, name, module = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    importlib.import_module(module)  # registers the backend (a no-op for dtm_mpi's own)
    _child(ckpt, start, fd, parse_backend_name(name, ckpt.parent))


if __name__ == "__main__":  # pragma: no cover  (the verification child of _run_child)
    faulthandler.disable()
    try:
        _spawned(sys.argv[1:])
    except BaseException as exc:  # its last words, for the parent's report (stderr: a file)
        with suppress(Exception):
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(3)
    os._exit(0)
