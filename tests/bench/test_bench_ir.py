"""The IR benchmark's generator writes valid modules of the requested size (not a timing test)."""

from __future__ import annotations

import pytest

from dtm_mpi.bench.ir import generate_module, run_ir_bench
from dtm_mpi.errors import UsageError
from dtm_mpi.ir import check_text, verify_errors


@pytest.mark.parametrize("n_ops", [0, 1, 5, 11, 12, 200])
def test_generate_module_is_valid_with_n_ops(n_ops: int) -> None:
    module, errors = check_text(generate_module(n_ops), "bench.dtm")
    assert not errors, "\n".join(str(e) for e in errors)
    assert module is not None
    entry = module.entry
    assert entry is not None
    assert len(entry.body) == n_ops
    assert verify_errors(module) == []


def test_generate_module_uses_every_pattern() -> None:
    module, _ = check_text(generate_module(200))
    assert module is not None and module.entry is not None
    names = {op.name for op in module.entry.body}
    assert {"matmul", "gelu", "add", "mul", "transpose", "sum", "allreduce", "softmax"} <= names


def test_generate_module_rejects_negative() -> None:
    with pytest.raises(UsageError):
        generate_module(-1)


def test_run_ir_bench_reports_a_table() -> None:
    table = run_ir_bench(ops=300, repeat=1)
    assert "parse" in table and "verify" in table and "hash" in table and "total" in table
    assert "300" in table
    assert "target < 2 s" in table
    assert ("met" in table) or ("missed" in table)


@pytest.mark.parametrize(("ops", "repeat"), [(0, 1), (10, 0)])
def test_run_ir_bench_rejects_bad_arguments(ops: int, repeat: int) -> None:
    with pytest.raises(UsageError):
        run_ir_bench(ops=ops, repeat=repeat)
