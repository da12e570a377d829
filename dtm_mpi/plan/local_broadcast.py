"""Broadcasts made in the layout they are used in.

A ``broadcast_to`` makes its new leading dims and its repeated size-1 dims unsharded (§8.8.3),
so a broadcast that meets a sharded operand is followed by a ``redistribute`` that only cuts
it: the loss gradient, a scalar repeated to ``[batch, seq, vocab]`` and then split over ``dp``
and ``tp``, or a rotary table repeated over the heads and then split over ``tp``. Run as
written, every rank makes the whole repeat and keeps its block. The plan instead makes each
rank's block directly: where every use of a broadcast is a redistribution to one layout that
only splits dims the broadcast leaves unsharded, the plan's broadcast has that layout and the
redistributions have nothing left to do; where the split dims include some the operand has
whole, the plan first cuts the operand to its block (locally, a ``redistribute`` of its own).
Each rank's values are the same (a repeat's block is a repeat); the IR, its hash and its
meaning are unchanged. A broadcast nothing uses (the builder leaves one behind where it
reduces a pending operand before repeating it, :meth:`~dtm_mpi.ir.build.FunctionBuilder.complete`)
is not planned.
"""

from __future__ import annotations

from dataclasses import replace

from dtm_mpi.ir import registry
from dtm_mpi.ir.nodes import Function, Op
from dtm_mpi.ir.types import Layout, TensorType

__all__ = ["local_broadcasts"]


def _operand_cut(x: TensorType, have: TensorType, want: Layout) -> Layout | None:
    """The layout of ``x`` whose broadcast is ``have`` in layout ``want``, where ``want`` is
    ``have``'s layout with only unsharded dims split (None otherwise): ``want``'s entries on the
    dims ``x`` has whole (its size there), ``x``'s own on its repeated size-1 dims."""
    lay = have.layout
    if lay.partial != want.partial or lay == want:
        return None
    if any(a != b and a for a, b in zip(lay.dims, want.dims, strict=True)):
        return None
    lead = have.rank - x.rank
    dims = tuple(
        x.layout.dims[i] if s == 1 and have.shape[lead + i] != 1 else want.dims[lead + i]
        for i, s in enumerate(x.shape)
    )
    return Layout(dims, x.layout.partial)


def _fresh(taken: set[str], base: str) -> str:
    name, k = f"{base}.block", 0
    while name in taken:
        k += 1
        name = f"{base}.block{k}"
    taken.add(name)
    return name


def local_broadcasts(f: Function) -> tuple[Op, ...]:
    """``f``'s body with each broadcast that only its uses' redistributions cut made in their
    layout (module doc), its operand cut first where the uses split a dim the operand has
    whole; without the broadcasts nothing uses; the other ops as they are."""
    types: dict[str, TensorType] = {p.name: p.type for p in f.params}
    for op in f.body:
        types.update(zip(op.results, op.result_types, strict=True))
    taken = set(types)
    uses: dict[str, list[Op]] = {}
    for op in f.body:
        for name in op.operands:
            uses.setdefault(name, []).append(op)
    body: list[Op] = []
    for op in f.body:
        if not registry.OPS[op.name].has(registry.Trait.BROADCASTS) or len(op.results) != 1:
            body.append(op)
            continue
        (name,), (have,) = op.results, op.result_types
        users = uses.get(name, [])
        if name in f.returns:
            body.append(op)
            continue
        if not users:  # left behind where a pending operand was reduced before repeating
            continue
        wants = {u.result_types[0].layout for u in users}
        x = types[op.operands[0]]
        cut = None
        if len(wants) == 1 and all(u.name == "redistribute" for u in users):
            cut = _operand_cut(x, have, next(iter(wants)))
        if cut is None:
            body.append(op)
            continue
        operand = op.operands[0]
        if cut != x.layout:  # the operand's block first: a local slice of it
            block = _fresh(taken, operand)
            body.append(
                Op("redistribute", (block,), (x.with_layout(cut),), (operand,), (), op.span)
            )
            operand = block
        body.append(replace(op, operands=(operand,), result_types=(have.with_layout(*wants),)))
    return tuple(body)
