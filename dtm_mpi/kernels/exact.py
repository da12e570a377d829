"""Reproducible arithmetic: the sums of deterministic mode, exact in any order and on any mesh.

A float sum depends on its order, and the order depends on the mesh: a contraction split over
``k`` ranks is added in ``k`` pieces, and the local BLAS blocks differently for different block
shapes. In deterministic mode (``DTM_DETERMINISTIC=1``) the ops that sum — ``matmul`` over K,
``sum``/``mean`` over dims, ``scatter_add`` at repeated indices — are computed so that no order
can change a bit (the idea of Ozaki's error-free matrix product and of Demmel-Nguyen's
pre-rounded sums):

1. Each group of addends (a row of the lhs over K, a column of the rhs, the elements reduced
   into one output) has its largest binary exponent ``e`` taken over the *whole* group, on
   every rank holding part of it (a max-allreduce of small integers where the group is split).
2. Every value is cut at fixed places below ``2^e`` into ``L`` integer slices of ``w`` bits
   (:func:`slices`); ``w`` follows from the group's global size, so that every sum of slices
   is an integer below ``2^53``. float64 BLAS and numpy add such integers exactly, in whatever
   order and blocking, and so do the ranks (an int64 allreduce).
3. The level sums are scaled back and added in one fixed order in float64, then rounded once to
   the result's dtype.

What is kept: for ``sum``/``mean``/``scatter_add``, every addend's bits down to 64 below its
group's largest (``w = 53 - bitlen(n)`` for ``n`` addends, as many slices as 64 bits need);
for ``matmul``, each operand's bits down to ``L w`` below its row's (column's) largest, with
``w = (51 - bitlen(K)) // 2`` (20 for K <= 1024, 18 for K <= 8192) and ``L`` = 2 (float32 and
narrower) or 3 (float64), the slice products with ``s + t >= L`` dropped. A matmul output is
so within ``K 2^(1 - L w)`` of (its row's largest) x (its column's largest) of the exact
product (2^-29 of it at K = 1024 in float32): an element far below its row's or column's
largest loses bits first. That is the ``full`` :class:`Precision`; ``fast`` keeps one slice
fewer (float32 and narrower: one slice of ``w = (53 - bitlen(K)) // 2`` bits rounded to
nearest, one float64 product instead of three). The kept value is rounded once, correctly (error-free sums of the
levels, round-to-odd, one rounding to nearest), except ``mean``, whose sum is rounded before
the division. Infinities and NaNs: an output whose terms include one gets what IEEE gives for
those terms alone (NaN for a NaN, for ``inf * 0`` or for both infinities, else the infinity),
counted exactly and so the same in any order. Zeros are ``+0.0`` and NaNs the one positive
quiet NaN (:func:`canonical`).

An op's exact form is an :class:`ExactRule`, attached here to the registry entry of each op that
sums floats (:data:`~dtm_mpi.ir.registry.Trait.SUMS`, :attr:`~dtm_mpi.ir.registry.OpDef.exact`);
the executor runs it in deterministic mode, doing the two allreduces where the result is a
pending sum. Every function here is pure numpy on host arrays.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dtm_mpi.ir.dtypes import as_dtype
from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.ops.index import scatter_window
from dtm_mpi.ir.registry import all_ops, attach_exact
from dtm_mpi.ir.types import DType, TensorType
from dtm_mpi.kernels.dispatch import KernelContext
from dtm_mpi.sharding.mesh import MeshShape

__all__ = [
    "NONFINITE_EXP",
    "ZERO_EXP",
    "ExactRule",
    "Levels",
    "Precision",
    "applies",
    "exact_rule",
    "canonical",
    "exact_axes",
    "pending_axes",
    "exponents",
    "slices",
]

Arr = np.ndarray

ZERO_EXP = -4096
"""The exponent of a zero: below every float64's, so a zero never widens its group."""
NONFINITE_EXP = 4096
"""The exponent of an infinity or NaN: above every finite one, so a group holding one says so."""
SUM_BITS = 64
"""How many bits below its group's largest a sum keeps of every element."""


class Precision(enum.Enum):
    """What deterministic mode's matmul keeps of its operands (``DTM_DETERMINISTIC_MATMUL``):
    ``full``, two slices (float64: three) of ``w`` bits below each row's (column's) largest,
    the result nearly always the correctly rounded product; ``fast``, one slice fewer, for
    float32 and narrower one slice rounded to nearest (``w`` = 21 bits at K <= 1024, 20 at
    K <= 4096): one float64 product instead of three, an rms error about 3x a float32 GEMM's
    at K = 1024 (6x at K = 4096); float64 two slices (three products instead of six)."""

    FULL = "full"
    FAST = "fast"


def exponents(x: Arr) -> Arr:
    """Each element's binary exponent ``e`` with ``|x| < 2^e`` (int64): :data:`ZERO_EXP` for
    zeros, :data:`NONFINITE_EXP` for infinities and NaNs."""
    v = np.asarray(x, dtype=np.float64)
    _, e = np.frexp(v)
    out = e.astype(np.int64)
    out[v == 0] = ZERO_EXP
    out[~np.isfinite(v)] = NONFINITE_EXP
    return out


def group_exponent(x: Arr, axis: tuple[int, ...]) -> Arr:
    """The largest of :func:`exponents` of ``x`` over ``axis`` (kept as size-1 dims), in one
    pass over ``x``: an exponent grows with the magnitude, so a group's largest is its largest
    magnitude's (an infinity or NaN in the group makes that magnitude non-finite,
    :data:`NONFINITE_EXP`; an empty or all-zero group gives :data:`ZERO_EXP`)."""
    v = np.asarray(x)
    hi = np.max(v, axis=axis, keepdims=True, initial=0)
    lo = np.min(v, axis=axis, keepdims=True, initial=0)
    with np.errstate(invalid="ignore"):
        return exponents(np.maximum(hi, -lo))


def _power_of_two(shift: Arr) -> Arr | None:
    """``2.0 ** shift`` (float64) where every shift gives a normal float64, else None: then
    multiplying by it is exactly :func:`numpy.ldexp` by ``shift``."""
    if shift.size and (int(shift.min()) < -1022 or int(shift.max()) > 1023):
        return None
    return np.ldexp(1.0, shift.astype(np.int32))


def slices(
    x: Arr,
    e: Arr,
    w: int,
    count: int,
    into: Sequence[Arr] | None = None,
    *,
    nearest: bool = False,
) -> list[Arr]:
    """``x`` cut into ``count`` integer-valued float64 slices of ``w`` bits below ``2^e``
    (``e`` broadcast against ``x``, at least each element's exponent): ``x`` equals
    ``sum(s_l * 2^(e - (l + 1) w))`` up to a remainder below ``2^(e - count w)``. Infinities
    and NaNs give zero slices (their outputs are counted apart). ``into``: arrays of ``x``'s
    shape the slices are written to (returned). ``nearest``: the last slice is rounded to
    nearest (at most ``2^w`` in magnitude, the remainder at most half its unit) instead of
    truncated."""
    special = e >= NONFINITE_EXP
    zero = e <= ZERO_EXP
    # a group's shift: w - e; an all-zero group's values stay zeros at any shift (0 here),
    # a group with an infinity or NaN gives zero slices of its finite values (scale 0)
    shift = np.where(special | zero, 0, w - np.asarray(e, np.int64))
    scale = _power_of_two(shift)
    if scale is None:  # a float64 group beyond the normal range: ldexp rounds the subnormals
        v = np.where(np.isfinite(x), np.asarray(x, np.float64), 0.0)
        v = np.ldexp(v, np.where(special, -2000, shift).astype(np.int32))
    else:  # x to float64 and the scaling in one pass (both exact); v is our own array
        v = np.multiply(x, np.where(special, 0.0, scale), dtype=np.float64)
        if special.any():  # inf * 0 and NaN * 0 are NaN: zero slices
            v[np.isnan(v)] = 0.0
    out = []
    step = float(2**w)
    for level in range(count):
        cut = np.rint if nearest and level + 1 == count else np.trunc
        q = cut(v, out=None if into is None else into[level])
        out.append(q)
        if level + 1 < count:
            v -= q  # the fraction, exact
            v *= step
    return out


def _two_sum(a: Arr, b: Arr) -> tuple[Arr, Arr]:
    """``(s, err)`` with ``s = fl(a + b)`` and ``s + err == a + b`` exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _scale_back(levels: Arr, e: Arr, w: int, first: int) -> tuple[Arr, Arr | None]:
    """``sum(levels[l] * 2^(e - (l + first) w))`` as ``hi + lo`` (``hi`` the float64 nearest
    to it, ``lo`` the rest), added smallest level first with error-free sums: one fixed
    order, whatever the mesh."""
    return _sum_terms(
        lambda level: np.ldexp(
            levels[level].astype(np.float64), (e - (level + first) * w).astype(np.int32)
        ),
        levels.shape[0],
    )


def _sum_terms(term: Callable[[int], Arr], count: int) -> tuple[Arr, Arr | None]:
    """``sum(term(l))`` over the levels as ``hi + lo``, the last level first, error-free
    (``lo`` None: zero, one level)."""
    hi = term(count - 1)  # two_sum(0, t) is (t, 0): the first addition is the term itself
    if count == 1:
        return hi, None
    lo = np.zeros_like(hi)
    for level in range(count - 2, -1, -1):
        hi, err = _two_sum(hi, term(level))
        lo += err
    if not np.isfinite(hi).all():  # past the largest float64: IEEE's infinity (its error
        lo[~np.isfinite(hi)] = 0.0  # term, inf - inf, would make the sum NaN)
    return _two_sum(hi, lo)


def _odd(x: Arr, rest: Arr, dtype: type) -> Arr:
    """``x + rest`` (``rest`` beyond ``x``'s precision: only its sign matters) rounded to
    ``dtype`` by round-to-odd: ``x`` cast, then moved to its odd neighbour towards the value
    when inexact. Rounding that result once more to nearest (to a format at least 2 bits
    narrower) rounds the exact value correctly: no double rounding."""
    c: Arr = x.astype(dtype)
    back = c.astype(np.float64)
    below = np.where(back != x, x - back, 0.0) + np.where(back == x, rest, 0.0)  # what c misses
    bits: Arr = c.view(np.uint32 if dtype is np.float32 else np.uint64)
    even = (bits & 1) == 0
    fix = (below != 0) & even & np.isfinite(c)
    return np.where(fix, np.nextafter(c, np.where(below > 0, np.inf, -np.inf).astype(dtype)), c)


def _rounded(hi: Arr, lo: Arr | None, t: TensorType) -> Arr:
    """``hi + lo`` rounded once, to nearest, to ``t``'s dtype (bf16 values as float32; ``lo``
    None: zero)."""
    if t.dtype is DType.F64:
        return hi  # hi is already the nearest float64
    if t.dtype is DType.BF16:  # odd float32, then bf16's one rounding
        return as_dtype(_odd(hi, np.zeros_like(hi) if lo is None else lo, np.float32), t)
    if lo is None:
        return as_dtype(hi, t)  # hi is the value: one rounding
    return as_dtype(_odd64(hi, lo), t)  # odd float64, then the one rounding


def _odd64(hi: Arr, lo: Arr) -> Arr:
    """``hi + lo`` as the float64 rounded to odd (``hi`` nearest, ``lo`` the exact rest)."""
    fix = lo != 0
    fix &= (hi.view(np.uint64) & 1) == 0
    fix &= np.isfinite(hi)
    out = hi.copy()
    out[fix] = np.nextafter(hi[fix], np.copysign(np.inf, lo[fix]))
    return out


def _special_value(counts: Arr) -> Arr:
    """What IEEE gives for a sum whose terms include ``counts = [+inf terms, -inf terms,
    NaN terms]`` (finite terms cannot change it): NaN for a NaN or both infinities, else the
    infinity. The same in any order."""
    pos, neg, nan = counts[0] > 0, counts[1] > 0, counts[2] > 0
    return np.where(nan | (pos & neg), np.nan, np.where(pos, np.inf, -np.inf))


def canonical(x: Arr) -> Arr:
    """``-0.0`` as ``+0.0`` and every NaN as the one positive quiet NaN (the sign and payload
    of a NaN, and the sign of a zero, depend on the order of operations)."""
    out = np.where(x == 0, np.zeros((), x.dtype), x)
    return np.where(np.isnan(out), np.array(np.nan, x.dtype), out)


@dataclass(frozen=True, slots=True)
class Levels:
    """A rank's part of an exact result: integer level sums (int64, ``[L, *block]``) and,
    where some output is reached by an infinity or NaN, the counts of its terms that are
    +inf, -inf and NaN (int64, ``[3, *block]``); both are summed over the ranks of a pending
    sum exactly, in any order."""

    levels: Arr
    specials: Arr | None


@dataclass(frozen=True, slots=True)
class ExactRule:
    """How deterministic mode computes one op exactly on a rank's blocks.

    ``exponents(ctx, xs)``: the groups' largest exponents (one int64 array; max-allreduced
    over the pending sum's axes); ``levels(ctx, xs, exps, precision)``: this rank's
    :class:`Levels` (sum-allreduced); ``finish(ctx, levels, exps, precision)``: the result
    block (the result's dtype). ``precision`` is the run's :class:`Precision` (the matmul's)."""

    exponents: Callable[[KernelContext, Sequence[Arr]], Arr]
    levels: Callable[[KernelContext, Sequence[Arr], Arr, Precision], Levels]
    finish: Callable[[KernelContext, Levels, Arr, Precision], Arr]


def exact_rule(op: Op) -> ExactRule | None:
    """The exact form of ``op`` (from its registry entry), if it sums floats."""
    entry = all_ops().get(op.name)
    if entry is None or entry.exact is None or not op.result_types[0].dtype.is_float:
        return None
    assert isinstance(entry.exact, ExactRule), op.name
    return entry.exact


def applies(op: Op) -> bool:
    """Whether an op's exact form is needed: it has one and sums floats."""
    return exact_rule(op) is not None


def pending_axes(t: TensorType, mesh: MeshShape) -> tuple[str, ...]:
    """The axes over which a value of type ``t`` is a pending sum across ranks: its pending
    sum's axes longer than 1, in their order (none when ``t`` is not pending)."""
    partial = t.layout.partial
    if partial is None:
        return ()
    return tuple(a for a in partial.axes if mesh.axis_size(a) > 1)


def exact_axes(op: Op, mesh: MeshShape) -> tuple[str, ...]:
    """The axes over which the exact form of ``op`` sums its pending result across ranks."""
    return pending_axes(op.result_types[0], mesh)


def _nonfinite(e: Arr) -> Arr:
    return e >= NONFINITE_EXP


# --- matmul ------------------------------------------------------------------------------------


def _matmul_plan(ctx: KernelContext, precision: Precision) -> tuple[int, int]:
    """(slices per operand, bits per slice) of a matmul: level ``d`` adds the ``d + 1`` slice
    products ``s + t = d`` over K, ``(d + 1) K 2^(2w) <= 2^53`` (one slice rounded to
    nearest: ``K 2^(2w) < 2^53``)."""
    k = ctx.operand_types[0].shape[-1]
    count = 3 if ctx.result_types[0].dtype is DType.F64 else 2
    if precision is Precision.FAST:
        count -= 1
    if count == 1:
        return 1, (53 - max(k, 1).bit_length()) // 2
    return count, (53 - max(k, 1).bit_length() - count.bit_length()) // 2


def _matmul_exponents(ctx: KernelContext, xs: Sequence[Arr]) -> Arr:
    a, b = xs
    rows = group_exponent(a, (-1,))[..., 0]  # [..., M]
    cols = group_exponent(b, (-2,))[..., 0, :]  # [..., N]
    return np.concatenate([rows, cols], axis=-1)


def _split(ctx: KernelContext, exps: Arr) -> tuple[Arr, Arr]:
    """The lhs rows' and the rhs columns' exponents."""
    m = ctx.local_shapes[0][-2]
    return exps[..., :m], exps[..., m:]


def _matmul_levels(
    ctx: KernelContext, xs: Sequence[Arr], exps: Arr, precision: Precision
) -> Levels:
    a, b = xs
    count, w = _matmul_plan(ctx, precision)
    one = count == 1  # one slice, rounded to nearest
    rows, cols = _split(ctx, exps)
    k = a.shape[-1]
    # the lhs slices side by side along K, the rhs ones stacked in reverse: level d, the
    # products s + t = d, is one product over (d + 1) K of a prefix and a suffix of these
    lhs = np.empty((*a.shape[:-1], count * k), np.float64)
    rhs = np.empty((*b.shape[:-2], count * k, b.shape[-1]), np.float64)
    slices(
        a,
        rows[..., :, None],
        w,
        count,
        [lhs[..., i * k : (i + 1) * k] for i in range(count)],
        nearest=one,
    )
    slices(
        b,
        cols[..., None, :],
        w,
        count,
        [rhs[..., (count - 1 - i) * k : (count - i) * k, :] for i in range(count)],
        nearest=one,
    )
    levels = np.empty(
        (count, *np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1]),
        np.int64,
    )
    for d in range(count):
        levels[d] = np.matmul(lhs[..., : (d + 1) * k], rhs[..., (count - 1 - d) * k :, :])
    special = _nonfinite(rows)[..., :, None] | _nonfinite(cols)[..., None, :]
    return Levels(levels, _matmul_specials(a, b) if special.any() else None)


def _matmul_specials(a: Arr, b: Arr) -> Arr:
    """The +inf, -inf and NaN terms ``a[i, k] * b[k, j]`` of every output, counted by
    products of 0/1 matrices (exact)."""

    def ind(x: Arr) -> dict[str, Arr]:
        v = np.asarray(x, np.float64)
        with np.errstate(invalid="ignore"):
            return {
                "pi": (v == np.inf) * 1.0,
                "ni": (v == -np.inf) * 1.0,
                "nan": np.isnan(v) * 1.0,
                "p": (v > 0) * 1.0,
                "n": (v < 0) * 1.0,
                "z": (v == 0) * 1.0,
            }

    x, y = ind(a), ind(b)
    mm = np.matmul
    pos = mm(x["pi"], y["p"]) + mm(x["ni"], y["n"]) + mm(x["p"], y["pi"]) + mm(x["n"], y["ni"])
    neg = mm(x["pi"], y["n"]) + mm(x["ni"], y["p"]) + mm(x["p"], y["ni"]) + mm(x["n"], y["pi"])
    nan = (
        mm(x["nan"], np.ones_like(y["nan"]))
        + mm(np.ones_like(x["nan"]), y["nan"])
        + mm(x["pi"] + x["ni"], y["z"])
        + mm(x["z"], y["pi"] + y["ni"])
    )
    return np.stack([pos, neg, nan]).astype(np.int64)


def _matmul_finish(ctx: KernelContext, got: Levels, exps: Arr, precision: Precision) -> Arr:
    _, w = _matmul_plan(ctx, precision)
    rows, cols = _split(ctx, exps)
    special = _nonfinite(rows)[..., :, None] | _nonfinite(cols)[..., None, :]
    hi, lo = _matmul_sum(got.levels, rows, cols, w)
    if got.specials is not None:
        hi = np.where(special, _special_value(got.specials), hi)
    return _rounded(hi, lo, ctx.result_types[0])


def _matmul_sum(levels: Arr, rows: Arr, cols: Arr, w: int) -> tuple[Arr, Arr | None]:
    """The levels scaled back (:func:`_scale_back` at ``rows + cols``), by a row's and a
    column's power of two where every product stays normal (then exact, the same bits as one
    ldexp), else by ldexp. An output whose row or column holds an infinity or NaN (replaced
    later) and an all-zero row's or column's (zero levels) take shift 0."""

    def shifts(e: Arr) -> Arr:
        out: Arr = np.where((e >= NONFINITE_EXP) | (e <= ZERO_EXP), 0, e)
        return out

    r, c = shifts(rows), shifts(cols)
    count = levels.shape[0]
    lo_r, hi_r = int(r.min(initial=0)) - (count + 1) * w, int(r.max(initial=0)) - 2 * w
    lo_c, hi_c = int(c.min(initial=0)), int(c.max(initial=0))
    if min(lo_r, lo_c, lo_r + lo_c) >= -1022 and max(hi_r, hi_c, hi_r + hi_c) <= 1023 - 64:
        col_scale = np.ldexp(1.0, c.astype(np.int32))[..., None, :]
        return _sum_terms(
            lambda level: (
                levels[level]
                * np.ldexp(1.0, (r - (level + 2) * w).astype(np.int32))[..., :, None]
                * col_scale
            ),
            count,
        )
    e = r[..., :, None] + c[..., None, :]
    return _scale_back(levels, e, w, 2)


# --- sum and mean ------------------------------------------------------------------------------


def _reduce_dims(ctx: KernelContext) -> tuple[int, ...]:
    rank = ctx.operand_types[0].rank
    dims: tuple[int, ...] = ctx.op.attr("dims")  # type: ignore[assignment]
    return tuple(sorted(int(d) % rank for d in dims))


def _count(ctx: KernelContext) -> int:
    return math.prod(ctx.operand_types[0].shape[d] for d in _reduce_dims(ctx))


def _sum_plan(n: int) -> tuple[int, int]:
    """(slices, bits per slice) of a sum of ``n`` addends: ``n 2^w <= 2^53``."""
    w = 53 - max(n, 1).bit_length()
    return max(2, -(-SUM_BITS // w)), w


def _sum_exponents(ctx: KernelContext, xs: Sequence[Arr]) -> Arr:
    return group_exponent(xs[0], _reduce_dims(ctx))


def _sum_levels(ctx: KernelContext, xs: Sequence[Arr], exps: Arr, _precision: Precision) -> Levels:
    dims = _reduce_dims(ctx)
    count, w = _sum_plan(_count(ctx))
    parts = slices(xs[0], exps, w, count)
    levels = np.stack([np.sum(s, axis=dims, keepdims=True).astype(np.int64) for s in parts])
    specials = None
    if _nonfinite(exps).any():
        v = np.asarray(xs[0], np.float64)
        specials = np.stack([np.sum(m, axis=dims, keepdims=True) for m in _special_terms(v)])
    return Levels(levels, specials)


def _special_terms(v: Arr) -> tuple[Arr, Arr, Arr]:
    """Which values are +inf, -inf and NaN (int64 0/1)."""
    return (
        (v == np.inf).astype(np.int64),
        (v == -np.inf).astype(np.int64),
        np.isnan(v).astype(np.int64),
    )


def _sum_finish(ctx: KernelContext, got: Levels, exps: Arr, _precision: Precision) -> Arr:
    _, w = _sum_plan(_count(ctx))
    special = _nonfinite(exps)
    hi, lo = _scale_back(got.levels, np.where(special, 0, exps), w, 1)
    assert lo is not None  # (a sum has two levels at least: _sum_plan)
    if got.specials is not None:
        hi = np.where(special, _special_value(got.specials), hi)
    t = ctx.result_types[0]
    if ctx.op.name == "mean":  # the sum rounded to odd, then divided (rounded) by the count
        n = _count(ctx)
        hi = _odd64(hi, lo) / n if n else hi * np.nan
        lo = np.zeros_like(hi)
    if not ctx.op.attr("keepdims"):
        hi, lo = np.squeeze(hi, axis=_reduce_dims(ctx)), np.squeeze(lo, axis=_reduce_dims(ctx))
    return _rounded(hi, lo, t)


# --- scatter_add -------------------------------------------------------------------------------


def _scatter_window(ctx: KernelContext, xs: Sequence[Arr]) -> tuple[int, int, Arr, Arr]:
    """(dim, block rows, the updates' block-relative indices, their rows moved to axis 0)."""
    d = int(ctx.op.attr("dim"))  # type: ignore[arg-type]
    lo, n, size = ctx.offsets[0][d], ctx.local_shapes[0][d], ctx.result_types[0].shape[d]
    flat, rows = scatter_window(xs[0], xs[1], d, lo, n, size, ctx.operand_offsets[1])
    return d, n, flat, np.moveaxis(rows, d, 0)


def _scatter_plan(ctx: KernelContext) -> tuple[int, int]:
    return _sum_plan(math.prod(ctx.operand_types[1].shape))


def _scatter_exponents(ctx: KernelContext, xs: Sequence[Arr]) -> Arr:
    d, _, flat, rows = _scatter_window(ctx, xs)
    out = np.full(ctx.local_shapes[0], ZERO_EXP, dtype=np.int64)
    np.maximum.at(np.moveaxis(out, d, 0), flat, exponents(rows))
    return out


def _scatter_levels(
    ctx: KernelContext, xs: Sequence[Arr], exps: Arr, _precision: Precision
) -> Levels:
    d, _, flat, rows = _scatter_window(ctx, xs)
    count, w = _scatter_plan(ctx)
    at = np.moveaxis(exps, d, 0)
    parts = slices(rows, at[flat], w, count)
    levels = np.zeros((count, *ctx.local_shapes[0]), dtype=np.float64)
    for level, part in enumerate(parts):
        np.add.at(np.moveaxis(levels[level], d, 0), flat, part)  # integers below 2^53: exact
    specials = None
    if _nonfinite(exps).any():
        specials = np.zeros((3, *ctx.local_shapes[0]), dtype=np.int64)
        for k, m in enumerate(_special_terms(np.asarray(rows, np.float64))):
            np.add.at(np.moveaxis(specials[k], d, 0), flat, m)
    return Levels(levels.astype(np.int64), specials)


def _scatter_finish(ctx: KernelContext, got: Levels, exps: Arr, _precision: Precision) -> Arr:
    _, w = _scatter_plan(ctx)
    special = _nonfinite(exps)
    hi, lo = _scale_back(got.levels, np.where(special, 0, exps), w, 1)
    if got.specials is not None:
        hi = np.where(special, _special_value(got.specials), hi)
    return _rounded(hi, lo, ctx.result_types[0])


attach_exact("matmul", ExactRule(_matmul_exponents, _matmul_levels, _matmul_finish))
attach_exact("sum", ExactRule(_sum_exponents, _sum_levels, _sum_finish))
attach_exact("mean", ExactRule(_sum_exponents, _sum_levels, _sum_finish))
attach_exact("scatter_add", ExactRule(_scatter_exponents, _scatter_levels, _scatter_finish))
