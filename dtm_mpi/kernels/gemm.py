"""The CPU path's GEMM providers and the measured choice among them (``DTM_GEMM``).

numpy's ``matmul`` calls the BLAS numpy was built with (OpenBLAS in the PyPI wheels). Two
others install from PyPI: MKL (the ``mkl`` wheel's ``libmkl_rt``, called through its CBLAS
with the sequential threading layer) and BLIS (the ``blis`` package's ``gemm``). Which is
fastest depends on the machine and the shape: measured at one thread, MKL won on one AVX-512
machine and lost on another, and every library is slow on small shapes in its own way. So the
choice is measured, per *shape class* (dtype x size: ``vector`` for one row or one column,
``small`` below 2^22 flops, ``medium`` below 2^28, ``large`` above), on representative
shapes, once per machine (cached by CPU model, flags, library versions and the classes under
``$XDG_CACHE_HOME/dtm_mpi``, else ``~/.cache/dtm_mpi``), and another provider replaces numpy
for a class only when it is at least :data:`MARGIN` faster: never slower than numpy's default beyond the measurement's noise.

``DTM_GEMM``: ``auto`` (the measured choice), ``numpy``, ``mkl`` or ``blis`` (every class;
an error naming what is missing when that provider cannot load). The providers are measured
at one thread (MKL runs sequential), so ``auto`` keeps numpy's where numpy's BLAS runs more
than one thread in the process (a rank alone on its node). Different providers round
differently, so the ranks of a job must use one choice: under ``mpirun`` every rank sends its
own in its HELLO and all use the ranks' common choice, else numpy's (:func:`agreed_choice`);
a rank that cannot load the agreed provider fails with an error naming it. MKL runs in its
strict conditional-reproducibility mode (``MKL_CBWR_Set(AUTO | STRICT)``): the same bits
whatever the operands' alignment. Deterministic mode's exact sums do not depend on any of
this (their float64 products of integers are exact in any BLAS).

Only 2-D products of float32 arrays (``f32``, and ``bf16`` values held as float32) and of
float64 arrays go to another provider; batched and other dtypes stay with numpy. ``dtm info``
shows the choice and its measurements.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import ConfigError

__all__ = [
    "CLASSES",
    "MARGIN",
    "GemmChoice",
    "Provider",
    "active_choice",
    "agreed_choice",
    "choose",
    "describe_gemm",
    "gemm_for",
    "numpy_blas_threads",
    "parse_gemm_choice",
    "probe",
    "provider_gemm",
    "shape_class",
    "use_choice",
]

Arr = np.ndarray
Gemm = Callable[[Arr, Arr], Arr]

MARGIN = 1.05
"""How much faster than numpy another provider must measure to be chosen for a class."""
CLASSES: tuple[tuple[str, float, tuple[int, int, int]], ...] = (
    ("vector", 0.0, (1, 1024, 1024)),
    ("small", 2.0**22, (64, 256, 64)),
    ("medium", 2.0**28, (256, 512, 512)),
    ("large", float("inf"), (512, 1024, 1024)),
)
"""Shape classes: name, upper bound of the flops (``2 m k n``), the (m, k, n) measured for it;
``vector`` (bound 0) is every product with one row or one column, whatever its flops: a
matrix-vector product (a decode step's), where numpy's BLAS calls its gemv and the gemm
providers measured 5-12x slower on one AVX2 machine."""
DTYPES = ("float32", "float64")


class Provider(enum.Enum):
    NUMPY = "numpy"
    MKL = "mkl"
    BLIS = "blis"


def shape_class(m: int, k: int, n: int) -> str:
    """The class of an ``m x k`` by ``k x n`` product."""
    if min(m, n) == 1:
        return "vector"
    flops = 2.0 * m * k * n
    return next(name for name, bound, _ in CLASSES if bound > 0 and flops < bound)


# --- the providers -----------------------------------------------------------------------------

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_LP64, _MKL_SEQUENTIAL = 0, 1
_MKL_CBWR_AUTO, _MKL_CBWR_STRICT, _MKL_CBWR_SUCCESS = 2, 0x10000, 0
_lock = threading.Lock()
_loaded: dict[Provider, Gemm | str] = {}


def _mkl_library() -> ctypes.CDLL | str:
    """The ``mkl`` wheel's ``libmkl_rt`` (next to the interpreter's prefix, else the loader's
    path), set up before any other call: the LP64 interface (32-bit integers, as the calls
    here pass), the sequential threading layer (one thread per rank), strict conditional
    reproducibility; or why not."""
    names = [Path(sys.prefix) / "lib" / f"libmkl_rt.so.{v}" for v in (3, 2)]
    found = ctypes.util.find_library("mkl_rt")
    candidates = [str(p) for p in names if p.exists()] + ([found] if found else [])
    if not candidates:
        return "MKL's libmkl_rt is not installed (pip install mkl; `make setup` installs it)"
    try:
        lib = ctypes.CDLL(candidates[0])
        for setter, value in (
            ("MKL_Set_Interface_Layer", _MKL_LP64),
            ("MKL_Set_Threading_Layer", _MKL_SEQUENTIAL),
        ):
            getattr(lib, setter).argtypes = [ctypes.c_int]
            getattr(lib, setter)(value)
        lib.MKL_CBWR_Set.argtypes = [ctypes.c_int]
        if lib.MKL_CBWR_Set(_MKL_CBWR_AUTO | _MKL_CBWR_STRICT) != _MKL_CBWR_SUCCESS:
            return f"MKL's {candidates[0]} refused strict reproducibility (MKL_CBWR_Set)"
        for name, real in (("cblas_sgemm", ctypes.c_float), ("cblas_dgemm", ctypes.c_double)):
            fn = getattr(lib, name)
            fn.restype = None
            p, i = ctypes.c_void_p, ctypes.c_int
            fn.argtypes = [i, i, i, i, i, i, real, p, i, p, i, real, p, i]
    except (OSError, AttributeError) as exc:
        return f"MKL's {candidates[0]} did not load ({exc})"
    return lib


def _operand(x: Arr) -> tuple[Arr, bool]:
    """``x`` as a row-major array and whether it is the transpose of the product's operand
    (a transposed view is read in place; any other layout is copied)."""
    if x.flags.c_contiguous:
        return x, False
    if x.flags.f_contiguous:
        return x.T, True
    return np.ascontiguousarray(x), False


def _mkl_gemm(lib: ctypes.CDLL) -> Gemm:
    def gemm(a: Arr, b: Arr) -> Arr:
        m, k = a.shape
        n = b.shape[1]
        out = np.empty((m, n), dtype=a.dtype)
        sa, ta = _operand(a)
        sb, tb = _operand(b)
        fn, real = (
            (lib.cblas_sgemm, ctypes.c_float)
            if a.dtype == np.float32
            else (lib.cblas_dgemm, ctypes.c_double)
        )
        fn(
            _ROW_MAJOR,
            _TRANS if ta else _NO_TRANS,
            _TRANS if tb else _NO_TRANS,
            m,
            n,
            k,
            real(1.0),
            sa.ctypes.data,
            sa.shape[1],
            sb.ctypes.data,
            sb.shape[1],
            real(0.0),
            out.ctypes.data,
            n,
        )
        return out

    return gemm


def _blis_gemm() -> Gemm | str:
    try:
        from blis.py import gemm as blis_gemm  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except Exception as exc:  # ImportError, or a broken build
        return f"the blis package does not import ({type(exc).__name__}: {exc}; pip install blis)"

    def gemm(a: Arr, b: Arr) -> Arr:
        if a.dtype != np.float32:
            # blis 1.3's float64 gemm gives the wrong shape and values for transposed
            # operands (float32's are right): row-major copies
            whole: Arr = blis_gemm(np.ascontiguousarray(a), np.ascontiguousarray(b))
            return whole
        # a transposed view (a weight stored [out, in], as Hugging Face keeps it) is read in
        # place: copying it costs more than a one-row product (a decode step's) itself
        sa, ta = _operand(a)
        sb, tb = _operand(b)
        out: Arr = blis_gemm(sa, sb, trans1=ta, trans2=tb)
        return out

    return gemm


def _nonempty(g: Gemm) -> Gemm:
    """``g`` for products with elements to compute; numpy's for empty ones (zeros over K = 0)."""

    def gemm(a: Arr, b: Arr) -> Arr:
        if 0 in a.shape or 0 in b.shape:
            empty: Arr = np.matmul(a, b)
            return empty
        return g(a, b)

    return gemm


def provider_gemm(provider: Provider) -> Gemm | str:
    """``provider``'s 2-D GEMM (float32/float64, any strides), or why it cannot load."""
    with _lock:
        if provider not in _loaded:
            if provider is Provider.NUMPY:
                _loaded[provider] = np.matmul
            elif provider is Provider.MKL:
                lib = _mkl_library()
                _loaded[provider] = lib if isinstance(lib, str) else _nonempty(_mkl_gemm(lib))
            else:
                blis = _blis_gemm()
                _loaded[provider] = blis if isinstance(blis, str) else _nonempty(blis)
        return _loaded[provider]


# --- the choice --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GemmChoice:
    """The provider of each (dtype, class) not numpy's, and what it was measured at
    (GFLOP/s per provider and class; empty where not measured)."""

    table: tuple[tuple[str, str, Provider], ...]
    measured: tuple[tuple[str, str, str, float], ...] = ()

    def provider(self, dtype: str, cls: str) -> Provider:
        for d, c, p in self.table:
            if d == dtype and c == cls:
                return p
        return Provider.NUMPY

    def text(self) -> str:
        """One line, every class: ``float32:vector=numpy,small=numpy,...;float64:...``."""
        return ";".join(
            f"{d}:" + ",".join(f"{c}={self.provider(d, c).value}" for c, _, _ in CLASSES)
            for d in DTYPES
        )


NUMPY_ONLY = GemmChoice(())


def parse_gemm_choice(text: str) -> GemmChoice:
    """The choice of :meth:`GemmChoice.text` (raises :class:`ConfigError` naming what is
    wrong)."""
    table = []
    for part in filter(None, text.split(";")):
        dtype, _, rest = part.partition(":")
        for item in filter(None, rest.split(",")):
            cls, _, name = item.partition("=")
            try:
                provider = Provider(name)
            except ValueError:
                raise ConfigError(f"GEMM choice {text!r}: unknown provider {name!r}") from None
            if dtype not in DTYPES or cls not in {c for c, _, _ in CLASSES}:
                raise ConfigError(f"GEMM choice {text!r}: unknown class {dtype}:{cls}")
            if provider is not Provider.NUMPY:
                table.append((dtype, cls, provider))
    return GemmChoice(tuple(table))


def choose(gflops: Mapping[tuple[str, str, Provider], float], margin: float = MARGIN) -> GemmChoice:
    """The choice from measured GFLOP/s per (dtype, class, provider) (pure): per class the
    fastest provider where it beats numpy's by ``margin``, else numpy."""
    table = []
    for dtype in DTYPES:
        for cls, _, _ in CLASSES:
            base = gflops.get((dtype, cls, Provider.NUMPY), 0.0)
            others = [
                (v, p)
                for (d, c, p), v in gflops.items()
                if d == dtype and c == cls and p is not Provider.NUMPY
            ]
            if others:
                v, p = max(others, key=lambda vp: vp[0])
                if v >= margin * base:
                    table.append((dtype, cls, p))
    measured = tuple(sorted((d, c, p.value, round(v, 2)) for (d, c, p), v in gflops.items()))
    return GemmChoice(tuple(table), measured)


def probe(repeats: int = 3, budget_s: float = 0.02) -> GemmChoice:
    """Measure every loadable provider on each class's shape at this process's threads (one
    per rank: the launcher's ``OMP_NUM_THREADS``), the best of ``repeats`` runs of as many
    calls as fit ``budget_s``, the providers interleaved; then :func:`choose`."""
    rng = np.random.default_rng(0)
    gemms = {p: g for p in Provider if not isinstance(g := provider_gemm(p), str)}
    gflops: dict[tuple[str, str, Provider], float] = {}
    for dtype in DTYPES:
        for cls, _, (m, k, n) in CLASSES:
            a = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal((k, n)).astype(dtype)
            calls = {p: _calls_in(g, a, b, budget_s) for p, g in gemms.items()}
            best = dict.fromkeys(gemms, float("inf"))
            for _ in range(repeats):
                for p, g in gemms.items():
                    t0 = time.perf_counter()
                    for _ in range(calls[p]):
                        g(a, b)
                    best[p] = min(best[p], (time.perf_counter() - t0) / calls[p])
            for p, t in best.items():
                gflops[(dtype, cls, p)] = 2.0 * m * k * n / t / 1e9
    return choose(gflops)


def _calls_in(g: Gemm, a: Arr, b: Arr, budget_s: float) -> int:
    g(a, b)  # first touch, and the library's own start-up
    t0 = time.perf_counter()
    g(a, b)
    once = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(1000, int(budget_s / once)))


def _machine_key() -> str:
    """What the measurement depends on: the CPU and the libraries."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
    except OSError:
        model = sys.platform
    parts = [model, flags, np.__version__, ",".join(c for c, _, _ in CLASSES)]
    parts += [f"{dist}={_installed_version(dist)}" for dist in ("mkl", "blis")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _installed_version(dist: str) -> str:
    """The version of the installed distribution ``dist`` from its ``NAME-VERSION.dist-info``
    folder on ``sys.path`` ("none" where it is not installed). Read from the folder's name:
    ``importlib.metadata`` costs every rank 25 ms of imports at start-up for the same answer."""
    prefix = f"{dist}-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.lower().startswith(prefix) and name.endswith(".dist-info"):
                return name[len(prefix) : -len(".dist-info")]
    return "none"


def _cache_file() -> Path | None:
    """Where this machine's measurement is kept (None: no home directory to keep it in)."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:
            return None
    return Path(base) / "dtm_mpi" / f"gemm-{_machine_key()}.json"


_measured: list[GemmChoice] = []  # this process's, once read or measured


def cached_choice(refresh: bool = False) -> GemmChoice:
    """This machine's measured choice: read from its cache file (once per process), or
    measured and written (atomically: processes measuring at once each write a whole file)."""
    if _measured and not refresh:
        return _measured[0]
    path = _cache_file()
    got = None if refresh or path is None else _read_cache(path)
    if got is None:
        got = probe()
        if path is not None:
            _write_cache(path, got)
    _measured[:] = [got]
    return got


def _read_cache(path: Path) -> GemmChoice | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        found = parse_gemm_choice(str(data["choice"]))
        measured = tuple(
            (str(d), str(c), str(p), float(v)) for d, c, p, v in data.get("measured", ())
        )
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None
    return GemmChoice(found.table, measured)


def _write_cache(path: Path, got: GemmChoice) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"choice": got.text(), "measured": got.measured}, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: measured again by the next process


def numpy_blas_threads() -> int:
    """The threads numpy's BLAS runs in this process (1 where it cannot be told)."""
    try:
        from threadpoolctl import threadpool_info  # type: ignore[import-untyped]

        info = threadpool_info()
    except Exception:
        return 1
    threads = [
        int(i.get("num_threads", 1))
        for i in info
        if i.get("user_api") == "blas" and i.get("internal_api") != "mkl"
    ]
    return max(threads, default=1)


_agreed: list[GemmChoice] = []


def agreed_choice(texts: list[str]) -> tuple[GemmChoice, str]:
    """The job's choice from every rank's (:meth:`GemmChoice.text`, in rank order; pure, so
    every rank finds the same): the ranks' common one, else numpy's everywhere (every rank
    can run it) and a line saying which ranks chose what."""
    if len(set(texts)) <= 1:
        return (parse_gemm_choice(texts[0]) if texts else NUMPY_ONLY), ""
    by: dict[str, list[int]] = {}
    for rank, t in enumerate(texts):
        by.setdefault(t, []).append(rank)
    said = "; ".join(f"rank(s) {','.join(map(str, r))}: {t}" for t, r in by.items())
    return NUMPY_ONLY, f"the ranks chose different GEMM providers ({said}): numpy's on every rank"


def use_choice(choice: GemmChoice | None) -> None:
    """The job's agreed choice (:func:`agreed_choice`, after the handshake), or None: this
    process's own."""
    _agreed.clear()
    if choice is not None:
        _agreed.append(choice)


def active_choice(setting: str, *, own: bool = False) -> GemmChoice:
    """The choice in force: the job's agreed one (unless ``own``: this process's, what its
    HELLO says), else ``DTM_GEMM``'s (``setting``): numpy, one provider everywhere (a
    :class:`ConfigError` saying what is missing when it cannot load), or ``auto``, this
    machine's measured one where numpy's BLAS runs one thread, else numpy's."""
    if _agreed and not own:
        return _agreed[0]
    if setting == "auto":
        return cached_choice() if numpy_blas_threads() <= 1 else NUMPY_ONLY
    provider = Provider(setting)
    if provider is Provider.NUMPY:
        return NUMPY_ONLY
    if isinstance(why := provider_gemm(provider), str):
        raise ConfigError(f"DTM_GEMM={setting}: {why}")
    return GemmChoice(tuple((d, c, provider) for d in DTYPES for c, _, _ in CLASSES))


def gemm_for(choice: GemmChoice, dtype: np.dtype[Any], m: int, k: int, n: int) -> Gemm | None:
    """The GEMM of a 2-D ``m x k @ k x n`` product of ``dtype`` under ``choice``; None where
    numpy's matmul is the one (numpy chosen, or another dtype). A provider the choice names
    that cannot load here is a :class:`ConfigError` (the job's ranks must run one provider)."""
    name = np.dtype(dtype).name
    if name not in DTYPES:
        return None
    provider = choice.provider(name, shape_class(m, k, n))
    if provider is Provider.NUMPY:
        return None
    g = provider_gemm(provider)
    if isinstance(g, str):
        raise ConfigError(
            f"the job's GEMM choice runs {provider.value} for {name} {shape_class(m, k, n)} "
            f"products, which this process cannot load: {g}"
        )
    return g


def describe_gemm(setting: str, refresh: bool = False) -> str:
    """``dtm info``'s lines: the setting, each class's provider and what every provider
    measured (``refresh``: measured again)."""
    lines = [f"GEMM (DTM_GEMM={setting}): " + ", ".join(_available())]
    threads = numpy_blas_threads()
    if setting == "auto" and threads > 1:
        lines.append(
            f"  numpy's BLAS runs {threads} threads here: numpy's for every class (the others "
            "are measured at one thread)"
        )
    choice = cached_choice(refresh) if setting == "auto" else active_choice(setting)
    gf = {(d, c, p): v for d, c, p, v in choice.measured}
    for dtype in DTYPES:
        for cls, _, (m, k, n) in CLASSES:
            chosen = choice.provider(dtype, cls).value
            seen = [
                f"{p} {v:.1f}" for (d, c, p), v in sorted(gf.items()) if d == dtype and c == cls
            ]
            at = f" (GFLOP/s at {m}x{k}x{n}: {', '.join(seen)})" if seen else ""
            lines.append(f"  {dtype} {cls}: {chosen}{at}")
    return "\n".join(lines)


def _available() -> list[str]:
    out = []
    for p in Provider:
        g = provider_gemm(p)
        out.append(p.value + (f" (not available: {g})" if isinstance(g, str) else ""))
    return out
