"""Token files for LLM training: :func:`prepare_tokens` (``dtm data prepare``) writes text
files' tokens as a nanoGPT-style ``.bin`` (the token ids, little-endian ``uint16`` or
``uint32``, nothing else) with a JSON side file ``<bin>.json`` (format ``dtm-tokens-1``: dtype,
token count, vocabulary size, the file's SHA-256, the tokenizer; io/TOKENS.md), and
:class:`TokenLoader` feeds a training step from one, memory-mapped.

The batch of step ``s`` is a pure function of (file, context ``T``, batch ``B``, seed, ``s``):
the file is cut into ``W = (N - 1) // T`` windows of ``T`` tokens (``ids``), each with the
``T`` tokens one further on (``labels``); epoch ``e = s // (W // B)`` visits the windows in
the order of a permutation seeded by ``(seed, e)``, step ``s`` taking the next ``B``. So every
mesh sees the same batch at the same step, and a run resumed from a checkpoint (which records
the step) continues with the batch the uninterrupted run would have read, on any mesh, dp
changes included. Each rank reads only the windows of its rows of the batch.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import UsageError

__all__ = [
    "FORMAT",
    "TokenFile",
    "TokenLoader",
    "prepare_tokens",
    "read_token_file",
    "write_tokens",
]

FORMAT = "dtm-tokens-1"
"""The ``format`` field of a token file's side file (io/TOKENS.md)."""
_DTYPES: dict[str, np.dtype[Any]] = {
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}  # little-endian on every host
_HASH_CHUNK = 1 << 24


@dataclass(frozen=True, slots=True)
class TokenFile:
    """A token file and what its side file says of it."""

    path: Path
    dtype: str
    tokens: int
    vocab_size: int
    sha256: str

    def open(self) -> np.ndarray:
        """The tokens, memory-mapped read-only (nothing is read until sliced)."""
        out: np.ndarray = np.memmap(
            self.path, dtype=_DTYPES[self.dtype], mode="r", shape=(self.tokens,)
        )
        return out


def side_file(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_token_file(path: str | Path, *, verify: bool = False) -> TokenFile:
    """The token file ``path`` as its side file describes it; one error naming the file and
    the field where the side file is missing, malformed or disagrees with the file's size
    (``verify``: also its SHA-256, which reads the whole file)."""
    p = Path(path)
    meta_path = side_file(p)
    if not p.is_file():
        raise UsageError(f"{p}: no such token file")
    if not meta_path.is_file():
        raise UsageError(
            f"{p}: no side file {meta_path.name} (token files are written by `dtm data prepare`)"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{meta_path}: not a JSON side file ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(f"{meta_path}: format is not {FORMAT!r}")
    dtype = meta.get("dtype")
    if dtype not in _DTYPES:
        raise UsageError(f"{meta_path}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    fields: dict[str, int] = {}
    for key in ("tokens", "vocab_size"):
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UsageError(f"{meta_path}: {key} must be a whole number; got {v!r}")
        fields[key] = v
    digest = meta.get("sha256")
    if not (isinstance(digest, str) and len(digest) == 64):
        raise UsageError(f"{meta_path}: sha256 must be 64 hex digits; got {digest!r}")
    size = p.stat().st_size
    want = fields["tokens"] * _DTYPES[dtype].itemsize
    if size != want:
        raise UsageError(
            f"{p}: {size} bytes, but its side file says {fields['tokens']} {dtype} tokens "
            f"({want} bytes): the file is truncated or not the one the side file describes"
        )
    out = TokenFile(p, dtype, fields["tokens"], fields["vocab_size"], digest)
    if verify and _sha256(p) != digest:
        raise UsageError(f"{p}: its SHA-256 differs from the side file's: the tokens changed")
    return out


def _write(path: Path, ids: np.ndarray, vocab: int, extra: Mapping[str, Any]) -> TokenFile:
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    tmp = path.with_name(path.name + ".tmp")
    ids.astype(_DTYPES[dtype]).tofile(tmp)
    tmp.replace(path)
    digest = _sha256(path)
    meta = {
        "format": FORMAT,
        "dtype": dtype,
        "tokens": int(ids.size),
        "vocab_size": int(vocab),
        "sha256": digest,
        **extra,
    }
    side_file(path).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return TokenFile(path, dtype, int(ids.size), int(vocab), digest)


def write_tokens(ids: np.ndarray, vocab_size: int, out: str | Path, **fields: Any) -> TokenFile:
    """Token ids already tokenized (a 1-D integer array, each below ``vocab_size``) as the
    token file ``out`` and its side file (``fields``: informative ones, e.g. ``sources``)."""
    a = np.asarray(ids)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise UsageError(f"{out}: token ids are a 1-D integer array; got {a.dtype}{list(a.shape)}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab_size):
        raise UsageError(f"{out}: an id is outside the vocabulary of {vocab_size}")
    return _write(Path(out), a, int(vocab_size), fields)


def prepare_tokens(
    texts: Sequence[str | Path],
    tokenizer: str | Path,
    out: str | Path,
    *,
    val_fraction: float = 0.0,
    eot: int | None = None,
    progress: bool = False,
) -> tuple[TokenFile, TokenFile | None]:
    """Tokenize the text files ``texts`` (UTF-8) with ``tokenizer`` (a ``tokenizer.json``)
    into the token file ``out`` (and its side file); ``eot``: an id appended after each file
    (a document separator); ``val_fraction`` of the tokens (the last ones) go to a validation
    file beside it (``<stem>.val<suffix>``). Returns the training and the validation file."""
    from dtm_mpi.frontend.tokenizer import load_tokenizer

    if not texts:
        raise UsageError("dtm data prepare needs at least one text file")
    if not 0.0 <= val_fraction < 1.0:
        raise UsageError(f"the validation fraction must be in [0, 1); got {val_fraction}")
    tok = load_tokenizer(tokenizer)
    vocab = tok.vocab_size
    if eot is not None and not 0 <= eot < vocab:
        raise UsageError(f"--eot {eot} is not an id of {tok.path} (its vocabulary has {vocab})")
    parts: list[np.ndarray] = []
    for i, name in enumerate(texts):
        p = Path(name)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"{p}: no such text file") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"{p}: not UTF-8 text (byte {exc.start})") from None
        doc = list(tok.impl.encode(text).ids) if text else []
        if eot is not None:
            doc.append(eot)
        parts.append(np.asarray(doc, dtype=np.int64))
        if progress:
            total = sum(x.size for x in parts)
            sys.stderr.write(f"\rdtm data prepare: {i + 1}/{len(texts)} files, {total} tokens")
            sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise UsageError(f"{tok.path}: gave an id outside its vocabulary of {vocab}")
    n_val = int(ids.size * val_fraction)
    target = Path(out)
    extra = {"tokenizer": str(tok.path), "sources": [str(t) for t in texts]}
    train = _write(target, ids[: ids.size - n_val], vocab, {**extra, "split": "train"})
    val = None
    if n_val:
        vpath = target.with_name(f"{target.stem}.val{target.suffix}")
        val = _write(vpath, ids[ids.size - n_val :], vocab, {**extra, "split": "validation"})
    return train, val


_POSITION_VERSION = 1
"""The layout of ``data.tokens.position`` (io/TOKENS.md §4)."""


class TokenLoader:
    """Batches of ``batch`` windows of ``context`` tokens from a token file (module doc):
    ``ids`` the window, ``labels`` the window one token further on, as ``int32`` (or
    ``dtype``). A step's inputs named otherwise can be mapped with ``names`` (e.g.
    ``{"x": "ids"}``). ``vocab_size``: the model's; a file whose vocabulary is larger is
    refused (a smaller one is a padded embedding's, and fine). ``verify``: check the file's
    SHA-256 against its side file now (reads the whole file).

    :func:`~dtm_mpi.frontend.fit.fit` saves the loader's position in every checkpoint (the
    file's hash, the windowing and the step's place in its epoch, io/TOKENS.md §4) and, on
    resume, refuses a file whose hash differs from the one the run was trained on, or
    another context, batch or seed."""

    def __init__(
        self,
        path: str | Path,
        *,
        context: int,
        batch: int,
        seed: int = 0,
        dtype: str = "int32",
        names: Mapping[str, str] | None = None,
        verify: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        self.file = read_token_file(path, verify=verify)
        self._setup(self.file.open(), context, batch, seed, dtype, names, vocab_size)

    @classmethod
    def from_store(
        cls,
        store: str | Path,
        tensor: str,
        *,
        vocab_size: int,
        context: int,
        batch: int,
        seed: int = 0,
        step: int | None = None,
        dtype: str = "int32",
        names: Mapping[str, str] | None = None,
    ) -> TokenLoader:
        """Batches from tokens already in a checkpoint store: the 1-D integer tensor
        ``tensor`` of its latest checkpoint (or ``step``'s), read through the store's backend
        (:class:`~dtm_mpi.io.tools.TensorRows`: each rank reads only the chunks of its
        windows, each checked against its content hash). Its
        identity in the run's checkpoints is the tensor's Merkle root in the manifest (a
        changed tensor is refused on resume as a changed token file is); ``vocab_size``: the
        tokenizer's (the store does not record it)."""
        from dtm_mpi.io.tools import TensorRows, checkpoint_path, read_manifest, store_dir

        where = store_dir(store)
        ckpt = checkpoint_path(where, step)
        manifest = read_manifest(ckpt)
        if tensor not in manifest.names:
            raise UsageError(
                f"{ckpt}: no tensor {tensor!r} (it has: {', '.join(manifest.names) or 'none'})"
            )
        a = manifest.artifact(tensor)
        if len(a.shape) != 1 or a.dtype.is_float or a.dataset is None:
            raise UsageError(
                f"{ckpt}: tensor {tensor!r} is {a.dtype.value}{list(a.shape)}; token ids are a "
                "stored 1-D integer tensor"
            )
        rows = TensorRows(ckpt, tensor)  # through the store's backend, each chunk verified
        self = cls.__new__(cls)
        self.file = TokenFile(ckpt, a.dtype.value, a.shape[0], int(vocab_size), a.merkle_root)
        self._setup(rows, context, batch, seed, dtype, names, None)
        return self

    def _setup(
        self,
        tokens: Any,
        context: int,
        batch: int,
        seed: int,
        dtype: str,
        names: Mapping[str, str] | None,
        vocab_size: int | None,
    ) -> None:
        for what, v in (("context", context), ("batch", batch)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"TokenLoader {what} must be a whole number >= 1; got {v!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
            raise UsageError(f"TokenLoader seed must be a whole number in [0, 2**63); got {seed!r}")
        if vocab_size is not None and self.file.vocab_size > vocab_size:
            raise UsageError(
                f"{self.file.path}: its tokens come from a vocabulary of {self.file.vocab_size} "
                f"ids, larger than the model's {vocab_size}: tokenized for another model"
            )
        self.context, self.batch, self.seed = context, batch, seed
        self.windows = (self.file.tokens - 1) // context
        if self.windows < batch:
            raise UsageError(
                f"{self.file.path}: {self.file.tokens} tokens make {self.windows} windows of "
                f"{context} (+1 for the labels), fewer than a batch of {batch}"
            )
        self.per_epoch = self.windows // batch
        self.dtype = np.dtype(dtype)
        if self.dtype.kind not in "iu" or (self.file.vocab_size > np.iinfo(self.dtype).max + 1):
            raise UsageError(f"TokenLoader dtype {dtype} cannot hold ids of {self.file.vocab_size}")
        self.names = dict(names or {})
        self._tokens = tokens  # a memory map, or an HDF5 dataset: sliced per window
        self._order: tuple[int, np.ndarray] | None = None

    def windows_of(self, step: int) -> np.ndarray:
        """The window indices of step ``step``'s batch, in batch order."""
        if not isinstance(step, int | np.integer) or step < 0:
            raise UsageError(f"TokenLoader: step must be >= 0; got {step!r}")
        epoch, k = divmod(int(step), self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._order = (epoch, order)
        return self._order[1][k * self.batch : (k + 1) * self.batch]

    def position_tensors(self, done: int) -> dict[str, np.ndarray]:
        """Where the loader stands after ``done`` steps (the run's next batch is that of
        step ``done``, 0-based), as a checkpoint records it (io/TOKENS.md §4)."""
        epoch, k = divmod(done, self.per_epoch)
        f = self.file
        position = [_POSITION_VERSION, f.tokens, f.vocab_size, self.context, self.batch]
        position += [self.seed, epoch, k * self.batch]
        return {
            "data.tokens.sha256": np.frombuffer(bytes.fromhex(f.sha256), np.uint8).copy(),
            "data.tokens.position": np.asarray(position, np.int64),
        }

    def check_position(self, saved: Mapping[str, np.ndarray], done: int, where: str) -> None:
        """Refuse to resume after ``done`` steps from checkpoint ``where`` if the position it
        saved is not this loader's: another file (its SHA-256), windowing or seed."""
        digest, pos = saved.get("data.tokens.sha256"), saved.get("data.tokens.position")
        if digest is None or pos is None:
            raise UsageError(
                f"{where}: its data position is not a token file's (it has "
                f"{', '.join(sorted(saved))}); this run reads {self.file.path}"
            )
        if int(pos[0]) != _POSITION_VERSION:
            raise UsageError(
                f"{where}: data.tokens.position has layout {int(pos[0])}; this dtm_mpi reads "
                f"layout {_POSITION_VERSION}"
            )
        old = bytes(digest).hex()
        if old != self.file.sha256:
            raise UsageError(
                f"{self.file.path}: its content hash (SHA-256 of a token file, Merkle root of "
                f"a store's tensor) is {self.file.sha256[:16]}..., but the run saved in "
                f"{where} was trained on tokens with {old[:16]}... ({int(pos[1])} tokens): "
                "refusing to resume on other data"
            )
        mine = {"context": self.context, "batch": self.batch, "seed": self.seed}
        theirs = {"context": int(pos[3]), "batch": int(pos[4]), "seed": int(pos[5])}
        if mine != theirs:
            diff = ", ".join(
                f"{k} {theirs[k]} (now {mine[k]})" for k in mine if mine[k] != theirs[k]
            )
            raise UsageError(
                f"{where}: the run read {self.file.path} with {diff}: the batches after the "
                "resume would not be the ones it would have read; resume with the same "
                "context, batch and seed"
            )
        expect = self.position_tensors(done)["data.tokens.position"]
        if not np.array_equal(np.asarray(pos), expect):
            raise UsageError(
                f"{where}: its data position (epoch {int(pos[6])}, window {int(pos[7])}) is "
                f"not where {done} steps end (epoch {int(expect[6])}, window {int(expect[7])})"
            )

    def _read(self, windows: Iterable[int], shift: int) -> np.ndarray:
        t = self.context
        rows = [np.asarray(self._tokens[w * t + shift : w * t + shift + t]) for w in windows]
        if not rows:
            return np.zeros((0, t), self.dtype)
        return np.stack(rows).astype(self.dtype)

    def __call__(
        self, step: int, regions: Mapping[str, tuple[slice, ...]]
    ) -> dict[str, np.ndarray]:
        chosen = self.windows_of(step)
        out = {}
        for name, region in regions.items():
            kind = self.names.get(name, name)
            if kind not in ("ids", "labels"):
                raise UsageError(
                    f"TokenLoader gives 'ids' and 'labels'; the step's input {name!r} is "
                    "neither (map it with names={...})"
                )
            if len(region) != 2:
                raise UsageError(
                    f"input {name!r}: TokenLoader gives [batch, context] tokens; the input has "
                    f"{len(region)} dim(s)"
                )
            rows, cols = region
            for sl, size, what in ((rows, self.batch, "batch"), (cols, self.context, "context")):
                if sl.stop is not None and sl.stop > size:
                    raise UsageError(
                        f"input {name!r}: its {what} dim reaches {sl.stop}, longer than the "
                        f"loader's {what} of {size}"
                    )
            block = self._read(chosen[rows], 1 if kind == "labels" else 0)
            out[name] = np.ascontiguousarray(block[:, cols])
        return out
