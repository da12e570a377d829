"""Generated elementwise kernels: an expression over elementwise ops becomes one CUDA/HIP
kernel (the template ``kernels/fused_elementwise.cu`` plus ``#define`` lines).

Pure: :func:`fused_source` turns an :class:`Expr` tree (leaves are inputs, nodes are the
registry's ``FUSIBLE`` ops, each with its ``c_expr``) into source text; compiling and
launching it is the GPU backend's business. A single op is the one-node case, so every float
elementwise op of the GPU backends runs through this one path, and a chain the planner fuses
(:mod:`dtm_mpi.plan.fusion`) reads its inputs and writes its output once instead of once per
op. Inputs are either full-size (indexed ``[i]``) or vectors along the last dim (indexed
``[i % cols]``: a broadcast bias).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtm_mpi.errors import KernelError
from dtm_mpi.ir.registry import Trait, lookup_op

__all__ = ["CTYPES", "Expr", "FusedInput", "fused_name", "fused_source"]

CTYPES = {
    np.dtype(np.float16): "__half",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
}
"""The storage types the generated kernels take (f16 computes in float, f64 in double)."""


@dataclass(frozen=True, slots=True)
class FusedInput:
    dtype: np.dtype[np.generic]
    lastdim: bool = False  # a vector along the last dim, broadcast over the rows


@dataclass(frozen=True, slots=True)
class Expr:
    """An elementwise op applied to sub-expressions (``Expr``) or inputs (``int``: index into
    the kernel's inputs)."""

    op: str
    args: tuple[Expr | int, ...]
    attrs: tuple[tuple[str, str], ...] = ()
    """The op's form attributes (``OpDef.form``: gelu's ``approximate``), named in its C
    expression."""


def _acc(dtypes: Sequence[np.dtype[np.generic]]) -> str:
    return "double" if any(d == np.float64 for d in dtypes) else "float"


def _c_expr(e: Expr | int, n_inputs: int) -> str:
    if isinstance(e, int):
        if not 0 <= e < n_inputs:
            raise KernelError(f"fused expression refers to input {e} of {n_inputs}")
        return f"v{e}"
    d = lookup_op(e.op)
    if d is None or d.c_expr is None or not d.has(Trait.FUSIBLE) or d.arity != len(e.args):
        raise KernelError(f"op {e.op!r} with {len(e.args)} operand(s) cannot be fused")
    form = dict(d.form_attrs)
    for k, v in e.attrs:
        if k not in form or not v.isidentifier():
            raise KernelError(f"op {e.op!r} has no form attribute {k!r} = {v!r}")
        form[k] = v
    return d.c_expr.format(*(_c_expr(a, n_inputs) for a in e.args), **form)


def fused_name(expr: Expr, inputs: Sequence[FusedInput], out: np.dtype[np.generic]) -> str:
    """A stable kernel name for this expression and these types (the compile-cache key)."""
    text = repr((expr, [(str(i.dtype), i.lastdim) for i in inputs], str(out)))
    return "dtm_fused_" + hashlib.sha256(text.encode()).hexdigest()[:16]


def fused_source(
    expr: Expr, inputs: Sequence[FusedInput], out: np.dtype[np.generic], template: str
) -> tuple[str, str]:
    """``(kernel name, source text)`` of one kernel computing ``expr`` elementwise: parameters
    ``in0..inK-1`` (const pointers of the input types), ``out0``, then ``n`` and ``cols``
    (``template``: the text of ``fused_elementwise.cu`` with the common header inlined)."""
    out = np.dtype(out)
    for k, i in enumerate(inputs):
        if np.dtype(i.dtype) not in CTYPES:
            raise KernelError(
                f"fused input {k} has dtype {i.dtype}; only f16/f32/f64 are generated"
            )
    if out not in CTYPES:
        raise KernelError(f"fused output dtype {out}; only f16/f32/f64 are generated")
    name = fused_name(expr, inputs, out)
    acc = _acc([np.dtype(i.dtype) for i in inputs] + [out])
    params = [
        f"const {CTYPES[np.dtype(i.dtype)]}* __restrict__ in{k}" for k, i in enumerate(inputs)
    ]
    params.append(f"{CTYPES[out]}* __restrict__ out0")
    loads = " ".join(
        f"const {acc} v{k} = ({acc})dtm_load(in{k} + {'(i % cols)' if i.lastdim else 'i'});"
        for k, i in enumerate(inputs)
    )
    body = f"{loads} dtm_store(out0 + i, ({acc})({_c_expr(expr, len(inputs))}));"
    defines = "\n".join(
        [
            f"#define DTM_FUSED_NAME {name}",
            f"#define DTM_FUSED_PARAMS {', '.join(params)}",
            f"#define DTM_FUSED_ACC {acc}",
            f"#define DTM_FUSED_BODY {body}",
        ]
    )
    return name, defines + "\n" + template
