"""The limits a reader of DTM IR 1.0 text enforces (docs/spec/ir.md, section 2.3).

One home for the parser's and the fast path's limits; the type token's limits (rank, dimension
size) live beside its parser in :mod:`dtm_mpi.ir.typetext` and the command line's input size in
:mod:`dtm_mpi.ir.source_files`. ``tests/ir/test_limits.py`` checks the values the specification states
against these constants.
"""

from __future__ import annotations

__all__ = ["MAX_INT_DIGITS", "MAX_LITERAL_DEPTH", "MAX_VERSION_CHARS"]

MAX_INT_DIGITS = 40
"""Most digits (the sign not counted) of an INTEGER token: attribute values, mesh sizes, seeds
and integer literal elements."""

MAX_LITERAL_DEPTH = 32
"""Most ``[`` a literal may nest."""

MAX_VERSION_CHARS = 20
"""Most characters of the header's version token ``MAJOR.MINOR``."""
