"""How much memory the MPI path keeps between steps, as pure numbers (the one home of these
facts: the communication layer keeps buffers by them, the planner counts them).

A collective's output of at least :data:`ALIGN_FROM` bytes is page-aligned and, up to
:data:`REUSE_UP_TO` bytes, kept for reuse by the next step's same collective
(``dtm_mpi.comm.buffers.OutputCache``); ``dtm explain`` adds the kept bytes to a rank's memory.
"""

from __future__ import annotations

__all__ = ["ALIGN_FROM", "REUSE_UP_TO", "kept_bytes"]

ALIGN_FROM = 64 << 10
"""Below this many bytes an output buffer is not page-aligned (nor kept for reuse by MPI)."""

REUSE_UP_TO = 4 << 20
"""Above this many bytes an output buffer is not kept for reuse."""


def kept_bytes(nbytes: int) -> int:
    """The bytes the MPI path keeps after a collective whose output on a rank is ``nbytes``."""
    return nbytes if ALIGN_FROM <= nbytes <= REUSE_UP_TO else 0
