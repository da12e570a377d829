"""Reading IR source files for the command line: unreadable files and binary garbage are
usage errors (exit 2), never tracebacks."""

from __future__ import annotations

from pathlib import Path

from dtm_mpi.errors import UsageError

__all__ = ["read_source"]

MAX_SOURCE_BYTES = 1 << 30


def read_source(path: str) -> str:
    """The text of an IR file; raises :class:`UsageError` with a one-line reason."""
    p = Path(path)
    try:
        if p.is_dir():
            raise UsageError(f"{path}: is a directory, not a .dtm file")
        data = p.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except PermissionError:
        raise UsageError(f"{path}: permission denied") from None
    except OSError as err:
        raise UsageError(f"{path}: cannot read: {err.strerror or err}") from None
    if len(data) > MAX_SOURCE_BYTES:
        raise UsageError(f"{path}: {len(data)} bytes is larger than the 1 GiB limit for IR text")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise UsageError(f"{path}: binary data (NUL byte at offset {nul}), not DTM IR text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(
            f"{path}: not UTF-8 text (bad byte at offset {err.start}), not DTM IR text"
        ) from None
