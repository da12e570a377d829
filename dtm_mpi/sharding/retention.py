"""How much memory the MPI path keeps between steps, as pure numbers (the one home of these
facts: the communication layer keeps buffers by them, the planner counts them).

A collective's output of at least :data:`ALIGN_FROM` bytes is page-aligned and kept for reuse
by the next step's same collective, whatever its size (a fresh buffer of tens of MiB costs
page faults on every call: 64 MiB allgathers ran at 0.57 of raw MPI when only buffers up to
4 MiB were kept)
(``dtm_mpi.comm.buffers.OutputCache``); ``dtm explain`` adds the kept bytes to a rank's memory.
Not kept: the output of any redistribution of a state parameter (:func:`keeps_gather_of`).
Those are the gathers of parameters stored sharded (ZeRO-3): each is freed after its layer's
uses, and keeping it would hold every parameter whole between steps, what sharding them is
meant to save. A program that redistributes a state parameter for another reason pays a
fresh buffer for it each step too.
"""

from __future__ import annotations

from dtm_mpi.ir.nodes import Function

__all__ = ["ALIGN_FROM", "keeps_gather_of", "kept_bytes"]

ALIGN_FROM = 64 << 10
"""Below this many bytes an output buffer is not page-aligned (nor kept for reuse by MPI)."""


def kept_bytes(nbytes: int) -> int:
    """The bytes the MPI path keeps after a collective whose output on a rank is ``nbytes``."""
    return nbytes if nbytes >= ALIGN_FROM else 0


def keeps_gather_of(operand: str, function: Function) -> bool:
    """Whether a redistribution of value ``operand`` in ``function`` keeps its output for
    reuse: not when it is a state parameter of the function."""
    return not any(q.state and q.name == operand for q in function.params)
