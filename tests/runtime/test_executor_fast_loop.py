"""The executor's fast loop: kernels bound once per op (the numpy backend's binder), a
kernel's shapes checked on the first step (then trusted: shapes are static), constants
computed once and read-only, 0-d elementwise results as arrays; errors name the op and line."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from dtm_mpi.comm.sim import run_ranks
from dtm_mpi.errors import KernelError, RemoteFailureError
from dtm_mpi.ir import parse_module, verify_module
from dtm_mpi.kernels.dispatch import KernelContext, backend_kernels
from dtm_mpi.plan.program import compile_plan, mesh_for
from dtm_mpi.runtime.executor import Executor
from dtm_mpi.runtime.simulate import run_simulated

TEXT = """dtm 1.0
module fast
entry func @f(%a: f32[4,3], %s: f32[]) -> (f32[3,4], f32[], f32[4,3]) {
  %t = transpose %a perm [1, 0] : f32[3,4]
  %k = constant 2.0 : f32[]
  %u = mul %s, %k : f32[]
  %c = constant [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [1.0, 1.0, 1.0]] : f32[4,3]
  %v = add %a, %c : f32[4,3]
  return %t, %u, %v
}
"""


def module() -> object:
    m = parse_module(TEXT, "fast.dtm")
    verify_module(m)
    return m


def test_results_across_steps_and_constants_computed_once_read_only() -> None:
    m = module()
    plan = compile_plan(m, mesh_for(m, 1, None))  # type: ignore[arg-type]
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    s = np.array(1.5, dtype=np.float32)

    def body(comm: object) -> list[tuple[np.ndarray, ...]]:
        ex = Executor(plan, comm, "numpy")  # type: ignore[arg-type]
        return [ex.run([a, s], step) for step in range(3)]

    ((first, second, third),) = run_ranks(plan.mesh, body, timeout_s=30)
    for got in (first, second, third):
        assert np.array_equal(got[0], a.T)
        assert type(got[1]) is np.ndarray and got[1].shape == () and got[1] == np.float32(3.0)
        assert np.array_equal(
            got[2], a + np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]], np.float32)
        )


def test_a_kernel_giving_the_wrong_shape_is_named_on_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def bad(ctx: KernelContext, xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        return (np.zeros((2, 2), dtype=np.float32),)

    monkeypatch.setitem(backend_kernels("numpy"), "transpose", bad)
    with pytest.raises(
        (KernelError, RemoteFailureError),
        match=r"transpose at fast\.dtm:4:\d+: kernel gave local shape \[2, 2\] on rank 0; the plan says \[3, 4\]",
    ):
        run_simulated(
            module(), 1, inputs={"a": np.zeros((4, 3), np.float32), "s": np.zeros((), np.float32)}
        )  # type: ignore[arg-type]


def test_a_kernel_error_names_the_op_and_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(ctx: KernelContext, xs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        raise ValueError("broken kernel")

    monkeypatch.setitem(backend_kernels("numpy"), "transpose", boom)
    with pytest.raises(
        (KernelError, RemoteFailureError),
        match=r"transpose at fast\.dtm:4:\d+ failed on rank 0: ValueError: broken kernel",
    ):
        run_simulated(
            module(), 1, inputs={"a": np.zeros((4, 3), np.float32), "s": np.zeros((), np.float32)}
        )  # type: ignore[arg-type]
