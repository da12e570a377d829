"""The kernel sources build for AMD GPUs, with no GPU: every ``.cu`` compiles with ``hipcc`` to
device code for gfx90a (CDNA2, 64-wide wavefronts) and gfx1030 (RDNA2, 32-wide) and exports
exactly the extern "C" kernels of its ABI; and the production path, the loader's text (header
inlined: :func:`dtm_mpi.kernels.sources.kernel_source`) and generated fused kernels
(:func:`dtm_mpi.kernels.fused.fused_source`), compiles through hipRTC, which is what CuPy on
ROCm calls. Each is skipped with a reason where its tool is absent (``make setup`` installs
Debian's ``hipcc`` and ROCm device libraries when run as root)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

from dtm_mpi.kernels.sources import kernel_source
from tests.kernels.kernel_helpers import generated_fused_kernels, rtc_compile
from tests.kernels.test_cu_sources import (
    EXPECTED,
    FUSED_F16,
    FUSED_F64,
    INCLUDE_LINE,
    KERNELS,
    SOURCES,
    TIMEOUT_S,
    TYPE_CHECKS,
)

AMD_ARCHS = ("gfx90a", "gfx1030")
HIPCC = shutil.which("hipcc")
# Debian's hipcc picks the NVIDIA platform when nvcc is on PATH; these tests build for AMD.
HIP_ENV = {**os.environ, "HIP_PLATFORM": "amd"}


def _elf_functions(blob: bytes) -> list[str]:
    """Names of the global function symbols of a little-endian ELF64 object (an AMDGPU code
    object: each kernel is a global STT_FUNC symbol next to its ``.kd`` descriptor)."""
    assert blob[:4] == b"\x7fELF" and blob[4] == 2 and blob[5] == 1, "not an ELF64 LE object"
    (shoff,) = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", blob, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", blob, shoff + k * shentsize) for k in range(shnum)
    ]
    names: list[str] = []
    for _name, sh_type, _fl, _addr, off, size, link, _info, _align, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab_off = sections[link][4]
        for k in range(size // entsize):
            st_name, st_info = struct.unpack_from("<IB", blob, off + k * entsize)
            if st_info >> 4 == 1 and st_info & 0xF == 2:  # STB_GLOBAL, STT_FUNC
                end = blob.index(b"\0", strtab_off + st_name)
                names.append(blob[strtab_off + st_name : end].decode())
    return sorted(names)


# --- hipcc -----------------------------------------------------------------------------------


def _hipcc_device(text: str, arch: str, name: str) -> bytes:
    """Compile HIP source text to one unbundled device code object for ``arch``; fail on any
    compiler warning."""
    assert HIPCC is not None
    with tempfile.TemporaryDirectory(prefix="dtm_hip_") as tmp:
        src, out = Path(tmp) / name, Path(tmp) / "out.co"
        src.write_text(text, encoding="utf-8")
        cmd = [HIPCC, "-std=c++17", f"--offload-arch={arch}", "--cuda-device-only"]
        cmd += ["--no-gpu-bundle-output", "-I", str(KERNELS), "-c", "-x", "hip", str(src)]
        cmd += ["-o", str(out)]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, env=HIP_ENV
        )
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}"
        warnings = [ln for ln in proc.stderr.splitlines() if "warning" in ln.lower()]
        assert not warnings, "\n".join(warnings)
        return out.read_bytes()


@functools.cache
def _hipcc_unusable() -> str | None:
    """Why hipcc cannot build AMD device code here (None when it can): a toolchain problem,
    told apart from a problem in our sources by compiling a trivial kernel first."""
    if HIPCC is None:
        return "hipcc not found on PATH"
    try:
        _hipcc_device('extern "C" __global__ void k(float* p) { p[0] = 1.0f; }', "gfx90a", "k.hip")
    except AssertionError as exc:
        return f"hipcc cannot build a trivial gfx90a kernel: {str(exc)[-300:]}"
    return None


def _need_hipcc() -> None:
    reason = _hipcc_unusable()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("arch", AMD_ARCHS)
@pytest.mark.parametrize("filename", SOURCES)
def test_hipcc_builds_and_exports_the_abi(filename: str, arch: str) -> None:
    _need_hipcc()
    blob = _hipcc_device((KERNELS / filename).read_text(encoding="utf-8"), arch, filename)
    assert _elf_functions(blob) == sorted(EXPECTED[filename])
    assert arch.encode() in blob  # the code object names its target


@pytest.mark.parametrize(
    ("defines", "entry"),
    [(FUSED_F16, "dtm_fused_bias_gelu_mul_f16"), (FUSED_F64, "dtm_fused_all_helpers_f64")],
    ids=["f16-bias-gelu-mul", "f64-all-helpers"],
)
def test_hipcc_builds_the_fused_template(defines: str, entry: str) -> None:
    _need_hipcc()
    text = defines + (KERNELS / "fused_elementwise.cu").read_text(encoding="utf-8")
    assert _elf_functions(_hipcc_device(text, "gfx90a", "fused.hip")) == [entry]


def test_hipcc_helper_types() -> None:
    _need_hipcc()
    _hipcc_device(INCLUDE_LINE + "\n" + TYPE_CHECKS, "gfx90a", "types.hip")


# --- hipRTC: what CuPy on ROCm runs ----------------------------------------------------------


@functools.cache
def _hiprtc() -> ctypes.CDLL | str:
    """libamdhip64 (ROCm ships hipRTC in it; $DTM_HIPRTC_LIB overrides), or why not."""
    candidates = [os.environ.get("DTM_HIPRTC_LIB"), ctypes.util.find_library("hiprtc")]
    candidates += [ctypes.util.find_library("amdhip64"), "/opt/rocm/lib/libamdhip64.so"]
    for path in filter(None, candidates):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "hiprtcCompileProgram"):
            return lib
    return "hipRTC not found (install ROCm or Debian's libamdhip64-dev, or set DTM_HIPRTC_LIB)"


def _hiprtc_compile(text: str, name: str, arch: str) -> bytes:
    """Compile with hipRTC for ``arch`` (CuPy's options: -std=c++17); the code object."""
    lib = _hiprtc()
    if isinstance(lib, str):
        pytest.skip(lib)
    return rtc_compile(lib, "hiprtc", text, name, ["-std=c++17", f"--gpu-architecture={arch}"])


@pytest.mark.parametrize("arch", AMD_ARCHS)
@pytest.mark.parametrize("filename", SOURCES)
def test_hiprtc_compiles_the_loader_text(filename: str, arch: str) -> None:
    """The exact text the GPU backend hands to CuPy's RawModule, compiled by hipRTC."""
    blob = _hiprtc_compile(kernel_source(filename), filename, arch)
    assert _elf_functions(blob) == sorted(EXPECTED[filename])


def test_hiprtc_compiles_generated_fused_kernels() -> None:
    """Kernels the fusion codegen writes (mixed f16/f32/f64, a broadcast bias) build too."""
    for name, text in generated_fused_kernels():
        assert _elf_functions(_hiprtc_compile(text, f"{name}.cu", "gfx90a")) == [name]


def test_hiprtc_helper_types() -> None:
    text = kernel_source("softmax.cu") + TYPE_CHECKS
    assert "dtm_softmax_f32" in _elf_functions(_hiprtc_compile(text, "types.cu", "gfx90a"))
