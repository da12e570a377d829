"""A CPU stand-in for CuPy that runs the real kernel sources, for tests only (never a backend).

``dtm_mpi.kernels.launch`` calls ``cupy.RawModule(code=...)`` and launches kernels with
``fn(grid, block, args)``. :class:`EmuCupy` answers those calls: the code (the loader's exact
text, or a generated fused kernel) is compiled by the host C++ compiler against
``emu_include/emu_runtime.h``, which runs each block's threads as fibers with strict barriers
and warp shuffles at a chosen warp size (32 as on NVIDIA GPUs, 64 as on CDNA AMD GPUs). Arrays
are numpy arrays (``.get()`` as CuPy's) allocated between poisoned red zones.

Each launch checks what a GPU would not tell you plainly: every argument's type against the
kernel's C signature (a ``np.int32`` passed for ``long long``, a float32 array for ``__half*``),
writes past either end of an array argument (the red zones and fresh allocations hold 0xFF
bytes, a NaN in every float type, so a read of them shows too), a numpy array where CuPy wants
a device array, and barriers that not every thread reaches or reaches from different lines (an
error naming the block and the threads, not a hang). ``EmuCupy(64, hip=True)`` compiles the
sources as hipRTC does (their HIP branch, ``__shfl_xor``), as on an AMD GPU with 64-wide
wavefronts; ``reverse=True`` runs blocks and threads in descending order.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

INCLUDE = Path(__file__).with_name("emu_include")
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
# -ffp-contract=off: no fused multiply-adds on any host (x86-64 has none without -mfma anyway)
# -fcf-protection=none: the hand-written stack switch has no shadow-stack support
FLAGS = (
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-Wall",
    "-Werror",
    "-Wno-unused-function",
    "-ffp-contract=off",
    "-fcf-protection=none",
)
REDZONE = 64
POISON = 0xFF  # NaN in f16, f32 and f64 (-1 in int8): a read of it shows
_KINDS = {
    np.dtype(np.float16): "h2",
    np.dtype(np.float32): "f4",
    np.dtype(np.float64): "f8",
    np.dtype(np.int8): "i1",
    np.dtype(np.uint8): "u1",
    np.dtype(np.int32): "i4",
    np.dtype(np.int64): "i8",
}
_SCALARS = {
    "i1": np.int8,
    "u1": np.uint8,
    "i4": np.int32,
    "u4": np.uint32,
    "i8": np.int64,
    "u8": np.uint64,
    "f4": np.float32,
    "f8": np.float64,
}


class EmuError(RuntimeError):
    """A launch the emulator refused or a kernel that misbehaved (the message says which)."""


class EmuArray(np.ndarray):
    """A numpy array standing in for a CuPy device array."""

    _emu_base: np.ndarray | None = None

    def get(self) -> np.ndarray:
        return np.array(self)

    def __array_finalize__(self, obj: Any) -> None:
        self._emu_base = None  # views and results carry no red zones of their own


def _alloc(shape: Sequence[int] | int, dtype: Any) -> EmuArray:
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    base = np.full(nbytes + 2 * REDZONE, POISON, dtype=np.uint8)
    arr = base[REDZONE : REDZONE + nbytes].view(dtype).reshape(shape).view(EmuArray)
    arr._emu_base = base
    return arr


def _redzones_intact(arr: EmuArray) -> bool:
    base = arr._emu_base
    assert base is not None
    return bool((base[:REDZONE] == POISON).all() and (base[REDZONE + arr.nbytes :] == POISON).all())


class _Device:
    def __init__(self, warp: int) -> None:
        self.id = 0
        self.attributes = {"WarpSize": warp}


class _Event:
    """A CUDA event on the host clock (the emulator runs synchronously)."""

    t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass


class _Stream:
    def synchronize(self) -> None:
        pass


class _Cuda:
    Event = _Event

    def __init__(self, owner: EmuCupy) -> None:
        self._owner = owner

    def Device(self, device: int = 0) -> _Device:
        return _Device(self._owner.warp)

    def get_current_stream(self) -> _Stream:
        return _Stream()

    @staticmethod
    def get_elapsed_time(start: _Event, stop: _Event) -> float:
        return (stop.t - start.t) * 1e3  # milliseconds, as CuPy's


def _cache_dir() -> Path:
    d = Path(
        os.environ.get("DTM_EMU_CACHE")
        or Path(tempfile.gettempdir()) / f"dtm-gpu-emu-{os.getuid()}"
    )
    d.mkdir(parents=True, exist_ok=True)
    return d


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise EmuError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


TRAMPOLINE = (
    'extern "C" int emu_launch__{n}(unsigned emu_g_, unsigned emu_b_, int emu_w_, int emu_r_,'
    " void** emu_a_, char* emu_e_, size_t emu_n_) {{ return emu::launch(&{n}, emu_g_, emu_b_,"
    " emu_w_, emu_r_ != 0, emu_a_, emu_e_, emu_n_); }}\n"
    'extern "C" const char* emu_sig__{n}() {{ static const std::string s ='
    " emu::signature(&{n}); return s.c_str(); }}\n"
)
"""One launcher and one signature query per kernel, appended to the module's text."""


@functools.cache
def _toolchain() -> str:
    """What the binaries depend on besides the source: the runtime and shim headers, the
    trampolines, the flags and the compiler's exact version (part of every cache key)."""
    if CXX is None:
        raise EmuError("no C++ compiler (g++) for the GPU emulator")
    headers = [
        f"{f.relative_to(INCLUDE)}\0{f.read_text(encoding='utf-8')}"
        for f in sorted(INCLUDE.rglob("*.h"))
    ]
    version = _run([CXX, "-dumpfullversion", "-dumpmachine"])
    return "\0".join([*headers, TRAMPOLINE, CXX, version, *FLAGS])


def _replace_new(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (a unique temporary file, then a rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _pch() -> list[str]:
    """``-include`` options for the runtime header, precompiled once per toolchain (threads of
    one process and several processes may race to build it: each builds its own temporary
    file and renames it into place)."""
    d = _cache_dir() / ("pch-" + hashlib.sha256(_toolchain().encode()).hexdigest()[:16])
    h, gch = d / "emu_runtime.h", d / "emu_runtime.h.gch"
    if not gch.exists():
        d.mkdir(parents=True, exist_ok=True)
        if not h.exists():
            _replace_new(h, (INCLUDE / "emu_runtime.h").read_bytes())
        fd, tmp = tempfile.mkstemp(dir=d, prefix="tmp-", suffix=".gch")
        os.close(fd)
        _run([str(CXX), *FLAGS, "-x", "c++-header", str(h), "-o", tmp])
        os.replace(tmp, gch)
    return ["-include", str(h)]


def compile_module(
    code: str, hip: bool = False, options: Sequence[str] = ()
) -> tuple[ctypes.CDLL, list[str]]:
    """Compile kernel source text for the emulator: the shared library and its kernel names
    (the extern "C" functions of the text, found after preprocessing). ``hip``: as hipRTC sees
    it (``__HIPCC_RTC__``: the sources take their HIP branch and include nothing, the runtime
    header being pre-included), else as NVRTC does. ``options``: the RawModule's; ``-D``,
    ``-U`` and ``-I`` are passed on, ``-std=c++17`` is what the emulator uses anyway, anything
    else is refused rather than silently dropped."""
    extra = []
    for o in options:
        if o.startswith(("-D", "-U", "-I")):
            extra.append(o)
        elif o != "-std=c++17":
            raise EmuError(f"RawModule option {o!r} is not emulated")
    defines = [*(["-D__HIPCC_RTC__"] if hip else []), *extra]
    key = hashlib.sha256("\0".join([code, _toolchain(), *defines]).encode()).hexdigest()[:24]
    so = _cache_dir() / f"{key}.so"
    names_file = so.with_suffix(".names")
    if not (so.exists() and names_file.exists()):
        with tempfile.TemporaryDirectory(prefix="tmp-", dir=_cache_dir()) as tmp:
            src = Path(tmp) / "module.cpp"
            src.write_text(code, encoding="utf-8")
            header = str(INCLUDE / "emu_runtime.h")
            pre = _run(
                [
                    str(CXX),
                    "-std=c++17",
                    "-E",
                    "-P",
                    "-DDTM_EMU_NAMES_ONLY",
                    *defines,
                    "-include",
                    header,
                    "-I",
                    str(INCLUDE),
                    "-x",
                    "c++",
                    str(src),
                ]
            )
            names = sorted(
                {
                    n
                    for n in re.findall(r'extern\s+"C"\s+void\s+(\w+)\s*\(', pre)
                    if not n.startswith("emu_")
                }
            )
            src.write_text(
                code + "\n" + "".join(TRAMPOLINE.format(n=n) for n in names), encoding="utf-8"
            )
            out = Path(tmp) / "module.so"
            _run(
                [
                    str(CXX),
                    *FLAGS,
                    *defines,
                    "-shared",
                    *_pch(),
                    "-I",
                    str(INCLUDE),
                    "-x",
                    "c++",
                    str(src),
                    "-o",
                    str(out),
                ]
            )
            # both atomically, the names first: a concurrent run that sees both sees them whole
            _replace_new(names_file, "\n".join(names).encode())
            os.replace(out, so)
    names = [n for n in names_file.read_text(encoding="utf-8").split("\n") if n]
    return ctypes.CDLL(str(so)), names


class EmuFunction:
    def __init__(self, owner: EmuCupy, lib: ctypes.CDLL, name: str) -> None:
        self.owner, self.name = owner, name
        self._launch = getattr(lib, f"emu_launch__{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        sig = getattr(lib, f"emu_sig__{name}")
        sig.restype = ctypes.c_char_p
        self.params: list[str] = sig().decode().split()
        self.launches = 0

    def _arg(self, k: int, want: str, value: Any, keep: list[Any]) -> int:
        where = f"{self.name}: argument {k}"
        if want.startswith("p"):
            if not isinstance(value, self.owner.ndarray):
                raise EmuError(
                    f"{where} must be a device array ({want}); got {type(value).__name__}"
                )
            got = _KINDS.get(value.dtype, f"?{value.dtype}")
            if got != want[1:]:
                raise EmuError(
                    f"{where}: the kernel takes a {want[1:]} pointer; got a {value.dtype} array"
                )
            if not value.flags.c_contiguous:
                raise EmuError(f"{where}: array is not C-contiguous")
            cell = ctypes.c_void_p(value.ctypes.data)
        else:
            if isinstance(value, bool) or not isinstance(value, (np.generic, int, float)):
                raise EmuError(f"{where} must be a scalar ({want}); got {type(value).__name__}")
            # CuPy passes a numpy scalar as its own type, a Python int as int64, float as float64
            got = (
                _KINDS.get(np.asarray(value).dtype)
                if isinstance(value, np.generic)
                else ("i8" if isinstance(value, int) else "f8")
            )
            if got != want:
                raise EmuError(f"{where}: the kernel takes {want}; got {got} ({value!r})")
            cell = np.array([value], dtype=_SCALARS[want])
            keep.append(cell)
            return int(cell.ctypes.data)
        keep.append(cell)
        return int(ctypes.addressof(cell))

    def __call__(
        self, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], **_: Any
    ) -> None:
        g, b = (*tuple(grid), 1, 1), (*tuple(block), 1, 1)
        if g[1:3] != (1, 1) or b[1:3] != (1, 1):
            raise EmuError(
                f"{self.name}: only 1-d grids and blocks are emulated; got {grid}, {block}"
            )
        if len(args) != len(self.params):
            raise EmuError(
                f"{self.name} takes {len(self.params)} arguments ({' '.join(self.params)}); got {len(args)}"
            )
        keep: list[Any] = []
        cells = [
            self._arg(k, want, v, keep)
            for k, (want, v) in enumerate(zip(self.params, args, strict=True))
        ]
        argv = (ctypes.c_void_p * max(1, len(cells)))(*cells)
        err = ctypes.create_string_buffer(1024)
        rc = self._launch(
            int(g[0]), int(b[0]), self.owner.warp, int(self.owner.reverse), argv, err, len(err)
        )
        self.launches += 1
        if rc != 0:
            raise EmuError(f"{self.name}: {err.value.decode(errors='replace')}")
        for k, v in enumerate(args):
            if isinstance(v, EmuArray) and v._emu_base is not None and not _redzones_intact(v):
                raise EmuError(
                    f"{self.name}: wrote outside argument {k} ({v.dtype}{list(v.shape)})"
                )


class EmuModule:
    def __init__(self, owner: EmuCupy, code: str, options: Sequence[str] = ()) -> None:
        self.owner, self.code, self.options = owner, code, tuple(options)
        self._lib: ctypes.CDLL | None = None
        self.names: list[str] = []

    def compile(self) -> None:
        if self._lib is None:
            self._lib, self.names = compile_module(self.code, self.owner.hip, self.options)
            self.owner.compiled += 1

    def get_function(self, name: str) -> EmuFunction:
        self.compile()
        assert self._lib is not None
        if name not in self.names:
            raise EmuError(f"no kernel {name!r} in this module (it has {', '.join(self.names)})")
        return EmuFunction(self.owner, self._lib, name)


class EmuCupy:
    """CuPy as ``dtm_mpi.kernels.launch`` and the kernel tests see it: RawModule runs on the
    emulator, array allocations get red zones, events use the host clock; any other attribute
    is numpy's (CuPy mirrors numpy's API).

    ``warp``: 32 or 64; ``hip``: compile the sources as hipRTC does; ``reverse``: run blocks
    and threads in descending order; ``strict`` (default): only this module's arrays are device
    arrays (``ndarray`` is :class:`EmuArray`), so a numpy array reaching a kernel is refused as
    CuPy refuses it; ``strict=False`` where the surrounding code stands numpy in for CuPy."""

    def __init__(
        self, warp: int, hip: bool = False, reverse: bool = False, strict: bool = True
    ) -> None:
        self.warp, self.hip, self.reverse, self.strict = warp, hip, reverse, strict
        self.cuda = _Cuda(self)
        self.compiled = 0

    @classmethod
    def named(cls, name: str, strict: bool = True) -> EmuCupy:
        """The emulator a test parameter names: ``emu-<cuda|hip>-w<32|64>[-reverse]``."""
        parts = name.split("-")
        assert parts[0] == "emu" and parts[1] in ("cuda", "hip") and parts[2] in ("w32", "w64"), (
            name
        )
        return cls(
            int(parts[2][1:]), hip=parts[1] == "hip", reverse="reverse" in parts[3:], strict=strict
        )

    @property
    def ndarray(self) -> type:
        return EmuArray if self.strict else np.ndarray

    def zeros(self, shape: Sequence[int] | int, dtype: Any = np.float64) -> EmuArray:
        return self.full(shape, 0, dtype)

    def ones(self, shape: Sequence[int] | int, dtype: Any = np.float64) -> EmuArray:
        return self.full(shape, 1, dtype)

    def empty_like(self, x: Any, dtype: Any = None) -> EmuArray:
        return _alloc(np.shape(x), np.asarray(x).dtype if dtype is None else dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def RawModule(self, code: str, options: Sequence[str] = ()) -> EmuModule:
        return EmuModule(self, code, options)

    def empty(self, shape: Sequence[int] | int, dtype: Any = np.float64) -> EmuArray:
        return _alloc(shape, dtype)

    def full(self, shape: Sequence[int] | int, value: Any, dtype: Any = None) -> EmuArray:
        arr = _alloc(shape, np.asarray(value).dtype if dtype is None else dtype)
        arr[...] = value
        return arr

    def asarray(self, x: Any, dtype: Any = None) -> EmuArray:
        if isinstance(x, EmuArray) and (dtype is None or np.dtype(dtype) == x.dtype):
            return x
        src = np.asarray(x, dtype=dtype)
        arr = _alloc(src.shape, src.dtype)
        arr[...] = src
        return arr

    def ascontiguousarray(self, x: Any, dtype: Any = None) -> EmuArray:
        if (
            isinstance(x, EmuArray)
            and x.flags.c_contiguous
            and (dtype is None or np.dtype(dtype) == x.dtype)
        ):
            return x
        return self.asarray(np.ascontiguousarray(x, dtype=dtype))


def install(mp: Any, cp: EmuCupy) -> EmuCupy:
    """Make ``dtm_mpi.kernels.launch`` use ``cp`` through the monkeypatch ``mp``, with empty
    compile caches (they are keyed by device id, which every emulator and a GPU share)."""
    from dtm_mpi.kernels import launch

    mp.setattr(launch, "_cp", lambda: cp)
    for cache in ("_MODULES", "_FUNCTIONS", "_FUSED", "_WARP"):
        mp.setattr(launch, cache, {})
    return cp
