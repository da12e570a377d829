"""How much memory the MPI path keeps between steps, as pure numbers (the one home of these
facts: the communication layer keeps buffers by them, the planner counts them).

A collective's output of at least :data:`ALIGN_FROM` bytes is page-aligned and kept for reuse
by the next step's same collective, whatever its size (a fresh buffer of tens of MiB costs
page faults on every call: 64 MiB allgathers ran at 0.57 of raw MPI when only buffers up to
4 MiB were kept)
(``dtm_mpi.comm.buffers.OutputCache``); ``dtm explain`` adds the kept bytes to a rank's memory.
"""

from __future__ import annotations

__all__ = ["ALIGN_FROM", "kept_bytes"]

ALIGN_FROM = 64 << 10
"""Below this many bytes an output buffer is not page-aligned (nor kept for reuse by MPI)."""


def kept_bytes(nbytes: int) -> int:
    """The bytes the MPI path keeps after a collective whose output on a rank is ``nbytes``."""
    return nbytes if nbytes >= ALIGN_FROM else 0
