"""Broadcasts made in the layout they are used in.

A ``broadcast_to`` makes its new leading dims and its repeated size-1 dims unsharded (§8.8.3),
so a broadcast that meets a sharded operand is followed by a ``redistribute`` that only cuts
those dims: the loss gradient, a scalar repeated to ``[batch, seq, vocab]`` and then split over
``dp`` and ``tp``, or a rotary table repeated over the heads and then split over ``tp``. Run as
written, every rank makes the whole repeat and keeps its block. The plan instead makes each
rank's block directly: where every use of a broadcast is a redistribution that differs from the
broadcast's layout only on dims the broadcast made (unsharded there), the plan's broadcast has
the uses' layout and the redistributions have nothing left to do. Each rank's values are the
same (a repeat's block is a repeat); the IR, its hash and its meaning are unchanged. A
broadcast nothing uses (the builder leaves one behind where it reduces a pending operand
before repeating it, :meth:`~dtm_mpi.ir.build.FunctionBuilder.complete`) is not planned.
"""

from __future__ import annotations

from dataclasses import replace

from dtm_mpi.ir import registry
from dtm_mpi.ir.nodes import Function, Op
from dtm_mpi.ir.types import Layout, TensorType

__all__ = ["made_dims", "local_broadcasts"]


def made_dims(x: TensorType, r: TensorType) -> frozenset[int]:
    """The dims of ``r`` that a broadcast of ``x`` makes: the new leading ones and the
    repeated size-1 ones."""
    lead = r.rank - x.rank
    repeated = (lead + i for i, s in enumerate(x.shape) if s == 1 and r.shape[lead + i] != 1)
    return frozenset((*range(lead), *repeated))


def _cuts_only(made: frozenset[int], have: Layout, want: Layout) -> bool:
    """Whether ``want`` is ``have`` with only some of the unsharded ``made`` dims split."""
    if have.partial != want.partial or have == want:
        return False
    return all(
        a == b or (d in made and not a)
        for d, (a, b) in enumerate(zip(have.dims, want.dims, strict=True))
    )


def local_broadcasts(f: Function) -> tuple[Op, ...]:
    """``f``'s body with each broadcast that only its uses' redistributions cut given their
    layout (module doc), without the broadcasts nothing uses; the other ops as they are."""
    types: dict[str, TensorType] = {p.name: p.type for p in f.params}
    for op in f.body:
        types.update(zip(op.results, op.result_types, strict=True))
    uses: dict[str, list[Op]] = {}
    for op in f.body:
        for name in op.operands:
            uses.setdefault(name, []).append(op)
    body: list[Op | None] = list(f.body)
    for i, op in enumerate(f.body):
        if not registry.OPS[op.name].has(registry.Trait.BROADCASTS) or len(op.results) != 1:
            continue
        (name,), (have,) = op.results, op.result_types
        users = uses.get(name, [])
        if name in f.returns:
            continue
        if not users:  # left behind where a pending operand was reduced before repeating
            body[i] = None
            continue
        if any(u.name != "redistribute" for u in users):
            continue
        wants = {u.result_types[0].layout for u in users}
        if len(wants) != 1:
            continue
        (want,) = wants
        if _cuts_only(made_dims(types[op.operands[0]], have), have.layout, want):
            body[i] = replace(op, result_types=(have.with_layout(want),))
    return tuple(op for op in body if op is not None)
