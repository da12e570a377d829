"""What a task graph keeps in its store (io/TASKS.md §5): content keys, task records, staged
outputs.

* A stored tensor's **identity** is its dtype, shape and Merkle root (FORMAT.md): the same
  bytes stored the same way have the same identity; other bytes never do (a tensor stored
  again with another shard layout gets another root, which only costs a recomputation).
* A task's **key** is the SHA-256 of the canonical JSON of its program's module hash, its
  mesh, steps and backend, its output names and the identity of each input tensor.
* A **record** ``STORE/tasks/<task>.json`` says which key produced which output identities
  in which checkpoint. A task whose key equals its record's, while every output in the
  store's latest checkpoint still has the recorded identity, is skipped: its result is
  there. A missing, unreadable or malformed record only means the task runs.
* A task's outputs are **staged** in ``STORE/tasks/<task>.staged.npz`` until the wave's
  commit puts them into a new checkpoint; a crash leaves at most a staged file, which the
  next run ignores and replaces.

Serial: rank 0 (or a tool) reads and writes these files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dtm_mpi.io.store import write_text_atomic

if TYPE_CHECKING:
    import numpy as np

    from dtm_mpi.io.manifest import ArtifactRecord, Manifest

__all__ = [
    "RECORD_FORMAT",
    "RECORD_VERSION",
    "TaskRecord",
    "identity",
    "clear_running",
    "mark_running",
    "producers_of",
    "read_record",
    "read_records",
    "recovering_tensors",
    "stale_tensors",
    "record_holds",
    "remove_staged",
    "read_staged",
    "stage_outputs",
    "staged_path",
    "task_key",
    "write_record",
]

RECORD_FORMAT = "dtm-task-record"
RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class TaskRecord:
    task: str
    key: str
    checkpoint: int  # the step of the checkpoint its outputs went into
    outputs: tuple[tuple[str, str], ...]  # (store tensor, identity)
    inputs: tuple[tuple[str, str], ...] = ()  # (store tensor, identity it was computed from)

    def to_json(self) -> str:
        doc = {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "task": self.task,
            "key": self.key,
            "checkpoint": self.checkpoint,
            "outputs": dict(self.outputs),
            "inputs": dict(self.inputs),
        }
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def identity(a: ArtifactRecord) -> str:
    """A stored tensor's content identity: ``DTYPE[SHAPE]:ROOT``."""
    return f"{a.dtype.value}[{','.join(map(str, a.shape))}]:{a.merkle_root}"


def _identity_in(latest: Manifest, tensor: str) -> str | None:
    """The identity of ``tensor`` in ``latest``, None when it holds no such tensor."""
    return identity(latest.artifact(tensor)) if tensor in latest.names else None


def task_key(
    program_hash: str,
    *,
    mesh: Sequence[tuple[str, int]],
    steps: int,
    backend: str,
    outputs: Sequence[tuple[str, str]],
    inputs: Mapping[str, str],
) -> str:
    """The task's content key (module docstring); ``inputs``: parameter -> input identity."""
    doc = {
        "program": program_hash,
        "mesh": [list(a) for a in mesh],
        "steps": steps,
        "backend": backend,
        "outputs": [list(o) for o in outputs],
        "inputs": dict(sorted(inputs.items())),
    }
    return hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def read_records(store: Path) -> list[TaskRecord]:
    """Every well-formed record of ``store`` (by task name)."""
    out = []
    for path in sorted((store / "tasks").glob("*.json")):
        rec = read_record(store, path.stem)
        if rec is not None:
            out.append(rec)
    return out


def producers_of(records: list[TaskRecord]) -> dict[str, str]:
    """Store tensor -> the task whose record says it wrote it."""
    return {tensor: rec.task for rec in records for tensor, _ in rec.outputs}


def stale_tensors(latest: Manifest, records: list[TaskRecord]) -> dict[str, str]:
    """The tensors of ``latest`` that are **stale**: written by a task from inputs that have
    changed since (an input's identity is no longer the recorded one, or the input is itself
    stale), each with the reason. A pure function of the manifest and the records: the
    records are the one home of what was derived from what."""
    stale: dict[str, str] = {}
    changed = True
    while changed:  # to a fixed point: staleness flows down the records
        changed = False
        for rec in records:
            reason = None
            for tensor, ident in rec.inputs:
                if tensor in stale:
                    reason = f"its input {tensor!r} is stale"
                elif _identity_in(latest, tensor) != ident:
                    reason = f"its input {tensor!r} changed since task {rec.task!r} computed it"
                if reason is not None:
                    break
            if reason is None:
                continue
            for tensor, ident in rec.outputs:
                if _identity_in(latest, tensor) == ident and tensor not in stale:
                    stale[tensor] = reason
                    changed = True
    return stale


def mark_running(store: Path, task: str, key: str) -> None:
    """Rank 0, before a task runs: ``STORE/tasks/TASK.running`` (its key). Its outputs that the
    store holds are RECOVERING until the task's wave commits (:func:`clear_running`); a run
    that failed or was killed leaves the marker, so they stay RECOVERING until a run ends."""
    write_text_atomic(_file(store, task, ".running", make=True), key + "\n")


def clear_running(store: Path, task: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _file(store, task, ".running").unlink()


def recovering_tensors(store: Path, latest: Manifest, records: list[TaskRecord]) -> dict[str, str]:
    """The tensors of ``latest`` a task is rebuilding (or was, when its run ended before its
    commit): the outputs its record holds, for every task with a running marker."""
    running = {p.stem for p in (store / "tasks").glob("*.running")}
    out = {}
    for rec in records:
        if rec.task in running:
            for tensor, _ in rec.outputs:
                if tensor in latest.names:
                    out[tensor] = (
                        f"task {rec.task!r} is rebuilding it (or its last run ended before its commit)"
                    )
    return out


def _file(store: Path, task: str, suffix: str, *, make: bool = False) -> Path:
    """``STORE/tasks/TASK<suffix>`` (``make``: its folder created first)."""
    if make:
        (store / "tasks").mkdir(parents=True, exist_ok=True)
    return store / "tasks" / f"{task}{suffix}"


def read_record(store: Path, task: str) -> TaskRecord | None:
    """The record of ``task``, or None when there is none or it is not a well-formed record
    of this task (the task then runs)."""
    try:
        doc = json.loads(_file(store, task, ".json").read_text(encoding="utf-8"))
        if doc.get("format") != RECORD_FORMAT or doc.get("version") != RECORD_VERSION:
            return None
        inputs = doc.get("inputs", {})
        if doc["task"] != task or not isinstance(doc["outputs"], dict):
            return None
        if not isinstance(inputs, dict):
            return None
        return TaskRecord(
            task,
            str(doc["key"]),
            int(doc["checkpoint"]),
            tuple((str(k), str(v)) for k, v in sorted(doc["outputs"].items())),
            tuple((str(k), str(v)) for k, v in sorted(inputs.items())),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def record_holds(record: TaskRecord | None, key: str, latest: Manifest | None) -> bool:
    """Whether ``record`` says the task's result for ``key`` is in ``latest`` (every output
    there with its recorded identity)."""
    if record is None or record.key != key or latest is None:
        return False
    return all(_identity_in(latest, t) == i for t, i in record.outputs)


def write_record(store: Path, record: TaskRecord) -> None:
    """Write (replace) the record of ``record.task``, atomically."""
    write_text_atomic(_file(store, record.task, ".json", make=True), record.to_json())


def staged_path(store: Path, task: str) -> Path:
    return _file(store, task, ".staged.npz")


def stage_outputs(store: Path, task: str, values: Mapping[str, np.ndarray]) -> Path:
    """Write a task's outputs (store tensor -> value) to its staged file, atomically."""
    from dtm_mpi.io.arrays import save_npz

    path = _file(store, task, ".staged.npz", make=True)
    save_npz(str(path), values)
    return path


def read_staged(store: Path, task: str) -> dict[str, np.ndarray]:
    from dtm_mpi.io.arrays import load_arrays

    return load_arrays([str(staged_path(store, task))])


def remove_staged(store: Path, task: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        staged_path(store, task).unlink()
