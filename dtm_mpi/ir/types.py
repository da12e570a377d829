"""IR value types: dtypes, per-dimension layouts with pending reductions, tensor types.

Written form (see docs/spec/ir.md, "Types"): ``f32[64,256]{dp,-} partial(sum: tp)``

* ``f32`` the dtype; ``[64,256]`` the global shape (``[]`` for a scalar);
* ``{dp,-}`` the layout, one entry per dimension: ``-`` replicated, ``dp`` sharded over mesh
  axis ``dp``, ``(dp,tp)`` sharded over ``dp`` then ``tp`` (``dp`` major). Omitted: every
  dimension replicated;
* ``partial(sum: tp)``: the tensor is a pending reduction over the listed mesh axes; the
  global value is the reduction (``sum``, ``max``, ``min`` or ``prod``) of the per-rank values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["DType", "Layout", "Partial", "ReduceOp", "TensorType", "REPLICATED_DIM"]


class DType(enum.Enum):
    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"
    F64 = "f64"
    I8 = "i8"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"
    BOOL = "bool"

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def numpy_name(self) -> str:
        """The numpy dtype name (bf16 is stored as its raw 16 bits: ``uint16``)."""
        return _NUMPY_NAME[self]

    def __str__(self) -> str:
        return self.value


_FLOATS = frozenset({DType.F16, DType.BF16, DType.F32, DType.F64})
_INTS = frozenset({DType.I8, DType.I32, DType.I64, DType.U8})
_ITEMSIZE = {
    DType.F16: 2,
    DType.BF16: 2,
    DType.F32: 4,
    DType.F64: 8,
    DType.I8: 1,
    DType.I32: 4,
    DType.I64: 8,
    DType.U8: 1,
    DType.BOOL: 1,
}
_NUMPY_NAME = {
    DType.F16: "float16",
    DType.BF16: "uint16",
    DType.F32: "float32",
    DType.F64: "float64",
    DType.I8: "int8",
    DType.I32: "int32",
    DType.I64: "int64",
    DType.U8: "uint8",
    DType.BOOL: "bool",
}
DTYPE_NAMES = tuple(d.value for d in DType)


class ReduceOp(enum.Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    def __str__(self) -> str:
        return self.value


REPLICATED_DIM: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Partial:
    """A pending reduction ``op`` over mesh ``axes`` (in mesh order as written)."""

    op: ReduceOp
    axes: tuple[str, ...]

    def __str__(self) -> str:
        return f"partial({self.op.value}: {', '.join(self.axes)})"

    def without(self, axes: tuple[str, ...]) -> Partial | None:
        rest = tuple(a for a in self.axes if a not in axes)
        return Partial(self.op, rest) if rest else None


@dataclass(frozen=True, slots=True)
class Layout:
    """Per-dimension sharding (a tuple of mesh axes per dim, major first; empty: replicated)
    and an optional pending reduction."""

    dims: tuple[tuple[str, ...], ...]
    partial: Partial | None = None

    @staticmethod
    def replicated(rank: int) -> Layout:
        return Layout((REPLICATED_DIM,) * rank)

    @property
    def is_replicated(self) -> bool:
        return self.partial is None and not any(self.dims)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    @property
    def used_axes(self) -> tuple[str, ...]:
        return self.sharded_axes + (self.partial.axes if self.partial else ())

    def dim_of_axis(self, axis: str) -> int | None:
        for i, axes in enumerate(self.dims):
            if axis in axes:
                return i
        return None

    def with_dims(self, dims: tuple[tuple[str, ...], ...]) -> Layout:
        return Layout(dims, self.partial)

    def with_partial(self, partial: Partial | None) -> Layout:
        return Layout(self.dims, partial)

    def dims_text(self) -> str:
        parts = []
        for axes in self.dims:
            if not axes:
                parts.append("-")
            elif len(axes) == 1:
                parts.append(axes[0])
            else:
                parts.append("(" + ",".join(axes) + ")")
        return "{" + ",".join(parts) + "}"

    def __str__(self) -> str:
        text = self.dims_text() if any(self.dims) else ""
        if self.partial is not None:
            text = f"{text} {self.partial}" if text else str(self.partial)
        return text


@dataclass(frozen=True, slots=True)
class TensorType:
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def with_layout(self, layout: Layout) -> TensorType:
        return TensorType(self.dtype, self.shape, layout)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(dtype, self.shape, self.layout)

    def __str__(self) -> str:
        text = f"{self.dtype.value}[{','.join(map(str, self.shape))}]"
        if any(self.layout.dims):
            text += self.layout.dims_text()
        if self.layout.partial is not None:
            text += f" {self.layout.partial}"
        return text
