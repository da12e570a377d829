"""``dtm ckpt ...`` and ``dtm store ...``: serial tools over one checkpoint store directory.

``dtm ckpt ls | inspect | verify | rm`` look at and tidy checkpoint files; ``dtm store ls |
get | put`` read one tensor out of a checkpoint (every chunk verified) and write a new
checkpoint with one tensor added or replaced (copy-on-write: the old checkpoint stays as it
is). Everything here runs in one process: reads go through h5py serially, and ``store put``
saves through :class:`~dtm_mpi.io.checkpoint.CheckpointStore` on ``MPI.COMM_SELF``, so the
store's quota and retention apply as for any save.

Exit codes as for every ``dtm`` command: 0 success, 1 a failed check or a storage error
(damaged data, invalid manifest, quota), 2 bad usage (including a store directory, step or
tensor that does not exist).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtm_mpi.errors import (
    ManifestError,
    StorageError,
    UsageError,
    agreed,
)

if TYPE_CHECKING:
    import numpy as np

    from dtm_mpi.io.manifest import ArtifactRecord, Manifest
    from dtm_mpi.io.store import CheckpointEntry
    from dtm_mpi.ir.types import DType

__all__ = ["add_store_commands", "read_tensor"]

INCOMPLETE_NOTE = "a save in progress, cancelled or killed; not loadable"


# --- argument parsing -------------------------------------------------------------------------


def _step_arg(parser: argparse._ActionsContainer, default: str = "latest") -> None:
    parser.add_argument(
        "--step", type=int, default=None, metavar="N", help=f"checkpoint step (default: {default})"
    )


def add_store_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ckpt = sub.add_parser("ckpt", help="list, inspect, verify and remove checkpoints")
    parser_class = type(ckpt)  # the CLI's parser: errors are UsageError (exit 2)
    csub = ckpt.add_subparsers(dest="action", metavar="ACTION", parser_class=parser_class)
    csub.required = True

    ls = csub.add_parser("ls", help="the checkpoints of STORE, by step, and its settings")
    ls.add_argument("store", metavar="STORE")
    ls.set_defaults(func=_cmd_ckpt_ls)

    ins = csub.add_parser("inspect", help="the manifest of one checkpoint")
    ins.add_argument("store", metavar="STORE")
    _step_arg(ins)
    ins.add_argument("--json", action="store_true", help="print the manifest JSON")
    ins.set_defaults(func=_cmd_ckpt_inspect)

    ver = csub.add_parser("verify", help="re-read every chunk and compare its content hash")
    ver.add_argument("store", metavar="STORE")
    which = ver.add_mutually_exclusive_group()
    _step_arg(which)
    which.add_argument("--all", action="store_true",
                       help="every committed checkpoint (incomplete ones count as problems)")  # fmt: skip
    ver.set_defaults(func=_cmd_ckpt_verify)

    rm = csub.add_parser("rm", help="remove a checkpoint, or every incomplete (partial) one")
    rm.add_argument("store", metavar="STORE")
    what = rm.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, default=None, metavar="N", help="checkpoint step")
    what.add_argument("--partial", action="store_true",
                      help="every *.partial-* checkpoint (a save still running then fails at its commit)")  # fmt: skip
    rm.add_argument("--force", action="store_true",
                    help="also remove the checkpoint 'latest' names (latest moves to the newest remaining one)")  # fmt: skip
    rm.set_defaults(func=_cmd_ckpt_rm)

    store = sub.add_parser("store", help="read or write single tensors of a checkpoint store")
    ssub = store.add_subparsers(dest="action", metavar="ACTION", parser_class=parser_class)
    ssub.required = True

    sls = ssub.add_parser("ls", help="the tensors of one checkpoint")
    sls.add_argument("store", metavar="STORE")
    _step_arg(sls)
    sls.set_defaults(func=_cmd_store_ls)

    get = ssub.add_parser("get", help="write the global value of one tensor to a .npy file")
    get.add_argument("store", metavar="STORE")
    get.add_argument("name", metavar="NAME")
    get.add_argument("-o", "--output", required=True, metavar="FILE.npy", help="output file")
    _step_arg(get)
    get.set_defaults(func=_cmd_store_get)

    put = ssub.add_parser(
        "put", help="save a new checkpoint: the latest one with tensor NAME added or replaced"
    )
    put.add_argument("store", metavar="STORE")
    put.add_argument("name", metavar="NAME")
    put.add_argument("file", metavar="FILE.npy")
    put.add_argument("--class", dest="cls", choices=["primary", "derived"], default=None,
                     help="artifact class (default: the replaced tensor's, else primary)")  # fmt: skip
    put.add_argument("--parent", default=None, help="parent tensor of a derived artifact")
    put.add_argument("--rebuild", default=None,
                     help="rebuild instruction of a derived artifact (e.g. copy, cast:f16)")  # fmt: skip
    _step_arg(put, "one past the newest committed checkpoint; 0 for an empty store")
    put.set_defaults(func=_cmd_store_put)


# --- shared helpers ---------------------------------------------------------------------------


def _store_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise UsageError(f"store {text} {what}")
    return path


def _committed(store: Path) -> list[CheckpointEntry]:
    from dtm_mpi.io.store import list_checkpoints

    return [e for e in list_checkpoints(store) if e.committed]


def _check_step(step: int | None) -> None:
    if step is not None and step < 0:
        raise UsageError(f"--step must be >= 0; got {step}")


def _checkpoint_path(store: Path, step: int | None) -> Path:
    """The committed checkpoint ``step`` of ``store`` (default: the one ``latest`` names)."""
    from dtm_mpi.io.store import committed_name, read_latest

    _check_step(step)
    if step is None:
        latest = read_latest(store)
        if latest is None:
            raise StorageError(f"store {store} has no committed checkpoint")
        return store / committed_name(latest)
    path = store / committed_name(step)
    if not path.is_dir():
        have = ", ".join(str(e.step) for e in _committed(store)) or "none"
        raise UsageError(f"store {store} has no committed checkpoint {step} (it has: {have})")
    return path


def _reason(exc: Exception, path: Path) -> str:
    """``exc``'s message without the leading ``path: `` (the file is named beside it)."""
    from dtm_mpi.io.files import MAIN_FILE

    return str(exc).removeprefix(f"{path / MAIN_FILE}: ").removeprefix(f"{path}: ")


def _mesh_text(mesh: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh) or "-"


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """``rows`` (the first is the header) as aligned text lines; columns ``right`` right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]  # fmt: skip
        out.append("  ".join(cells).rstrip())
    return out


def _stored(m: Manifest) -> list[ArtifactRecord]:
    from dtm_mpi.io.manifest import ArtifactClass

    return [a for a in m.artifacts if a.cls is not ArtifactClass.EPHEMERAL]


# --- dtm ckpt ---------------------------------------------------------------------------------


def _cmd_ckpt_ls(args: argparse.Namespace) -> int:
    from dtm_mpi.io.files import read_manifest
    from dtm_mpi.io.store import disk_usage, legacy_files, list_checkpoints, read_latest, read_meta

    store = _store_dir(args.store)
    meta = read_meta(store)
    entries = list_checkpoints(store)
    quota = "none" if meta is None or meta.quota_bytes is None else f"{meta.quota_bytes} bytes"
    keep = "all" if meta is None or meta.keep_last is None else str(meta.keep_last)
    settings = "" if meta is not None else " (no store.json: defaults)"
    print(f"store {store}: quota {quota}, keep_last {keep}, {disk_usage(store)} bytes in use by {len(entries)} checkpoint(s){settings}")  # fmt: skip
    for p in legacy_files(store):
        print(f"{p.name}: a single-file checkpoint of format version 1, which this dtm_mpi does not read (not part of the store; it counts against the quota)")  # fmt: skip
    if not entries:
        print("no checkpoints")
        return 0
    latest = read_latest(store)  # what a restore loads: the pointer, else the newest
    rows = [["step", "status", "checkpoint", "bytes", "tensors", "data bytes", "mesh"]]
    notes: list[str] = []
    for e in entries:
        row = [str(e.step), "", e.path.name, str(e.nbytes), "-", "-", "-"]
        if not e.committed:
            row[1] = "INCOMPLETE"
            notes.append(f"{e.path.name}: INCOMPLETE: {INCOMPLETE_NOTE}")
        else:
            row[1] = "committed, latest" if e.step == latest else "committed"
            if e.step == latest and not e.latest:
                notes.append(f"{e.path.name}: latest because the 'latest' pointer is missing or names a missing file")  # fmt: skip
            try:
                m = read_manifest(e.path)
            except ManifestError as exc:
                row[1] = "INVALID"
                notes.append(f"{e.path.name}: INVALID: {_reason(exc, e.path)}")
            else:
                row[4:] = [str(len(_stored(m))), str(m.data_bytes), _mesh_text(m.mesh)]
        rows.append(row)
    for line in _table(rows, right=(0, 3, 4, 5)):
        print(line)
    for note in notes:
        print(note)
    from dtm_mpi.io.store import retired_files

    for p in retired_files(store):
        print(f"{p.name}: retired (by keep_last, a save that replaced its step, or dtm ckpt rm), not deleted yet; `dtm ckpt rm --partial` removes it")  # fmt: skip
    return 0


def _cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    from dtm_mpi.io.files import read_manifest

    path = _checkpoint_path(_store_dir(args.store), args.step)
    m = read_manifest(path)  # validated first: an invalid manifest is an error, also for --json
    doc = _stored_manifest(path)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    print(f"checkpoint {path}")
    print(f"  step          {m.step}")
    print(f"  mesh          {_mesh_text(m.mesh)}")
    print(f"  module hash   {m.module_hash or '-'}")
    print(f"  dtm version   {m.dtm_version or '-'}")
    print(f"  chunk bytes   {m.chunk_bytes} ({m.hash_algorithm} per chunk)")
    print(f"  merkle root   {m.merkle_root}")
    print(f"  manifest hash {doc['manifest_hash']}")
    print(f"  tensors       {len(m.artifacts)} ({len(_stored(m))} stored), {m.data_bytes} data bytes")  # fmt: skip
    files = sorted({sh.file for a in m.artifacts for sh in a.shards})
    span = "" if not files else f" ({files[0]})" if len(files) == 1 else f" ({files[0]} .. {files[-1]})"  # fmt: skip
    print(f"  data files    {len(files)}{span}")
    rows = [["name", "class", "state", "dtype", "shape", "layout", "shards", "bytes", "merkle", "from"]]  # fmt: skip
    for a in m.artifacts:
        origin = f"{a.parent} ({a.rebuild})" if a.parent is not None else ""
        rows.append([
            a.name, a.cls.value.lower(), a.state.value.lower(), a.dtype.value,
            _shape_text(a.shape), a.layout.dims_text(), str(len(a.shards)),
            str(sum(s.nbytes for s in a.shards)), a.merkle_root[:12] if a.dataset is not None else "-", origin,
        ])  # fmt: skip
    for line in _table(rows, right=(6, 7)):
        print(line)
    return 0


def _stored_manifest(path: Path) -> dict[str, Any]:
    """The manifest JSON as stored in checkpoint ``path`` (fields this version does not know
    included)."""
    from dtm_mpi.io.files import read_manifest_bytes

    doc: dict[str, Any] = json.loads(read_manifest_bytes(path))
    return doc


def _cmd_ckpt_verify(args: argparse.Namespace) -> int:
    from dtm_mpi.io.files import read_manifest, verify_checkpoint
    from dtm_mpi.io.store import list_checkpoints

    store = _store_dir(args.store)
    if args.all:
        entries = list_checkpoints(store)
        paths = [e.path for e in entries if e.committed]
        incomplete = [e.path for e in entries if not e.committed]
        if not entries:
            print(f"store {store}: no checkpoints")
            return 0
    else:
        paths, incomplete = [_checkpoint_path(store, args.step)], []
    problems = 0
    for path in paths:
        try:
            damaged = verify_checkpoint(path)
        except ManifestError as exc:
            print(f"INVALID {path}: {_reason(exc, path)}")
            problems += 1
            continue
        except OSError as exc:  # HDF5 could not read a dataset
            print(f"UNREADABLE {path}: {exc}")
            problems += 1
            continue
        for err in damaged:
            print(f"DAMAGED {err}")
        problems += len(damaged)
        if not damaged:
            m = read_manifest(path)
            print(f"ok {path}: {len(_stored(m))} tensors, {m.data_bytes} bytes verified")
    for path in incomplete:
        print(f"INCOMPLETE {path}: {INCOMPLETE_NOTE}")
        problems += 1
    if problems:
        checked = len(paths) + len(incomplete)
        print(f"dtm ckpt verify: {problems} problem(s) in {checked} checkpoint(s) of {store}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _cmd_ckpt_rm(args: argparse.Namespace) -> int:
    from dtm_mpi.io.store import (
        fsync_path,
        list_checkpoints,
        read_latest,
        remove_path,
        write_latest,
    )

    store = _store_dir(args.store)
    if args.partial:
        from dtm_mpi.io.store import retired_files

        partial = [e.path for e in list_checkpoints(store) if not e.committed]
        partial += retired_files(store)
        for p in partial:
            remove_path(p)
            print(f"removed {p}")
        if partial:
            fsync_path(store)
        else:
            print(f"store {store}: no incomplete checkpoints")
        return 0
    path = _checkpoint_path(store, args.step)
    latest = read_latest(store)
    if args.step == latest:
        rest = [e.step for e in _committed(store) if e.step != args.step]
        after = f"'latest' names checkpoint {max(rest)}" if rest else "no checkpoint remains"
        if not args.force:
            raise UsageError(f"store {store}: checkpoint {args.step} is the latest one; add --force to remove it (then {after})")  # fmt: skip
        # move the pointer first: at every moment 'latest' names a committed checkpoint
        if rest:
            write_latest(store, max(rest))
        else:
            (store / "latest").unlink(missing_ok=True)
        _remove_checkpoint(store, path)
        print(f"removed {path}; {after}")
        return 0
    _remove_checkpoint(store, path)
    print(f"removed {path}")
    return 0


def _remove_checkpoint(store: Path, path: Path) -> None:
    """Retire committed checkpoint ``path`` atomically (rename out of the checkpoint
    namespace, fsync), then delete it: an interrupted removal leaves a ``.deleting-`` entry,
    never a half-deleted checkpoint under its committed name."""
    import secrets

    from dtm_mpi.io.store import fsync_path, remove_path

    gone = store / f".deleting-{path.name}-{secrets.token_hex(4)}"
    os.replace(path, gone)
    fsync_path(store)
    remove_path(gone)
    fsync_path(store)


# --- dtm store: reading -----------------------------------------------------------------------


def _artifact(m: Manifest, name: str, path: Path) -> ArtifactRecord:
    from dtm_mpi.io.manifest import ArtifactClass

    if name not in m.names:
        raise UsageError(f"{path}: no tensor {name!r} (it has: {', '.join(m.names) or 'none'})")
    a = m.artifact(name)
    if a.cls is ArtifactClass.EPHEMERAL or a.dataset is None:
        raise UsageError(f"{path}: tensor {name!r} is ephemeral: recorded, never stored")
    return a


def read_tensor(path: Path, name: str, manifest: Manifest | None = None) -> np.ndarray:
    """The global value of tensor ``name`` of checkpoint ``path`` (serial), every chunk read
    from its data file and checked against the manifest's content hash; raises
    :class:`IntegrityError` naming tensor, shard and file on a mismatch or a missing file.
    bf16 comes back as stored (float32)."""
    import numpy as np

    from dtm_mpi.io.files import ShardFiles, read_manifest
    from dtm_mpi.ir.ops._common import np_dtype

    a = _artifact(manifest if manifest is not None else read_manifest(path), name, path)
    out = np.empty(a.shape, dtype=np_dtype(a.dtype))
    with ShardFiles(path) as files:
        for s in a.shards:
            for c in range(len(s.chunks)):
                out[s.chunk_region(c)] = files.read_verified(a, s, c)
    return out


def _cmd_store_ls(args: argparse.Namespace) -> int:
    from dtm_mpi.io.files import read_manifest

    path = _checkpoint_path(_store_dir(args.store), args.step)
    m = read_manifest(path)
    print(f"checkpoint {path} (step {m.step}): {len(m.artifacts)} tensor(s)")
    rows = [["name", "class", "dtype", "shape", "bytes", "from"]]
    for a in m.artifacts:
        origin = f"{a.parent} ({a.rebuild})" if a.parent is not None else ""
        stored = str(sum(s.nbytes for s in a.shards)) if a.dataset is not None else "-"
        rows.append([a.name, a.cls.value.lower(), a.dtype.value, _shape_text(a.shape), stored, origin])  # fmt: skip
    for line in _table(rows, right=(4,)):
        print(line)
    return 0


def _cmd_store_get(args: argparse.Namespace) -> int:
    from dtm_mpi.io.arrays import check_output_path, save_npy
    from dtm_mpi.io.files import read_manifest
    from dtm_mpi.ir.types import DType

    target = check_output_path(args.output, ".npy")
    path = _checkpoint_path(_store_dir(args.store), args.step)
    m = read_manifest(path)
    value = read_tensor(path, args.name, m)
    save_npy(str(target), value)
    note = ""
    if m.artifact(args.name).dtype is DType.BF16:
        how = "its raw 16 bits" if value.dtype.kind == "u" else "binary32 values"
        note = f"; bf16 is stored as {value.dtype} ({how}) and written as {value.dtype}"
    print(f"wrote {target}: tensor {args.name!r} of step {m.step}, {value.dtype}{_shape_text(value.shape)}, every chunk verified{note}")  # fmt: skip
    return 0


# --- dtm store put ----------------------------------------------------------------------------

_NPY_KINDS: dict[tuple[str, int], str] = {
    ("f", 2): "f16", ("f", 4): "f32", ("f", 8): "f64", ("i", 1): "i8", ("i", 4): "i32",
    ("i", 8): "i64", ("u", 1): "u8", ("b", 1): "bool", ("u", 2): "bf16",
}  # fmt: skip
"""numpy (kind, itemsize) -> dtm dtype; uint16 holds the raw bits of bfloat16."""


def _load_npy(text: str) -> np.ndarray:
    """The array in the ``.npy`` file ``text`` (read as ``dtm run -i`` reads inputs)."""
    from dtm_mpi.io.arrays import load_arrays

    if Path(text).suffix.lower() != ".npy":
        raise UsageError(f"input {text}: use a .npy file")
    (value,) = load_arrays([text]).values()
    return value


def _dtm_dtype(value: np.ndarray, where: str) -> DType:
    from dtm_mpi.ir.types import DType

    dt = value.dtype
    name = _NPY_KINDS.get((dt.kind, dt.itemsize)) if dt.fields is None and dt.subdtype is None else None  # fmt: skip
    if name is None:
        allowed = "float16, float32, float64, int8, int32, int64, uint8, bool, uint16 (the bits of bf16)"  # fmt: skip
        raise UsageError(f"{where}: dtype {dt} is not a dtm dtype; use one of {allowed}")
    return DType(name)


def _as_block(value: np.ndarray, dtype: DType) -> np.ndarray:
    """``value`` in the array type a save of a ``dtype`` tensor takes (native byte order,
    C order); bf16 bits (uint16) become the binary32 values the runtime holds bf16 in."""
    import numpy as np

    from dtm_mpi.ir.ops._common import np_dtype
    from dtm_mpi.ir.types import DType

    want = np_dtype(dtype)
    if dtype is DType.BF16 and want == np.dtype(np.float32):
        bits = np.array(value, dtype=np.uint32, order="C")
        bits <<= np.uint32(16)  # in place: a 0-d array stays an array
        return bits.view(np.float32)
    return np.array(value, dtype=want, order="C")  # native order; 0-d stays 0-d


def _cmd_store_put(args: argparse.Namespace) -> int:
    from dtm_mpi.io.files import read_manifest
    from dtm_mpi.io.manifest import ArtifactClass
    from dtm_mpi.io.plan import CHUNK_BYTES, TensorSpec
    from dtm_mpi.io.store import committed_name, read_latest
    from dtm_mpi.ir.types import Layout, TensorType
    from dtm_mpi.sharding.mesh import MeshShape

    store = _store_dir(args.store)
    _check_step(args.step)
    value = _load_npy(args.file)
    dtype = _dtm_dtype(value, args.file)
    steps = [e.step for e in _committed(store)]
    newest = max(steps, default=-1)
    step = args.step if args.step is not None else newest + 1
    if step <= newest:
        raise UsageError(f"store {store}: --step {step} must be newer than every committed checkpoint (the newest is {newest}); a put never replaces a checkpoint")  # fmt: skip
    base = read_latest(store)
    old = read_manifest(store / committed_name(base)) if base is not None else None
    replaced = old.artifact(args.name) if old is not None and args.name in old.names else None

    # the class of NAME: as given, else the replaced tensor's (when it was stored), else primary
    if args.cls is not None:
        cls = ArtifactClass(args.cls.upper())
        parent, rebuild = args.parent, args.rebuild
    elif args.parent is not None or args.rebuild is not None:
        cls, parent, rebuild = ArtifactClass.DERIVED, args.parent, args.rebuild
    elif replaced is not None and replaced.cls is not ArtifactClass.EPHEMERAL:
        cls, parent, rebuild = replaced.cls, replaced.parent, replaced.rebuild
    else:
        cls, parent, rebuild = ArtifactClass.PRIMARY, None, None
    if cls is ArtifactClass.DERIVED and (parent is None or rebuild is None):
        raise UsageError(f"tensor {args.name!r}: a derived artifact needs --parent and --rebuild")  # fmt: skip
    if cls is ArtifactClass.PRIMARY and (parent is not None or rebuild is not None):
        raise UsageError(f"tensor {args.name!r}: --parent and --rebuild are for --class derived only")  # fmt: skip

    specs: list[tuple[TensorSpec, np.ndarray | None]] = []
    kept = [a for a in old.artifacts if a.name != args.name] if old is not None else []
    stored_names = {a.name for a in kept if a.cls is not ArtifactClass.EPHEMERAL} | {args.name}
    if parent is not None and (parent == args.name or parent not in stored_names):
        raise UsageError(f"tensor {args.name!r}: parent {parent!r} is not another stored tensor of the checkpoint (stored: {', '.join(sorted(stored_names - {args.name})) or 'none'})")  # fmt: skip

    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        raise agreed(
            UsageError("dtm store put is a serial tool: run it in one process, without mpirun")
        )
    from dtm_mpi.io.checkpoint import CheckpointStore

    mesh = MeshShape((("x", 1),))
    rebuilt: list[str] = []
    ckpt = CheckpointStore(store, MPI.COMM_SELF, chunk_bytes=old.chunk_bytes if old is not None else CHUNK_BYTES)  # fmt: skip
    try:
        targets = [(a.name, TensorType(a.dtype, a.shape, Layout.replicated(len(a.shape)))) for a in kept if a.cls is not ArtifactClass.EPHEMERAL]  # fmt: skip
        values: dict[str, np.ndarray] = {}
        if targets:
            assert base is not None
            values = ckpt.restore(mesh, targets, step=base).values
        new_type = TensorType(dtype, tuple(value.shape), Layout.replicated(value.ndim))
        new = (TensorSpec(args.name, new_type, cls, parent, rebuild), _as_block(value, dtype))
        values[args.name] = new[1]
        if old is not None:  # derived from NAME, directly or not: recompute, parents first
            from dtm_mpi.io.checkpoint import rebuild_value

            stale = [a for a in old.artifacts if _depth(old, a.name, args.name) > 0]
            for a in sorted(stale, key=lambda a: _depth(old, a.name, args.name)):
                assert a.parent is not None
                values[a.name] = rebuild_value(a, values[a.parent])
                rebuilt.append(a.name)
        for a in old.artifacts if old is not None else ():
            if a.name == args.name:
                specs.append(new)
                continue
            t = TensorType(a.dtype, a.shape, Layout.replicated(len(a.shape)))
            specs.append((TensorSpec(a.name, t, a.cls, a.parent, a.rebuild), values.get(a.name)))
        if replaced is None:
            specs.append(new)
        path = ckpt.save(step, mesh, specs, module_hash=old.module_hash if old is not None else None)  # fmt: skip
    finally:
        ckpt.close()
    what = "replaced" if replaced is not None else "added"
    source = f"copy of step {base}" if base is not None else "first checkpoint of the store"
    print(f"wrote {path}: step {step}, {len(specs)} tensor(s) ({source}); {what} {args.name!r}: {dtype}{_shape_text(value.shape)}, {cls.value.lower()}")  # fmt: skip
    if rebuilt:
        print(f"rebuilt from the new value: {', '.join(rebuilt)} (derived)")
    return 0


def _depth(m: Any, name: str, ancestor: str) -> int:
    """How many parent links lead from artifact ``name`` of manifest ``m`` up to
    ``ancestor`` (0: it does not derive from it)."""
    seen: set[str] = set()
    a, depth = m.artifact(name), 0
    while a.parent is not None and a.parent not in seen:
        depth += 1
        if a.parent == ancestor:
            return depth
        seen.add(a.parent)
        a = m.artifact(a.parent)
    return 0
