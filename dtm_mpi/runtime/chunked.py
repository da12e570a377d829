"""Fused elementwise chains on the CPU: a chain (:func:`~dtm_mpi.plan.fusion.fusion_groups`)
larger than a core's cache run at its root over blocks of rows, each op the numpy backend's own
prepared call (the op-by-op results bit for bit), so the intermediates stay in cache instead of
one full-size array per op (``DTM_FUSE``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dtm_mpi.cpu_cache import CHUNK_ELEMS
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.registry import OPS, Trait
from dtm_mpi.kernels.dispatch import PreparedKernel
from dtm_mpi.plan.fusion import FusedGroup
from dtm_mpi.plan.program import FunctionPlan

__all__ = [
    "MIN_CHUNKED_ELEMS",
    "Chunked",
    "chunkable",
    "chunked_chain",
    "run_chunked",
]


MIN_CHUNKED_ELEMS = 131072
"""The smallest chain run in chunks: below it the arrays fit in a core's cache anyway, and
op by op is as fast (measured: a 9-op chain over 512x4096 float32 1.5x faster in chunks,
over 256x1024 1.4x, a 1-d chain of 65,536 elements 1.7x slower)."""

ChainOp = tuple["PreparedKernel | None", tuple[str, ...], str, tuple[str, ...]]
"""One op of a chain: its prepared call (``None``: a bias broadcast, its vector aliased), operand
names, result name, and the intermediates it reads last (dropped after it)."""


@dataclass(frozen=True, slots=True)
class Chunked:
    """A fused elementwise chain as the CPU runs it: its inputs, its ops in order, the result
    name, local shape and dtype."""

    inputs: tuple[str, ...]
    steps: tuple[ChainOp, ...]
    result: str
    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]


def chunkable(fp: FunctionPlan, g: FusedGroup, local_elems: int) -> bool:
    """Whether the CPU runs group ``g`` in chunks (``local_elems``: its result's local size):
    large enough, and every member an elementwise op with an array function (the numpy
    backend's prepared call) or an absorbed bias broadcast."""
    if local_elems < MIN_CHUNKED_ELEMS:
        return False
    for m in g.members:
        entry = OPS[fp.ops[m].op.name]
        if not (entry.has(Trait.ELEMENTWISE) and entry.array_fn is not None) and not entry.has(
            Trait.BROADCASTS
        ):
            return False
    return True


def chunked_chain(
    fp: FunctionPlan,
    g: FusedGroup,
    prepared: Callable[[int], PreparedKernel | None],
    shape: tuple[int, ...],
) -> Chunked:
    """Group ``g`` as the CPU runs it (``prepared(i)``: op ``i``'s prepared call; ``shape``: the
    result's local shape)."""
    steps: list[ChainOp] = []
    made: set[str] = set()  # the chain's intermediates: each read once, then dropped
    for m in g.members:
        op = fp.ops[m].op
        broadcast = OPS[op.name].has(Trait.BROADCASTS)
        names = (op.operands[0],) if broadcast else op.operands
        call = None if broadcast else prepared(m)  # a bias: aliased
        steps.append(
            (call, names, op.results[0], tuple(n for n in dict.fromkeys(names) if n in made))
        )
        made.add(op.results[0])
    t = fp.ops[g.root].op.result_types[0]
    return Chunked(tuple(dict.fromkeys(g.inputs)), tuple(steps), g.result, shape, np_dtype(t.dtype))


def run_chunked(plan: Chunked, xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Run a chain over blocks of :data:`CHUNK_ELEMS` elements of rows (module doc)."""
    shape = plan.shape
    if len(shape) == 1:  # a vector: rows of one (a bias vector is the whole vector too)
        shape2 = (shape[0], 1)
        flat = [x.reshape(shape2) for x in xs]
    else:
        shape2 = (math.prod(shape[:-1]), shape[-1])
        flat = [x if x.ndim == 1 else x.reshape(shape2) for x in xs]  # (1-d: a bias vector)
    rows, cols = shape2
    step = max(1, CHUNK_ELEMS // max(cols, 1))
    out = np.empty(shape2, dtype=plan.dtype)
    for r0 in range(0, rows, step):
        env = {
            n: (x if x.ndim == 1 else x[r0 : r0 + step])
            for n, x in zip(plan.inputs, flat, strict=True)
        }
        for call, names, result, drops in plan.steps:
            env[result] = env[names[0]] if call is None else call([env[n] for n in names])[0]
            for n in drops:
                del env[n]
        out[r0 : r0 + step] = env[plan.result]
    return (out.reshape(shape),)
