"""The cross-rank part of deterministic mode's exact sums (:mod:`dtm_mpi.kernels.exact` holds
the per-block numerics): an op whose result is a pending sum over mesh axes computes its exact
form on every rank of the group together, through the communication interface
(:class:`~dtm_mpi.comm.interface.Comm`), so every rank of the group ends with the whole
result, the same bits on every mesh.

The protocol, for one op over the axes of its pending result:

1. every rank computes the largest exponent of each output's terms on its blocks;
   the group max-allreduces them (max is exact in any order);
2. every rank splits its terms at those exponents into integer levels (and counts its terms
   that are +inf, -inf or NaN); the group sum-allreduces the levels and the counts (integer
   sums are exact in any order);
3. every rank rounds the summed levels once to the result's dtype.

A rank whose operand repeats the group's first rank's (a *resolved* pending sum, whole on
every rank of its group) contributes zero levels: the group's first rank alone counts it.

Collective over the group: every rank of the group calls :func:`exact_across` for the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtm_mpi.comm.interface import Comm
from dtm_mpi.ir.types import ReduceOp
from dtm_mpi.kernels.dispatch import KernelContext
from dtm_mpi.kernels.exact import ExactRule, Levels, Precision, canonical, exact_axes
from dtm_mpi.sharding.steps import allreduce_spec

__all__ = ["exact_across"]


def _allreduce(comm: Comm, x: np.ndarray, axes: tuple[str, ...], op: ReduceOp) -> np.ndarray:
    return comm.allreduce(x, axes, allreduce_spec(comm.mesh, comm.rank, axes, op, int(x.size)))


def exact_across(
    rule: ExactRule,
    ctx: KernelContext,
    xs: Sequence[np.ndarray],
    comm: Comm,
    *,
    duplicate: bool,
    precision: Precision,
) -> np.ndarray:
    """The exact result block of ``ctx.op`` on this rank, from its host operand blocks ``xs``
    (module doc); ``duplicate``: this rank's operand repeats the group's first rank's (it
    contributes nothing); ``precision``: the matmul's (the same on every rank). Without
    pending axes it is the op's exact form on this rank alone.

    Collective over the op's pending group."""
    axes = exact_axes(ctx.op, comm.mesh)
    with np.errstate(all="ignore"):  # IEEE results (inf, nan) are the op's semantics
        exps = rule.exponents(ctx, xs)
        if axes:
            exps = _allreduce(comm, exps, axes, ReduceOp.MAX)
        got = rule.levels(ctx, xs, exps, precision)
        if axes:
            levels, specials = got.levels, got.specials
            if duplicate:  # this rank's operand repeats the first rank's: no contribution
                levels = np.zeros_like(levels)
                specials = None if specials is None else np.zeros_like(specials)
            if specials is not None:  # where an infinity or NaN is: counted, order-free
                specials = _allreduce(comm, specials, axes, ReduceOp.SUM)
            got = Levels(_allreduce(comm, levels, axes, ReduceOp.SUM), specials)
        return np.asarray(
            canonical(rule.finish(ctx, got, exps, precision)), order="C"
        )  # (0-d stays 0-d)
