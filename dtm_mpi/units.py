"""Option values as people write them (a command-line flag, a ``DTM_*`` variable). Byte counts: ``512``, ``64K``, ``1.5G``, ``2GiB``,
``8kb``. The one parser for every ``dtm`` option that takes a size (``--max-bytes-per-rank``,
``dtm bench ckpt --bytes``, ``dtm bench comm --sizes``). Units are binary (K = 2**10, M = 2**20,
G = 2**30, T = 2**40), case-insensitive, optionally followed by ``B`` or ``iB``. Pure: no
imports beyond the standard library and the error hierarchy."""

from __future__ import annotations

import math
import re

from dtm_mpi.errors import UsageError

__all__ = ["UNITS", "parse_bytes", "parse_ranks_per_file"]

UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_BYTES = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(ib|b)?", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``text`` as a whole, finite, non-negative number of bytes below 2**63 (a fraction is
    rounded down: ``1.5K`` is 1536). Raises :class:`~dtm_mpi.errors.UsageError` stating the
    rule and what was found."""
    m = _BYTES.fullmatch(text.strip())
    if m is None or (m.group(3) and m.group(3).lower() == "ib" and not m.group(2)):
        raise UsageError(
            f"not a byte count: {text!r} (a number >= 0 with an optional unit K, M, G or T, e.g. 512M, 2G, 1.5GiB)"
        )
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if not (math.isfinite(value) and value < 2**63):
        raise UsageError(f"byte count must be below 2**63; got {text!r}")
    return int(value)


def parse_ranks_per_file(text: str) -> int:
    """How many ranks share one data file of a checkpoint: an integer >= 1, or ``all`` (0:
    every rank of the save shares one file), case and surrounding space ignored. Raises
    :class:`~dtm_mpi.errors.UsageError` stating the rule and what was found (callers prefix
    the option's name)."""
    word = text.strip().lower()
    if word == "all":
        return 0
    if word.isascii() and word.isdigit() and int(word) >= 1:
        return int(word)
    raise UsageError(f"expected an integer >= 1 or all, got {text!r}")
