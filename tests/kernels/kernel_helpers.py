"""Test helpers: a numpy evaluation of the generated kernels' expressions."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtm_mpi.ir.registry import lookup_op
from dtm_mpi.kernels.fused import Expr


def evaluate(expr: Expr | int, values: Sequence[np.ndarray], dtype: Any) -> np.ndarray:
    """``expr`` over ``values`` (same shapes) with the registry's own numpy functions, each
    op's result in ``dtype`` (the arrays' dtype: equal to the op-by-op run bit for bit; the
    float compute type: what a generated kernel computes)."""
    if isinstance(expr, int):
        return values[expr]
    args = [evaluate(a, values, dtype) for a in expr.args]
    with np.errstate(all="ignore"):
        opdef = lookup_op(expr.op)
        assert opdef is not None and opdef.array_fn is not None, expr.op
        return np.asarray(opdef.array_fn(np, *args)).astype(dtype, copy=False)


def generated_fused_kernels() -> list[tuple[str, str]]:
    """``(name, source text)`` of kernels the fusion codegen writes, as the GPU backend hands
    them to the runtime compiler: a bias + gelu + mul chain over f16 (a broadcast bias), and a
    mixed f64/f32 chain of other unary and binary ops."""
    from dtm_mpi.kernels.fused import FusedInput, fused_source
    from dtm_mpi.kernels.sources import kernel_source

    f16, f32, f64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))
    chain = Expr("mul", (Expr("gelu", (Expr("add", (0, 1)),)), 2))
    mixed = Expr(
        "maximum", (Expr("rsqrt", (Expr("exp", (0,)),)), Expr("neg", (Expr("tanh", (1,)),)))
    )
    cases = [
        (chain, [FusedInput(f16), FusedInput(f16, lastdim=True), FusedInput(f16)], f16),
        (mixed, [FusedInput(f64), FusedInput(f32, lastdim=True)], f32),
    ]
    template = kernel_source("fused_elementwise.cu")
    return [fused_source(expr, inputs, out, template) for expr, inputs, out in cases]


def rtc_compile(lib: ctypes.CDLL, api: str, text: str, name: str, options: Sequence[str]) -> bytes:
    """Compile ``text`` with NVRTC (``api="nvrtc"``: PTX text, NUL-terminated) or hipRTC
    (``"hiprtc"``: a code object), which share one C API; asserts success, showing the log."""
    label = {"nvrtc": "NVRTC", "hiprtc": "hipRTC"}[api]
    out = "PTX" if api == "nvrtc" else "Code"

    def call(fn: str, *args: object) -> int:
        return int(getattr(lib, api + fn)(*args))

    prog = ctypes.c_void_p()
    rc = call("CreateProgram", ctypes.byref(prog), text.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"{api}CreateProgram: {rc}"
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        rc = call("CompileProgram", prog, len(options), opts)
        size = ctypes.c_size_t()
        call("GetProgramLogSize", prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        call("GetProgramLog", prog, log)
        assert rc == 0, f"{label} failed on {name}:\n{log.value.decode(errors='replace')}"
        call(f"Get{out}Size", prog, ctypes.byref(size))
        code = ctypes.create_string_buffer(size.value)
        call(f"Get{out}", prog, code)
        return code.raw
    finally:
        call("DestroyProgram", ctypes.byref(prog))
