"""The CPU path's GEMM providers and their measured choice (dtm_mpi/kernels/gemm.py): every
provider that loads gives numpy's products for every layout; the choice keeps numpy unless
another provider is clearly faster; the measurement is cached per machine; DTM_GEMM forces one
(or says what is missing); a job's ranks use their common choice; the matmul kernel goes
through the chosen provider. Speed is what ``dtm info`` reports, not asserted here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.config import get_config
from dtm_mpi.errors import ConfigError
from dtm_mpi.kernels import gemm
from dtm_mpi.kernels.gemm import (
    GemmChoice,
    Provider,
    active_choice,
    agreed_choice,
    choose,
    parse_gemm_choice,
    provider_gemm,
    shape_class,
    use_choice,
)


def loadable(p: Provider) -> gemm.Gemm:
    g = provider_gemm(p)
    if isinstance(g, str):
        pytest.skip(g)
    return g


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(gemm, "_measured", [])
    use_choice(None)
    yield tmp_path
    use_choice(None)


def layouts(a: np.ndarray, b: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Row-major, transposed views (what the reverse pass's transposes give), strided."""
    return [
        (a, b),
        (np.asfortranarray(a), b),
        (a, np.asfortranarray(b)),
        (np.asfortranarray(a), np.asfortranarray(b)),
        (a[::2], b[:, ::2]),
        (a[:, :0], b[:0]),  # K = 0: zeros
    ]


@pytest.mark.parametrize("provider", list(Provider))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_provider_gives_numpys_products(provider: Provider, dtype: str) -> None:
    g = loadable(provider)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((70, 33)).astype(dtype)
    b = rng.standard_normal((33, 41)).astype(dtype)
    tol = 1e-5 if dtype == "float32" else 1e-12
    for x, y in layouts(a, b):
        got = g(x, y)
        want = x.astype(np.float64) @ y.astype(np.float64)
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)


def test_shape_classes_follow_the_flops() -> None:
    assert shape_class(64, 256, 64) == "small"
    assert shape_class(256, 512, 512) == "medium"
    assert shape_class(512, 1024, 4096) == "large"
    assert shape_class(2, 1, 2) == "small"
    # one row or one column is a matrix-vector product, whatever its flops
    assert shape_class(1, 1, 1) == shape_class(1, 4096, 4096) == "vector"
    assert shape_class(4096, 4096, 1) == "vector"


def test_a_transposed_float32_operand_gives_blis_the_bits_of_its_copy() -> None:
    g = provider_gemm(Provider.BLIS)
    if isinstance(g, str):
        pytest.skip(g)
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 256, 96), (16, 64, 32), (5, 7, 3)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)  # stored [out, in]
        got = g(a, w.T)
        assert got.shape == (m, n)
        assert got.tobytes() == g(a, np.ascontiguousarray(w.T)).tobytes()
        assert got.tobytes() == g(np.asfortranarray(a), w.T).tobytes()
        np.testing.assert_allclose(got, a @ w.T, rtol=1e-4, atol=1e-4)


def test_the_choice_keeps_numpy_unless_another_is_clearly_faster() -> None:
    n, m, b = Provider.NUMPY, Provider.MKL, Provider.BLIS
    got = choose(
        {
            ("float32", "large", n): 90.0,
            ("float32", "large", m): 144.0,  # MKL clearly faster: chosen
            ("float32", "large", b): 100.0,
            ("float32", "small", n): 90.0,
            ("float32", "small", m): 93.0,  # within the margin: numpy kept
            ("float64", "medium", n): 50.0,
            ("float64", "medium", b): 20.0,
        }
    )
    assert got.provider("float32", "large") is m
    assert got.provider("float32", "small") is n
    assert got.provider("float64", "medium") is n
    assert got.provider("float64", "large") is n  # not measured: numpy
    assert parse_gemm_choice(got.text()) == GemmChoice(got.table)


def test_a_choice_text_round_trips_and_bad_text_is_named() -> None:
    text = (
        "float32:vector=numpy,small=numpy,medium=numpy,large=mkl;"
        "float64:vector=numpy,small=blis,medium=numpy,large=numpy"
    )
    c = parse_gemm_choice(text)
    assert c.text() == text and c.provider("float64", "small") is Provider.BLIS
    with pytest.raises(ConfigError, match="unknown provider 'atlas'"):
        parse_gemm_choice("float32:small=atlas")
    with pytest.raises(ConfigError, match="unknown class float16:small"):
        parse_gemm_choice("float16:small=numpy")


def test_the_measurement_is_cached_per_machine(own_cache: Path) -> None:
    first = gemm.cached_choice()
    files = list((own_cache / "dtm_mpi").glob("gemm-*.json"))
    assert len(files) == 1
    assert {(d, c) for d, c, _, _ in first.measured} == {
        (d, c) for d in gemm.DTYPES for c, _, _ in gemm.CLASSES
    }
    assert all(v > 0 for *_, v in first.measured)
    stamp = files[0].stat().st_mtime_ns
    gemm._measured.clear()  # another process: reads the file
    again = gemm.cached_choice()
    assert (
        again.text() == first.text() and files[0].stat().st_mtime_ns == stamp
    )  # read, not measured
    assert "GEMM (DTM_GEMM=auto)" in gemm.describe_gemm("auto")


def test_dtm_gemm_forces_one_provider_or_says_what_is_missing(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert active_choice("numpy").table == ()
    for p in (Provider.MKL, Provider.BLIS):
        g = provider_gemm(p)
        if isinstance(g, str):
            with pytest.raises(ConfigError, match=f"DTM_GEMM={p.value}: "):
                active_choice(p.value)
        else:
            forced = active_choice(p.value)
            assert {forced.provider(d, c) for d in gemm.DTYPES for c, _, _ in gemm.CLASSES} == {p}
    monkeypatch.setitem(gemm._loaded, Provider.MKL, "MKL's libmkl_rt is not installed (test)")
    with pytest.raises(ConfigError, match="DTM_GEMM=mkl: MKL's libmkl_rt is not installed"):
        active_choice("mkl")


def test_the_ranks_use_their_common_choice_else_numpys() -> None:
    mkl = "float32:small=numpy,medium=numpy,large=mkl;float64:small=numpy,medium=numpy,large=numpy"
    same, why = agreed_choice([mkl, mkl, mkl])
    assert same.provider("float32", "large") is Provider.MKL and why == ""
    mixed, why = agreed_choice([mkl, mkl, ""])
    assert mixed.table == () and "rank(s) 0,1: " + mkl in why and "rank(s) 2: " in why


def test_the_matmul_kernel_goes_through_the_chosen_provider(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recording provider stands in for MKL: the 2-D float32 matmuls of a step go to it
    (the transposed operands of the reverse pass included), and the results are its."""
    from dtm_mpi.ir import parse_module, verify_module
    from dtm_mpi.runtime.simulate import run_simulated

    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def recording(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        calls.append((a.shape, b.shape))
        out: np.ndarray = np.matmul(a, b) + np.float32(1.0)  # marked: the result is its
        return out

    monkeypatch.setitem(gemm._loaded, Provider.MKL, recording)
    use_choice(parse_gemm_choice("float32:small=mkl,medium=mkl,large=mkl"))
    get_config.cache_clear()
    text = """dtm 1.0
module g
mesh @m = [tp=2]
entry func @f(%a: f32[4,6]{-,tp}, %b: f32[6,5]{tp,-}) -> (f32[4,5]) on @m {
  %p = matmul %a, %b : f32[4,5] partial(sum: tp)
  %c = allreduce sum %p on tp : f32[4,5]
  return %c
}
"""
    m = parse_module(text, "g.dtm")
    verify_module(m)
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    b = np.ones((6, 5), np.float32)
    got = run_simulated(m, 2, inputs={"a": a, "b": b}).results[0][0]
    assert sorted(calls) == [((4, 3), (3, 5))] * 2  # each rank's block, through the provider
    np.testing.assert_array_equal(got, a @ b + 2)  # each rank's +1, summed


def test_dtm_info_states_the_choice_and_its_measurements(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.mpi_env import mpirun_env

    env = mpirun_env(XDG_CACHE_HOME=str(tmp_path), DTM_GEMM="auto")
    done = subprocess.run(
        [sys.executable, "-m", "dtm_mpi", "info"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "GEMM (DTM_GEMM=auto): numpy" in out
    for dtype in ("float32", "float64"):
        for cls in ("small", "medium", "large"):
            line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{dtype} {cls}:"))
            assert "GFLOP/s at" in line and "numpy " in line, line


def test_auto_keeps_numpy_where_numpys_blas_runs_threads(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The providers are measured at one thread: a process whose numpy BLAS runs several
    (a rank alone on its node) keeps numpy's for every class, and says so."""
    mkl = "float32:small=numpy,medium=numpy,large=mkl;float64:small=numpy,medium=numpy,large=numpy"
    monkeypatch.setattr(gemm, "_measured", [parse_gemm_choice(mkl)])
    monkeypatch.setattr(gemm, "numpy_blas_threads", lambda: 1)
    assert active_choice("auto").provider("float32", "large") is Provider.MKL
    monkeypatch.setattr(gemm, "numpy_blas_threads", lambda: 8)
    assert active_choice("auto").table == ()
    assert "numpy's BLAS runs 8 threads here" in gemm.describe_gemm("auto")


def test_a_provider_the_job_chose_but_this_process_cannot_load_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(gemm._loaded, Provider.BLIS, "the blis package does not import (test)")
    choice = parse_gemm_choice("float32:small=numpy,medium=numpy,large=blis")
    with pytest.raises(ConfigError, match="runs blis for float32 large products, which this"):
        gemm.gemm_for(choice, np.dtype(np.float32), 512, 1024, 1024)
    assert gemm.gemm_for(choice, np.dtype(np.float32), 8, 8, 8) is None  # numpy's class
    assert gemm.gemm_for(choice, np.dtype(np.int32), 512, 1024, 1024) is None  # not a float
