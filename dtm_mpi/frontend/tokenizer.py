"""Text to token ids and back with a model directory's ``tokenizer.json`` (the Hugging Face
``tokenizers`` package, which transformers uses too): :func:`load_tokenizer` gives a
:class:`TextTokenizer`, or one error naming the file and why it does not load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtm_mpi.errors import UsageError

__all__ = ["TOKENIZER_FILE", "TextTokenizer", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
"""The file a model directory (or a store's ``hf/``) keeps its tokenizer in."""


@dataclass(frozen=True, slots=True)
class TextTokenizer:
    """The tokenizer of ``path``: :meth:`encode` (special tokens such as a BOS added as the
    tokenizer's post-processor says, as transformers' tokenizers do) and :meth:`decode`."""

    path: Path
    impl: Any

    @property
    def vocab_size(self) -> int:
        return int(self.impl.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        ids = list(self.impl.encode(text).ids)
        if not ids:
            raise UsageError(f"{self.path}: the prompt {text!r} encodes to no tokens")
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return str(self.impl.decode([int(i) for i in ids], skip_special_tokens=skip_special))


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer of ``path`` (a ``tokenizer.json`` or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise UsageError(f"{p}: no such tokenizer file (text prompts need a {TOKENIZER_FILE})")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(
            f"{p}: reading text needs the `tokenizers` package (pip install 'dtm_mpi[llm]'); "
            "or give token ids"
        ) from None
    try:
        impl = Tokenizer.from_file(str(p))
    except Exception as exc:  # the package raises its own Exception subclasses
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"{p}: not a tokenizer the `tokenizers` package reads ({first})") from None
    return TextTokenizer(p, impl)
