"""What verifying a checkpoint checks, whatever format its shards are stored in.

* :class:`VerifyItem`: one unit of the work (a shard, or something the format keeps beside the
  shards, e.g. HDF5's virtual dataset of a tensor: shard ``*``), so that a verification run in
  a child process can name what it was reading when the format's library crashed;
* :func:`shard_items`: the items of every stored shard, in manifest order;
* :func:`chunk_mismatch` / :func:`digest_mismatch`: why a chunk is not the manifest's;
* :class:`ShardVerifier`: checks shard items through any
  :class:`~dtm_mpi.io.backend.ShardReader` (what a backend without anything of its own to
  check beside the shards returns from ``open_verifier``).

Nothing here opens a file itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dtm_mpi.errors import IntegrityError
from dtm_mpi.io.hashing import chunk_hash
from dtm_mpi.io.manifest import Manifest, ShardRecord

if TYPE_CHECKING:
    from dtm_mpi.io.backend import ShardReader

__all__ = ["ShardVerifier", "VerifyItem", "chunk_mismatch", "digest_mismatch", "shard_items"]


@dataclass(frozen=True, slots=True)
class VerifyItem:
    """One unit of a checkpoint's verification: every chunk of one shard in its data file
    (``index``: the shard's index), or something the format keeps beside the shards for
    tensor ``tensor`` (``shard`` is ``*``, ``index`` None; ``file``: where it is)."""

    tensor: str
    shard: str
    file: Path
    artifact: int  # index into the manifest's artifacts
    index: int | None  # shard index, None for the format's own record of the tensor


def shard_items(ckpt: Path, manifest: Manifest) -> list[VerifyItem]:
    """One item per stored shard of ``manifest`` (checkpoint directory ``ckpt``), in manifest
    order."""
    out: list[VerifyItem] = []
    for i, a in enumerate(manifest.artifacts):
        out += [VerifyItem(a.name, s.id, ckpt / s.file, i, k) for k, s in enumerate(a.shards)]
    return out


def chunk_mismatch(s: ShardRecord, c: int, data: np.ndarray) -> str | None:
    """Why ``data`` is not chunk ``c`` of shard ``s`` (its content hash differs from the
    manifest's), or None."""
    return digest_mismatch(s, c, chunk_hash(data))


def digest_mismatch(s: ShardRecord, c: int, got: str) -> str | None:
    """Why chunk ``c`` of shard ``s`` with content hash ``got`` is not the manifest's, or None."""
    want = s.chunks[c]
    if got == want:
        return None
    region = s.chunk_region(c)
    rows = f"rows {region[0].start}..{region[0].stop - 1}" if region else "the scalar"
    return f"chunk {c} ({rows}) content hash {got} does not match the manifest's {want}"


class ShardVerifier:
    """Checks the shard items of one checkpoint (every chunk against its content hash)
    through ``reader``, which it closes; use it as a context manager."""

    def __init__(self, reader: ShardReader, manifest: Manifest) -> None:
        self.reader, self.manifest = reader, manifest

    def __enter__(self) -> ShardVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.reader.close()

    def check(self, item: VerifyItem) -> IntegrityError | None:
        """The damage shard item ``item`` finds, or None."""
        if item.index is None:
            raise ValueError(
                f"{item.file}: tensor {item.tensor!r}: not a shard item; only the backend that made it can check it"
            )
        a = self.manifest.artifacts[item.artifact]
        s = a.shards[item.index]
        try:
            for c in range(len(s.chunks)):
                self.reader.read_verified(a, s, c)
        except IntegrityError as exc:
            return exc
        return None
