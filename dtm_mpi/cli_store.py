"""``dtm ckpt ...`` and ``dtm store ...``: serial tools over one checkpoint store directory.

``dtm ckpt ls | inspect | verify | rm`` look at and tidy checkpoint files; ``dtm store ls |
get | put`` read one tensor out of a checkpoint (every chunk verified) and write a new
checkpoint with one tensor added or replaced (copy-on-write: the old checkpoint stays as it
is). This module parses the arguments and prints; the work is the public API of
:mod:`dtm_mpi.io.tools` (``store put`` saves through
:class:`~dtm_mpi.io.checkpoint.CheckpointStore` on the self communicator, so the store's quota
and retention apply as for any save).

Exit codes as for every ``dtm`` command: 0 success, 1 a failed check or a storage error
(damaged data, invalid manifest, quota), 2 bad usage (including a store directory, step or
tensor that does not exist).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtm_mpi.errors import ManifestError, UsageError, agreed

if TYPE_CHECKING:
    import numpy as np

    from dtm_mpi.io.backend import ShardBackend
    from dtm_mpi.io.manifest import ArtifactRecord, Manifest

__all__ = ["add_store_commands"]


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
    which.add_argument(
        "--all",
        action="store_true",
        help="every committed checkpoint (incomplete ones count as problems)",
    )
    ver.set_defaults(func=_cmd_ckpt_verify)

    rm = csub.add_parser("rm", help="remove a checkpoint, or every incomplete (partial) one")
    rm.add_argument("store", metavar="STORE")
    what = rm.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, default=None, metavar="N", help="checkpoint step")
    what.add_argument(
        "--partial",
        action="store_true",
        help="every *.partial-* checkpoint (a save still running then fails at its commit)",
    )
    rm.add_argument(
        "--force",
        action="store_true",
        help="also remove the checkpoint 'latest' names (latest moves to the newest remaining one)",
    )
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
    _strict_arg(get)
    get.set_defaults(func=_cmd_store_get)

    put = ssub.add_parser(
        "put", help="save a new checkpoint: the latest one with tensor NAME added or replaced"
    )
    put.add_argument("store", metavar="STORE")
    put.add_argument("name", metavar="NAME")
    put.add_argument("file", metavar="FILE.npy")
    put.add_argument(
        "--class",
        dest="cls",
        choices=["primary", "derived"],
        default=None,
        help="artifact class (default: the replaced tensor's, else primary)",
    )
    put.add_argument("--parent", default=None, help="parent tensor of a derived artifact")
    put.add_argument(
        "--rebuild",
        default=None,
        help="rebuild instruction of a derived artifact (e.g. copy, cast:f16)",
    )
    _step_arg(put, "one past the newest committed checkpoint; 0 for an empty store")
    put.set_defaults(func=_cmd_store_put)

    exp = ssub.add_parser(
        "export",
        help="write tensors of a checkpoint to a .safetensors (PyTorch, Hugging Face) or .npz file",
    )
    exp.add_argument("store", metavar="STORE")
    exp.add_argument("names", nargs="*", metavar="NAME", help="tensors (default: every one)")
    exp.add_argument(
        "-o", "--output", required=True, metavar="OUT", help="OUT.safetensors or OUT.npz"
    )
    _interop_args(exp, "store name -> name in the file")
    _strict_arg(exp)
    _step_arg(exp)
    exp.set_defaults(func=_cmd_store_export)
    imp = ssub.add_parser(
        "import",
        help="save a new checkpoint: the latest one with the tensors of a .safetensors or .npz file",
    )
    imp.add_argument("store", metavar="STORE")
    imp.add_argument("file", metavar="FILE")
    imp.add_argument(
        "names", nargs="*", metavar="NAME", help="tensors of FILE (default: every one)"
    )
    _interop_args(imp, "name in the file -> store name")
    imp.set_defaults(func=_cmd_store_import)
    dep = ssub.add_parser(
        "deprecate",
        help="save a new checkpoint: the latest one with tensors marked DEPRECATED (still readable)",
    )
    dep.add_argument("store", metavar="STORE")
    dep.add_argument("names", nargs="+", metavar="NAME")
    dep.set_defaults(func=_cmd_store_deprecate)
    rec = ssub.add_parser(
        "recover",
        help="find damaged chunks and where their bytes come from again; repair into a new checkpoint",
    )
    rec.add_argument("store", metavar="STORE")
    _step_arg(rec)
    rec.add_argument("--dry-run", action="store_true", help="show the recovery plan; write nothing")
    rec.set_defaults(func=_cmd_store_recover)


def _strict_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail on a damaged chunk instead of serving it from a replica in another checkpoint",
    )


def _interop_args(p: argparse.ArgumentParser, direction: str) -> None:
    p.add_argument(
        "--format", choices=["safetensors", "npz"], default=None, help="default: from the suffix"
    )
    p.add_argument(
        "--map",
        metavar="FILE",
        default=None,
        help=f"a JSON or TOML table renaming tensors ({direction}), each with a transform where "
        "given (transpose, split along a dim, concatenate); only mapped tensors move",
    )


# --- shared helpers ---------------------------------------------------------------------------


def _mesh_text(mesh: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh) or "-"


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """``rows`` (the first is the header) as aligned text lines; columns ``right`` right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return out


def _open_checkpoint(args: argparse.Namespace) -> tuple[Path, Any, Path, Manifest]:
    """``STORE`` and ``--step`` of the command line: the store, its storage backend, the
    committed checkpoint (default: latest) and its manifest, validated (an invalid one is the
    error)."""
    from dtm_mpi.io.tools import checkpoint_path, read_manifest, store_backend, store_dir

    store = store_dir(args.store)
    backend = store_backend(store)
    path = checkpoint_path(store, args.step)
    return store, backend, path, read_manifest(path, backend)


def _stored(m: Manifest) -> list[ArtifactRecord]:
    from dtm_mpi.io.tools import stored

    return stored(m)


# --- dtm ckpt ---------------------------------------------------------------------------------


def _cmd_ckpt_ls(args: argparse.Namespace) -> int:
    from dtm_mpi.io.store import (
        DEFAULT_BACKEND,
        disk_usage,
        legacy_files,
        list_checkpoints,
        read_latest,
        read_meta,
    )
    from dtm_mpi.io.tools import INCOMPLETE_NOTE, read_manifest, reason, store_backend, store_dir

    store = store_dir(args.store)
    meta = read_meta(store)
    backend = store_backend(store)
    entries = list_checkpoints(store)
    quota = "none" if meta is None or meta.quota_bytes is None else f"{meta.quota_bytes} bytes"
    keep = "all" if meta is None or meta.keep_last is None else str(meta.keep_last)
    name = DEFAULT_BACKEND if meta is None else meta.backend
    settings = "" if meta is not None else " (no store.json: defaults)"
    print(
        f"store {store}: quota {quota}, keep_last {keep}, {disk_usage(store)} bytes in use by {len(entries)} checkpoint(s), backend {name}{settings}"
    )
    for p in legacy_files(store):
        print(
            f"{p.name}: a single-file checkpoint of format version 1, which this dtm_mpi does not read (not part of the store; it counts against the quota)"
        )
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
                notes.append(
                    f"{e.path.name}: latest because the 'latest' pointer is missing or names a missing file"
                )
            try:
                m = read_manifest(e.path, backend)
            except ManifestError as exc:
                row[1] = "INVALID"
                notes.append(f"{e.path.name}: INVALID: {reason(exc, e.path, backend)}")
            else:
                row[4:] = [str(len(_stored(m))), str(m.data_bytes), _mesh_text(m.mesh)]
        rows.append(row)
    for line in _table(rows, right=(0, 3, 4, 5)):
        print(line)
    for note in notes:
        print(note)
    from dtm_mpi.io.store import retired_files

    for p in retired_files(store):
        print(
            f"{p.name}: retired (by keep_last, a save that replaced its step, or dtm ckpt rm), not deleted yet; `dtm ckpt rm --partial` removes it"
        )
    return 0


def _cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    # validated first: an invalid manifest is an error, also for --json
    _, backend, path, m = _open_checkpoint(args)
    doc = _stored_manifest(path, backend)
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
    print(
        f"  tensors       {len(m.artifacts)} ({len(_stored(m))} stored), {m.data_bytes} data bytes"
    )
    files = sorted({sh.file for a in m.artifacts for sh in a.shards})
    span = (
        ""
        if not files
        else f" ({files[0]})"
        if len(files) == 1
        else f" ({files[0]} .. {files[-1]})"
    )
    print(f"  data files    {len(files)}{span}")
    rows = [
        ["name", "class", "state", "dtype", "shape", "layout", "shards", "bytes", "merkle", "from"]
    ]
    for a in m.artifacts:
        origin = f"{a.parent} ({a.rebuild})" if a.parent is not None else ""
        rows.append(
            [
                a.name,
                a.cls.value.lower(),
                a.state.value.lower(),
                a.dtype.value,
                _shape_text(a.shape),
                a.layout.dims_text(),
                str(len(a.shards)),
                str(sum(s.nbytes for s in a.shards)),
                a.merkle_root[:12] if a.dataset is not None else "-",
                origin,
            ]
        )
    for line in _table(rows, right=(6, 7)):
        print(line)
    return 0


def _stored_manifest(path: Path, backend: ShardBackend) -> dict[str, Any]:
    """The manifest JSON as stored in checkpoint ``path`` (fields this version does not know
    included)."""
    from dtm_mpi.io.tools import read_manifest_bytes

    doc: dict[str, Any] = json.loads(read_manifest_bytes(path, backend))
    return doc


def _cmd_ckpt_verify(args: argparse.Namespace) -> int:
    from dtm_mpi.config import get_config
    from dtm_mpi.io.tools import CheckStatus, store_dir, verify_checkpoints

    store = store_dir(args.store)
    checks = verify_checkpoints(store, args.step, args.all, timeout_s=get_config().timeout_s)
    if not checks:
        print(f"store {store}: no checkpoints")
        return 0
    for c in checks:
        if c.status is CheckStatus.OK:
            print(f"ok {c.path}: {c.tensors} tensors, {c.data_bytes} bytes verified")
        elif c.status is CheckStatus.DAMAGED:
            for line in c.problems:
                print(f"DAMAGED {line}")
        else:
            print(f"{c.status.value} {c.path}: {'; '.join(c.problems)}")
    failed = [c for c in checks if c.status is not CheckStatus.OK]
    problems = sum(len(c.problems) or 1 for c in failed)
    if failed:
        print(
            f"dtm ckpt verify: {len(failed)} of {len(checks)} checkpoint(s) of {store} failed ({problems} problem(s))",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_ckpt_rm(args: argparse.Namespace) -> int:
    from dtm_mpi.io.tools import remove_checkpoint, remove_incomplete, store_dir

    store = store_dir(args.store)
    if args.partial:
        gone = remove_incomplete(store)
        for p in gone:
            print(f"removed {p}")
        if not gone:
            print(f"store {store}: no incomplete checkpoints")
        return 0
    path, after = remove_checkpoint(store, args.step, args.force)
    print(f"removed {path}" + (f"; {after}" if after is not None else ""))
    return 0


# --- dtm store --------------------------------------------------------------------------------


def _cmd_store_ls(args: argparse.Namespace) -> int:
    from dtm_mpi.io.task_records import producers_of, read_records

    store, _, path, m = _open_checkpoint(args)
    print(f"checkpoint {path} (step {m.step}): {len(m.artifacts)} tensor(s)")
    derived = _derived_states(store, m)
    writers = producers_of(read_records(store))
    rows = [["name", "class", "state", "dtype", "shape", "bytes", "from"]]
    for a in m.artifacts:
        origin = f"{a.parent} ({a.rebuild})" if a.parent is not None else ""
        origin = origin or (f"task {writers[a.name]}" if a.name in writers else "")
        stored = str(sum(s.nbytes for s in a.shards)) if a.dataset is not None else "-"
        state = derived[a.name][0] if a.name in derived else a.state.value.lower()
        rows.append(
            [
                a.name,
                a.cls.value.lower(),
                state,
                a.dtype.value,
                _shape_text(a.shape),
                stored,
                origin,
            ]
        )
    for line in _table(rows, right=(5,)):
        print(line)
    for name, (state, why) in derived.items():
        print(f"{name} is {state}: {why}")
    return 0


def _derived_states(store: Path, m: Any) -> dict[str, tuple[str, str]]:
    """Tensor -> (state, why) for the tensors of checkpoint ``m`` the task records make
    ``recovering`` (a task rebuilding it) or ``stale`` (an input changed); only the latest
    checkpoint is judged: an older one holds what was current then."""
    from dtm_mpi.io.store import read_latest
    from dtm_mpi.io.task_records import read_records, recovering_tensors, stale_tensors

    if m.step != read_latest(store):
        return {}
    records = read_records(store)
    out = {t: ("stale", why) for t, why in stale_tensors(m, records).items()}
    out.update({t: ("recovering", why) for t, why in recovering_tensors(store, m, records).items()})
    return out


def _cmd_store_get(args: argparse.Namespace) -> int:
    from dtm_mpi.console import write_line
    from dtm_mpi.io.arrays import check_output_path, save_npy
    from dtm_mpi.io.recovery import read_served
    from dtm_mpi.ir.types import DType

    target = check_output_path(args.output, ".npy")
    store, backend, _, m = _open_checkpoint(args)
    warnings: list[str] = []

    def warn(text: str) -> None:
        warnings.append(text)
        write_line(text)

    value = read_served(store, m, args.name, backend=backend, warn=None if args.strict else warn)
    save_npy(str(target), value)
    note = f" ({len(warnings)} damaged chunk(s) served from replicas)" if warnings else ""
    _warn_state(store, m, args.name)
    if m.artifact(args.name).dtype is DType.BF16:
        how = "its raw 16 bits" if value.dtype.kind == "u" else "binary32 values"
        note = f"; bf16 is stored as {value.dtype} ({how}) and written as {value.dtype}"
    print(
        f"wrote {target}: tensor {args.name!r} of step {m.step}, {value.dtype}{_shape_text(value.shape)}, every chunk verified{note}"
    )
    return 0


def _warn_state(store: Path, m: Any, name: str) -> None:
    """A warning line for a stale or deprecated tensor that is read."""
    from dtm_mpi.console import write_line
    from dtm_mpi.io.manifest import Lifecycle

    state, why = _derived_states(store, m).get(name, ("", ""))
    if state:
        write_line(f"warning: tensor {name!r} is {state}: {why}; `dtm task run` recomputes it")
    elif m.artifact(name).state is Lifecycle.DEPRECATED:
        write_line(f"warning: tensor {name!r} is deprecated")


def _moved_lines(moved: Any, verb: str) -> None:
    from dtm_mpi.console import say

    for src, dst, dtype, shape in moved.tensors:
        name = src if src == dst else f"{src} -> {dst}"
        say(f"  {name}: {dtype.value}[{','.join(map(str, shape))}]")
    say(f"{verb} {len(moved.tensors)} tensor(s): {moved.path} (step {moved.step})")


def _cmd_store_export(args: argparse.Namespace) -> int:
    from dtm_mpi.console import write_line
    from dtm_mpi.io.interop import export_tensors
    from dtm_mpi.io.tensor_map import read_tensor_map
    from dtm_mpi.io.tools import store_dir

    rename = read_tensor_map(args.map) if args.map else None
    moved = export_tensors(
        store_dir(args.store),
        Path(args.output),
        names=args.names,
        fmt=args.format,
        step=args.step,
        rename=rename,
        warn=None if args.strict else write_line,
    )
    _moved_lines(moved, "exported")
    return 0


def _cmd_store_import(args: argparse.Namespace) -> int:
    from dtm_mpi.comm import handles
    from dtm_mpi.io.interop import import_tensors
    from dtm_mpi.io.tensor_map import read_tensor_map
    from dtm_mpi.io.tools import store_dir

    rename = read_tensor_map(args.map) if args.map else None
    moved = import_tensors(
        store_dir(args.store),
        Path(args.file),
        handles.self_comm(),
        names=args.names,
        fmt=args.format,
        rename=rename,
    )
    _moved_lines(moved, "imported")
    return 0


def _cmd_store_deprecate(args: argparse.Namespace) -> int:
    from dtm_mpi.comm import handles
    from dtm_mpi.console import say
    from dtm_mpi.io.manifest import Lifecycle
    from dtm_mpi.io.tools import put_tensors, store_dir

    states = dict.fromkeys(args.names, Lifecycle.DEPRECATED)
    put = put_tensors(store_dir(args.store), handles.self_comm(), {}, states=states)
    say(f"wrote {put.path}: step {put.step}; deprecated {', '.join(args.names)}")
    return 0


def _cmd_store_recover(args: argparse.Namespace) -> int:
    from dtm_mpi.comm import handles
    from dtm_mpi.console import say
    from dtm_mpi.io.recovery import recovery_plan, recovery_text, repair
    from dtm_mpi.io.store import read_latest

    store, backend, path, m = _open_checkpoint(args)
    plan = recovery_plan(store, m, backend)
    say(f"checkpoint {path} (step {m.step}): " + recovery_text(plan))
    if args.dry_run or not plan:
        return 0
    if m.step != read_latest(store):
        raise UsageError(
            f"a repair writes the latest checkpoint again; step {m.step} is not the latest "
            "(--dry-run shows its plan)"
        )
    put, dropped = repair(store, m.step, plan, handles.self_comm(), backend=backend)
    left = (
        f"; left out {', '.join(dropped)}: `dtm task run GRAPH` recomputes them" if dropped else ""
    )
    say(
        f"repaired: wrote {put.path} (step {put.step}), the other damaged tensors whole again{left}"
    )
    return 0


def _load_npy(text: str) -> np.ndarray:
    """The array in the ``.npy`` file ``text`` (read as ``dtm run -i`` reads inputs)."""
    from dtm_mpi.io.arrays import load_arrays

    if Path(text).suffix.lower() != ".npy":
        raise UsageError(f"input {text}: use a .npy file")
    (value,) = load_arrays([text]).values()
    return value


def _cmd_store_put(args: argparse.Namespace) -> int:
    from dtm_mpi.comm import handles
    from dtm_mpi.io.tools import put_tensor, store_dir

    store = store_dir(args.store)
    if args.step is not None and args.step < 0:
        raise UsageError(f"--step must be >= 0; got {args.step}")
    value = _load_npy(args.file)
    if handles.world_size() > 1:
        raise agreed(
            UsageError("dtm store put is a serial tool: run it in one process, without mpirun")
        )
    r = put_tensor(
        store,
        handles.self_comm(),
        args.name,
        value,
        cls=args.cls,
        parent=args.parent,
        rebuild=args.rebuild,
        step=args.step,
        where=args.file,
    )
    what = "replaced" if r.replaced else "added"
    assert r.cls is not None
    source = f"copy of step {r.base}" if r.base is not None else "first checkpoint of the store"
    print(
        f"wrote {r.path}: step {r.step}, {r.tensors} tensor(s) ({source}); {what} {args.name!r}: {r.dtype}{_shape_text(r.shape)}, {r.cls.value.lower()}"
    )
    if r.rebuilt:
        print(f"rebuilt from the new value: {', '.join(r.rebuilt)} (derived)")
    return 0
