"""Random valid modules (the IR property-test generator: random layouts, pending reductions,
matmul, sums, allreduce, softmax, random/constant creation, ...) run on the simulator at the
mesh they declare and give the single-process numpy results."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent.parent / "ir"))
from test_properties import Case, Style, render, valid_cases

from dtm_mpi.config import get_config
from dtm_mpi.ir import check_text
from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.ir.nodes import InitKind
from dtm_mpi.ir.types import DType
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.runtime.simulate import run_simulated
from tests.depth import examples


def _close(a: np.ndarray, b: np.ndarray, what: str, dtype: DType, operands: float = 1.0) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype.kind != "f":
        np.testing.assert_array_equal(a, b, err_msg=what)
        return
    # Distributed reductions add in another order: a few ulps of the dtype (f16 has 11 bits,
    # bf16 8: its results are rounded to bf16, held in float32), and values near overflow may
    # round to inf on one side only.
    tol = 6e-2 if dtype is DType.BF16 else {2: 8e-3, 4: 2e-4, 8: 1e-9}[a.dtype.itemsize]
    # A sum of per-rank contributions (a pending value, a split matmul) rounds each one at
    # its own scale, so an element that cancels is only as exact as the array's largest, or
    # as the largest operand (``operands``) where every element cancels.
    big = np.finfo(a.dtype).max / 16
    ok = np.isfinite(b) & (np.abs(b) < big)
    scale = max(1.0, operands, float(np.abs(b[ok]).max(initial=0.0)))
    np.testing.assert_allclose(a[ok], b[ok], rtol=tol, atol=tol * scale, err_msg=what)


@settings(max_examples=examples(120), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=valid_cases())
def test_random_modules_match_reference(case: Case) -> None:
    _matches_reference(case)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=valid_cases(), bucket=st.sampled_from([4, 64, 1 << 20]))
def test_random_modules_match_reference_with_overlapped_buckets(case: Case, bucket: int) -> None:
    """Allreduces in buckets started when ready (``DTM_OVERLAP``; small buckets: many of
    them, values freed before their bucket starts, chains of allreduces) change nothing."""
    saved = {k: os.environ.get(k) for k in ("DTM_OVERLAP", "DTM_BUCKET_BYTES")}
    os.environ.update({"DTM_OVERLAP": "1", "DTM_BUCKET_BYTES": str(bucket)})
    get_config.cache_clear()
    try:
        _matches_reference(case)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_config.cache_clear()


def _largest(value: np.ndarray) -> float:
    """The largest finite magnitude of a float array (0 for others)."""
    v = np.asarray(value)
    if v.dtype.kind != "f" or not v.size:
        return 0.0
    finite = np.abs(v[np.isfinite(v)].astype(np.float64))
    return float(finite.max(initial=0.0))


def _matches_reference(case: Case) -> None:
    module, errors = check_text(render(case.spec, Style(case.names)), "prop.dtm")
    assert module is not None and not errors
    entry = module.entry
    assert entry is not None
    sizes = dict(module.meshes[0].axes)
    nranks = int(np.prod(list(sizes.values())))
    assume(nranks <= 8)
    assume(all(p.init is None or p.init.kind is not InitKind.STORE for p in entry.params))
    rng = np.random.default_rng(0)
    inputs = {
        p.name.lstrip("%"): rng.integers(-3, 4, size=p.type.shape).astype(np_dtype(p.type.dtype))
        for p in entry.params
        if p.init is None
    }
    ref_params, ref_results = run_reference(module, inputs, steps=2)
    got = run_simulated(module, nranks, binding=sizes, inputs=inputs, steps=2)
    operands = max([_largest(v) for v in (*inputs.values(), *ref_params.values())], default=1.0)
    for s in range(2):
        for i, (a, b) in enumerate(zip(got.results[s], ref_results[s], strict=True)):
            _close(a, b, f"step {s} result {i}", entry.results[i].type.dtype, operands)
    types = {p.name: p.type.dtype for p in entry.params}
    for name, value in ref_params.items():
        _close(got.params[name.lstrip("%")], value, f"param {name}", types[name])
