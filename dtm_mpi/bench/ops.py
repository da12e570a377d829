"""``dtm bench ops``: what the executor adds per op on tiny tensors.

A chain of ``ops`` elementwise ops (``add``, ``mul``, ``sub`` in turn) on ``size``-element
float32 vectors, run by the executor on one rank (its one loop: bound kernels), against
the same chain of numpy calls (``np.add``, ``np.multiply``, ``np.subtract``) in the same
process; best of ``repeat`` runs of each, alternating. The executor's overhead per op is the
difference divided by the number of ops (target: <= 5 us)."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["chain_module_text", "run_ops_bench"]

TARGET_US = 5.0
_OPS = ("add", "mul", "sub")
_UFUNCS = (np.add, np.multiply, np.subtract)


def chain_module_text(ops: int, size: int) -> str:
    """The DTM text of the chain: ``%v{i} = op %v{i-1}, %b`` for ``ops`` ops."""
    lines = [
        "dtm 1.0",
        "module chain",
        "mesh @m = [x=1]",
        f"entry func @f(%a: f32[{size}], %b: f32[{size}]) -> (f32[{size}]) on @m {{",
    ]
    prev = "%a"
    for i in range(ops):
        lines.append(f"  %v{i} = {_OPS[i % 3]} {prev}, %b : f32[{size}]")
        prev = f"%v{i}"
    lines += [f"  return {prev}", "}"]
    return "\n".join(lines) + "\n"


def run_ops_bench(
    ops: int = 1000, sizes: Sequence[int] = (8, 1024, 65536), repeat: int = 30
) -> str:
    from dtm_mpi.comm.sim import run_ranks
    from dtm_mpi.ir.parser import parse_module
    from dtm_mpi.ir.verify import verify_module
    from dtm_mpi.plan.program import compile_plan, mesh_for

    head = f"dtm bench ops: a chain of {ops} elementwise float32 ops (add, mul, sub), 1 rank, best of {repeat}"
    cols = f"{'elements':>9}{'dtm us/op':>11}{'numpy us/op':>13}{'overhead us/op':>16}  target <= {TARGET_US:.0f} us"
    lines = [head, cols]
    for size in sizes:
        module = parse_module(chain_module_text(ops, size), "<bench ops>")
        verify_module(module)
        plan = compile_plan(module, mesh_for(module, 1, None))
        ((d, n),) = run_ranks(
            plan.mesh, functools.partial(_measure, plan, ops, size, repeat), timeout_s=600
        )
        over = (d - n) / ops * 1e6
        verdict = "met" if over <= TARGET_US else "MISSED"
        lines.append(
            f"{size:>9}{d / ops * 1e6:>11.2f}{n / ops * 1e6:>13.2f}{over:>16.2f}  {verdict}"
        )
    return "\n".join(lines)


def _numpy_chain(a: np.ndarray, b: np.ndarray, ops: int) -> np.ndarray:
    x = a
    for i in range(ops):
        x = _UFUNCS[i % 3](x, b)
    return x


def _measure(plan: Any, ops: int, size: int, repeat: int, comm: Any) -> tuple[float, float]:
    """(best executor run, best numpy chain) in seconds, alternating; checks they agree."""
    from dtm_mpi.runtime.executor import Executor

    a = np.linspace(0.5, 1.5, size, dtype=np.float32)
    b = np.full(size, 0.999, dtype=np.float32)
    ex = Executor(plan, comm, "numpy")
    if not np.array_equal(ex.run([a, b])[0], _numpy_chain(a, b, ops)):
        raise AssertionError("the executor's chain differs from numpy's")
    best_d = best_n = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        ex.run([a, b])
        t1 = time.perf_counter()
        _numpy_chain(a, b, ops)
        t2 = time.perf_counter()
        best_d, best_n = min(best_d, t1 - t0), min(best_n, t2 - t1)
    return best_d, best_n
