"""The CUDA/HIP kernel sources in ``kernels/`` compile, with no GPU: every ``.cu`` builds with
nvcc for sm_80 and sm_90 and exports exactly the extern "C" kernels of its ABI (kernels/README.md),
also as the Python loader sees it (the ``#include "dtm_common.cuh"`` line replaced by the
header's text, no include path); the header includes only the fp16 / HIP headers; the fused
elementwise template compiles with no defines and with generated-style defines; the helper
overloads have the documented types. With libnvrtc available the loader's NVRTC path is compiled
too; each is skipped with a reason where the tool is absent. The AMD builds (hipcc, hipRTC) are
in ``test_hip_sources.py``."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from dtm_mpi.kernels.sources import kernel_source
from tests.kernels.kernel_helpers import generated_fused_kernels, rtc_compile

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
HEADER = KERNELS / "dtm_common.cuh"
INCLUDE_LINE = '#include "dtm_common.cuh"'
ARCHS = ("sm_80", "sm_90")
DTYPES = ("f16", "f32", "f64")
TIMEOUT_S = 120

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")


def _per_dtype(*bases: str) -> tuple[str, ...]:
    return tuple(f"{base}_{t}" for t in DTYPES for base in bases)


# The extern "C" kernels each file must export (the launcher's ABI, kernels/README.md).
EXPECTED: dict[str, tuple[str, ...]] = {
    "softmax.cu": _per_dtype("dtm_softmax", "dtm_log_softmax"),
    "layer_norm.cu": _per_dtype("dtm_layer_norm"),
    "rms_norm.cu": _per_dtype("dtm_rms_norm"),
    "bias_gelu.cu": _per_dtype("dtm_bias_gelu"),
    "row_reduce.cu": _per_dtype("dtm_row_sum", "dtm_row_max", "dtm_row_min"),
    "quant.cu": _per_dtype("dtm_quantize", "dtm_dequantize"),
    "take.cu": _per_dtype("dtm_take_rows", "dtm_scatter_rows"),
    "adamw.cu": _per_dtype("dtm_adamw"),
    "fused_elementwise.cu": ("dtm_fused_default",),
}
SOURCES = sorted(EXPECTED)
ALLOWED_HEADER_INCLUDES = {"<cuda_fp16.h>", "<hip/hip_runtime.h>", "<hip/hip_fp16.h>"}

# Generated-style defines for the fused template: bias + gelu + mul over __half with float
# math, and a double chain touching every documented helper.
FUSED_F16 = """\
#define DTM_FUSED_NAME dtm_fused_bias_gelu_mul_f16
#define DTM_FUSED_PARAMS const __half* in0, const __half* in1, const __half* in2, __half* out0
#define DTM_FUSED_ACC float
#define DTM_FUSED_BODY { DTM_FUSED_ACC v0 = dtm_load(in0 + i); \\
    DTM_FUSED_ACC v1 = dtm_load(in1 + i % cols); DTM_FUSED_ACC v2 = dtm_gelu(v0 + v1); \\
    DTM_FUSED_ACC v3 = v2 * dtm_load(in2 + i); dtm_store(out0 + i, v3); }
"""
FUSED_F64 = """\
#define DTM_FUSED_NAME dtm_fused_all_helpers_f64
#define DTM_FUSED_PARAMS const double* in0, const float* in1, double* out0, float* out1
#define DTM_FUSED_ACC double
#define DTM_FUSED_BODY { double a = dtm_load(in0 + i); double b = dtm_load(in1 + i % cols); \\
    double v = dtm_relu(a) + dtm_rsqrt(1.0 + b * b) + dtm_maximum(a, b) - dtm_minimum(a, b); \\
    v += dtm_neg(dtm_exp(dtm_tanh(a))) + dtm_log(1.0 + dtm_abs(b)) + dtm_sqrt(dtm_abs(a)); \\
    v += exp(a) + log(1.0 + b * b) + tanh(b) + sqrt(1.0 + a * a) + dtm_gelu(a); \\
    dtm_store(out0 + i, v); dtm_store(out1 + i, v); }
"""
# Compile-time checks of the helpers' types (and that exp(float) & co. stay float).
TYPE_CHECKS = """
template <class A, class B> struct dtm_same { static const bool value = false; };
template <class A> struct dtm_same<A, A> { static const bool value = true; };
#define DTM_SAME(E, T) static_assert(dtm_same<decltype(E), T>::value, #E " is not " #T)
#define DTM_SAME_TYPE(U, T) static_assert(dtm_same<U, T>::value, #U " is not " #T)
__device__ void dtm_type_checks(float f, double d, const __half* h) {
  DTM_SAME(dtm_load(h), float); DTM_SAME(dtm_load(&f), float); DTM_SAME(dtm_load(&d), double);
  DTM_SAME(exp(f), float); DTM_SAME(log(f), float); DTM_SAME(tanh(f), float);
  DTM_SAME(sqrt(f), float); DTM_SAME(exp(d), double);
  DTM_SAME(dtm_exp(f), float); DTM_SAME(dtm_log(f), float); DTM_SAME(dtm_tanh(f), float);
  DTM_SAME(dtm_sqrt(f), float); DTM_SAME(dtm_rsqrt(f), float); DTM_SAME(dtm_gelu(f), float);
  DTM_SAME(dtm_relu(f), float); DTM_SAME(dtm_neg(f), float); DTM_SAME(dtm_abs(f), float);
  DTM_SAME(dtm_maximum(f, f), float); DTM_SAME(dtm_minimum(f, f), float);
  DTM_SAME(dtm_exp(d), double); DTM_SAME(dtm_gelu(d), double); DTM_SAME(dtm_relu(d), double);
  DTM_SAME(dtm_rsqrt(d), double); DTM_SAME(dtm_maximum(d, d), double);
  DTM_SAME(dtm_minimum(d, d), double); DTM_SAME(dtm_neg(d), double);
  DTM_SAME_TYPE(DtmAcc<__half>::type, float); DTM_SAME_TYPE(DtmAcc<float>::type, float);
  DTM_SAME_TYPE(DtmAcc<double>::type, double);
}
"""


def _loader_text(source: str, defines: str = "") -> str:
    """The text the Python loader compiles: defines, then the header inlined for its line."""
    header = HEADER.read_text(encoding="utf-8")
    return defines + source.replace(INCLUDE_LINE + "\n", header + "\n", 1)


def _entries(ptx: str) -> list[str]:
    return re.findall(r"\.entry\s+(\w+)\s*\(", ptx)


def _nvcc_ptx(source_text: str, arch: str, name: str, include_kernels: bool = True) -> str:
    """Compile source text to PTX with nvcc, assemble it with ptxas; return the PTX."""
    assert NVCC is not None
    with tempfile.TemporaryDirectory(prefix="dtm_cu_") as tmp:
        src = Path(tmp) / name
        src.write_text(source_text, encoding="utf-8")
        ptx = Path(tmp) / "out.ptx"
        cmd = [NVCC, "-std=c++17", f"-arch={arch}", "--ptx", "-o", str(ptx), str(src)]
        if include_kernels:
            cmd[1:1] = ["-I", str(KERNELS)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}"
        warnings = [ln for ln in proc.stderr.splitlines() if "warning" in ln.lower()]
        assert not warnings, "\n".join(warnings)
        ptxas = shutil.which("ptxas") or str(Path(NVCC).parent / "ptxas")
        if Path(ptxas).exists():  # the PTX also assembles (catches register / resource errors)
            cubin = Path(tmp) / "out.cubin"
            cmd = [ptxas, f"-arch={arch}", "-o", str(cubin), str(ptx)]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
            )
            assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}"
        return ptx.read_text(encoding="utf-8")


@functools.cache
def _compiled(filename: str, arch: str) -> str:
    return _nvcc_ptx((KERNELS / filename).read_text(encoding="utf-8"), arch, filename)


def test_every_source_has_an_abi_entry() -> None:
    assert sorted(p.name for p in KERNELS.glob("*.cu")) == SOURCES
    assert HEADER.is_file()


@pytest.mark.parametrize("filename", SOURCES)
def test_source_starts_with_the_header_include(filename: str) -> None:
    text = (KERNELS / filename).read_text(encoding="utf-8")
    assert text.splitlines()[0] == INCLUDE_LINE
    includes = [ln.strip() for ln in text.splitlines() if ln.lstrip().startswith("#include")]
    assert includes == [INCLUDE_LINE], "the loader inlines only dtm_common.cuh"


def test_header_includes_only_fp16_and_hip_headers() -> None:
    text = HEADER.read_text(encoding="utf-8")
    includes = {
        m.group(1) for m in re.finditer(r"^\s*#\s*include\s+(\S+)", text, flags=re.MULTILINE)
    }
    assert "<cuda_fp16.h>" in includes
    assert includes <= ALLOWED_HEADER_INCLUDES, includes - ALLOWED_HEADER_INCLUDES


def test_readme_documents_every_kernel_and_helper() -> None:
    readme = (KERNELS / "README.md").read_text(encoding="utf-8")
    names = {name.rsplit("_", 1)[0] for names in EXPECTED.values() for name in names}
    names -= {"dtm_fused"}
    helpers = {"dtm_load", "dtm_store", "dtm_gelu", "dtm_relu", "dtm_rsqrt", "dtm_maximum"}
    helpers |= {"dtm_minimum", "dtm_neg", "dtm_exp", "dtm_log", "dtm_tanh", "dtm_sqrt"}
    macros = {"DTM_FUSED_NAME", "DTM_FUSED_PARAMS", "DTM_FUSED_ACC", "DTM_FUSED_BODY"}
    missing = sorted(n for n in names | helpers | macros if n not in readme)
    assert not missing, missing


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", SOURCES)
def test_compiles_and_exports_the_abi(filename: str, arch: str) -> None:
    ptx = _compiled(filename, arch)
    assert sorted(_entries(ptx)) == sorted(EXPECTED[filename])
    assert f".target {arch}" in ptx


@needs_nvcc
@pytest.mark.parametrize("filename", SOURCES)
def test_compiles_as_the_loader_sees_it(filename: str) -> None:
    """Header text inlined for the include line, compiled with no include path."""
    text = _loader_text((KERNELS / filename).read_text(encoding="utf-8"))
    ptx = _nvcc_ptx(text, "sm_80", filename, include_kernels=False)
    assert sorted(_entries(ptx)) == sorted(EXPECTED[filename])


@needs_nvcc
@pytest.mark.parametrize(
    ("defines", "entry"),
    [(FUSED_F16, "dtm_fused_bias_gelu_mul_f16"), (FUSED_F64, "dtm_fused_all_helpers_f64")],
    ids=["f16-bias-gelu-mul", "f64-all-helpers"],
)
def test_fused_template_with_defines(defines: str, entry: str) -> None:
    text = defines + (KERNELS / "fused_elementwise.cu").read_text(encoding="utf-8")
    ptx = _nvcc_ptx(_loader_text(text), "sm_90", "fused.cu", include_kernels=False)
    assert _entries(ptx) == [entry]
    # the launcher's parameters follow the pointer list: n and cols, both 64-bit
    params = re.search(rf"\.entry\s+{entry}\s*\((.*?)\)", ptx, flags=re.DOTALL)
    assert params is not None
    assert re.findall(r"\.param \.(\w+)", params.group(1))[-2:] == ["u64", "u64"]


@needs_nvcc
def test_helper_types() -> None:
    _nvcc_ptx(INCLUDE_LINE + "\n" + TYPE_CHECKS, "sm_80", "types.cu")


def _cuda_roots() -> list[Path]:
    """Candidate CUDA toolkit roots: $CUDA_PATH, $CUDA_HOME, the one above nvcc, /usr/local/cuda."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    if NVCC is not None:
        roots.insert(2, str(Path(NVCC).resolve().parents[1]))
    return [Path(r) for r in roots if r and Path(r).is_dir()]


def _wheel_dirs(module: str) -> list[Path]:
    """Directories of an nvidia-* wheel (nvidia.cuda_nvrtc, nvidia.cuda_runtime), if installed."""
    try:
        package = importlib.import_module(module)
    except ImportError:
        return []
    return [Path(p) for p in getattr(package, "__path__", [])]


def _find_nvrtc() -> str | None:
    """libnvrtc: $DTM_NVRTC_LIB, the loader's search path, a toolkit, or the nvidia-cuda-nvrtc
    wheel (which CuPy can use; ``make setup`` installs it)."""
    candidates = [os.environ.get("DTM_NVRTC_LIB"), ctypes.util.find_library("nvrtc")]
    for root in _cuda_roots():
        candidates += sorted(str(p) for p in root.glob("lib*/libnvrtc.so*"))
    for base in _wheel_dirs("nvidia.cuda_nvrtc"):  # CUDA 12 wheels: nvidia/cuda_nvrtc/lib
        candidates += sorted(str(p) for p in base.glob("lib/libnvrtc.so*"))
    for base in _wheel_dirs("nvidia"):  # CUDA 13 wheels: nvidia/cu13/lib
        candidates += sorted(str(p) for p in base.glob("cu*/lib/libnvrtc.so*"))
    return next((c for c in candidates if c), None)


def _fp16_include_dirs() -> list[str]:
    """Where cuda_fp16.h lives for NVRTC (CuPy passes the toolkit's include directory)."""
    dirs = [root / "include" for root in _cuda_roots()]
    dirs += [base / "include" for base in _wheel_dirs("nvidia.cuda_runtime")]
    return [str(d) for d in dirs if (d / "cuda_fp16.h").is_file()]


def _nvrtc_compile(lib: ctypes.CDLL, text: str, name: str, options: list[str]) -> str:
    return rtc_compile(lib, "nvrtc", text, name, options).rstrip(b"\0").decode()


def test_nvrtc_compiles_the_loader_text() -> None:
    """The production path: header inlined, NVRTC, -std=c++17 (skipped without libnvrtc)."""
    path = _find_nvrtc()
    if path is None:
        pytest.skip("libnvrtc not found (set DTM_NVRTC_LIB or install the CUDA toolkit)")
    try:
        # libnvrtc dlopens its builtins by name; a wheel keeps them beside it, off the search path
        for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so*")):
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(path)
    except OSError as exc:
        pytest.skip(f"libnvrtc at {path} does not load: {exc}")
    include_dirs = _fp16_include_dirs()
    if not include_dirs:
        pytest.skip("cuda_fp16.h not found for NVRTC (no CUDA toolkit or nvidia-cuda-runtime)")
    options = ["-std=c++17", "--gpu-architecture=compute_80", f"-I{include_dirs[0]}"]
    for filename in SOURCES:  # the exact text the GPU backend hands to CuPy's RawModule
        ptx = _nvrtc_compile(lib, kernel_source(filename), filename, options)
        assert sorted(_entries(ptx)) == sorted(EXPECTED[filename])
    for name, text in generated_fused_kernels():
        assert _entries(_nvrtc_compile(lib, text, f"{name}.cu", options)) == [name]
    text = _loader_text(FUSED_F16 + (KERNELS / "fused_elementwise.cu").read_text(encoding="utf-8"))
    assert _entries(_nvrtc_compile(lib, text, "fused.cu", options)) == [
        "dtm_fused_bias_gelu_mul_f16"
    ]
    _nvrtc_compile(lib, _loader_text(INCLUDE_LINE + "\n" + TYPE_CHECKS), "types.cu", options)
