"""Fake device arrays for testing the device communication layer without a GPU (mpi4py's own
trick): host memory exposed through ``__cuda_array_interface__``. mpi4py takes any object
with that interface as a buffer and hands its pointer to MPI, which on host memory simply
works; so the direct (GPU-aware) path runs for real on a CPU-only machine.

Also the collective steps both device-comm test files run: every kind, uneven blocks."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from dtm_mpi.ir.types import DType, Layout, Partial, ReduceOp, TensorType
from dtm_mpi.sharding import (
    AllgatherSpec,
    AllreduceSpec,
    ExchangeSpec,
    MeshShape,
    RedistStep,
    ReduceScatterSpec,
    StepKind,
    local_block,
    rank_spec,
)

PAGE = 4096


class FakeDeviceArray:
    """A C-contiguous numpy array posing as device memory. ``host`` is the memory itself
    (tests only); there is deliberately no ``__array__``, so code that treats it as a host
    array fails instead of silently copying."""

    def __init__(self, host: np.ndarray, strided: bool = False) -> None:
        if not (host.flags.c_contiguous or strided):
            raise ValueError(
                "FakeDeviceArray wraps C-contiguous arrays only (strided=True: a view)"
            )
        self.host = host

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.host.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.host.dtype

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)

    @property
    def size(self) -> int:
        return int(self.host.size)

    @property
    def flags(self) -> Any:
        return self.host.flags

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.host.dtype.str,
            "data": (int(self.host.ctypes.data), False),
            "version": 3,
            "strides": None if self.host.flags.c_contiguous else tuple(self.host.strides),
            "stream": None,
        }

    def __repr__(self) -> str:
        return f"FakeDeviceArray({self.host!r})"


class FakeDeviceOps:
    """``DeviceOps`` over :class:`FakeDeviceArray`: counts synchronisations, records the order
    of calls in ``events``, and hands out page-aligned "pinned" buffers (counted)."""

    name = "fake"

    def __init__(self) -> None:
        self.syncs = 0
        self.pinned_calls = 0
        self.events: list[str] = []

    def is_device(self, x: object) -> bool:
        return isinstance(x, FakeDeviceArray)

    def synchronize(self) -> None:
        self.syncs += 1
        self.events.append("sync")

    def empty(self, shape: tuple[int, ...], dtype: Any) -> FakeDeviceArray:
        out = np.empty(shape, dtype=dtype)
        out.reshape(-1).view(np.uint8)[:] = 0xA5  # "uninitialised": never all zeros
        return FakeDeviceArray(out)

    def to_host(self, x: Any, out: np.ndarray) -> np.ndarray:
        assert isinstance(x, FakeDeviceArray) and out.nbytes >= x.nbytes
        self.events.append("to_host")
        flat = out.reshape(-1).view(np.uint8)[: x.nbytes]
        flat[:] = x.host.reshape(-1).view(np.uint8)
        return flat.view(x.dtype).reshape(x.shape)

    def to_device(self, host: np.ndarray, out: Any | None = None) -> FakeDeviceArray:
        self.events.append("to_device")
        host = np.require(host, requirements="C")  # keeps a 0-d array 0-d
        if out is None:
            return FakeDeviceArray(host.copy())
        out.host.reshape(-1).view(np.uint8)[:] = host.reshape(-1).view(np.uint8)
        return out  # type: ignore[no-any-return]

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_calls += 1
        raw = np.empty(nbytes + PAGE, dtype=np.uint8)
        start = -int(raw.ctypes.data) % PAGE
        return raw[start : start + nbytes]


def same(got: Any, want: np.ndarray) -> bool:
    """``got`` is a fake device array holding exactly ``want`` (shape, dtype, bytes)."""
    return (
        isinstance(got, FakeDeviceArray)
        and got.shape == want.shape
        and got.dtype == want.dtype
        and got.host.tobytes() == want.tobytes()
    )


def dev(x: np.ndarray) -> FakeDeviceArray:
    """A fake device copy of ``x``."""
    return FakeDeviceArray(np.array(x, order="C", copy=True))


def dev_strided(x: np.ndarray) -> FakeDeviceArray:
    """A fake device array holding ``x`` as a non-contiguous view (the transpose of a
    contiguous copy of ``x.T``), as a transposed CuPy array is; 2-d, both extents > 1."""
    assert x.ndim == 2 and min(x.shape) > 1
    view = np.ascontiguousarray(x.T).T
    assert not view.flags.c_contiguous and np.array_equal(view, x)
    return FakeDeviceArray(view, strided=True)


# --- the collective steps the tests run -------------------------------------------------------


def _t(
    shape: tuple[int, ...], dims: Any, partial: Any = None, dtype: DType = DType.F32
) -> TensorType:
    return TensorType(dtype, shape, Layout(dims, partial))


def steps_for(k: int) -> list[RedistStep]:
    """One step of each collective kind on a line of ``k`` ranks (axis ``x``), with extents that
    do not divide by ``k`` (uneven blocks), f32 and f64 reductions, and an exchange."""
    x = ("x",)
    out = [
        RedistStep(StepKind.ALLGATHER, _t((7, 3), (x, ())), _t((7, 3), ((), ())), x, dim=0),
        RedistStep(StepKind.ALLGATHER, _t((3, 5), ((), x)), _t((3, 5), ((), ())), x, dim=1),
    ]
    for dt in (DType.F32, DType.F64):
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
            src = _t((5, 3), ((), ()), Partial(op, x), dt)
            out.append(
                RedistStep(StepKind.ALLREDUCE, src, _t((5, 3), ((), ()), None, dt), x, op=op)
            )
    src = _t((7, 2), ((), ()), Partial(ReduceOp.SUM, x))
    out.append(
        RedistStep(StepKind.REDUCE_SCATTER, src, _t((7, 2), (x, ())), x, dim=0, op=ReduceOp.SUM)
    )
    src = _t((3, 7), ((), ()), Partial(ReduceOp.SUM, x))
    out.append(
        RedistStep(StepKind.REDUCE_SCATTER, src, _t((3, 7), ((), x)), x, dim=1, op=ReduceOp.SUM)
    )
    out.append(
        RedistStep(
            StepKind.ALL_TO_ALL, _t((10, 7), (x, ())), _t((10, 7), ((), x)), x, dim=0, dst_dim=1
        )
    )
    return out


def step_input(step: RedistStep, mesh: MeshShape, rank: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s block of the input of ``step`` (random; integer-valued, so sums are
    exact in any order)."""
    t = step.in_type
    dtype = np.float64 if t.dtype is DType.F64 else np.float32
    g = np.random.default_rng(seed).integers(-50, 50, size=t.shape).astype(dtype)
    if t.layout.partial is not None:  # a different contribution on every rank
        g = g + rank * 3
    return np.ascontiguousarray(g[local_block(t.shape, t.layout, mesh, rank)])


def run_spec(comm: Any, step: RedistStep, mesh: MeshShape, x: Any) -> Any:
    """Run ``step`` on this rank through ``comm`` (any Comm) on ``x``."""
    spec = rank_spec(step, mesh, comm.rank)
    if isinstance(spec, AllgatherSpec):
        return comm.allgather(x, step.axes, spec)
    if isinstance(spec, AllreduceSpec):
        return comm.allreduce(x, step.axes, spec)
    if isinstance(spec, ReduceScatterSpec):
        return comm.reduce_scatter(x, step.axes, spec)
    assert isinstance(spec, ExchangeSpec)
    return comm.exchange(x, step.axes, spec, step.kind.value)


# --- a fake CuPy for the probe's child --------------------------------------------------------

FAKE_CUPY = '''
"""Just enough of CuPy for dtm_mpi.comm.gpu_aware's probe. FAKE_CUPY_MODE=host: "device"
arrays are numpy arrays (MPI moves them: a GPU-aware MPI); unmapped: their interface points
at an unmapped address, so MPI dereferencing it crashes, as a non-GPU-aware MPI does on
device memory."""
import os
import numpy as np

uint32, float32 = np.uint32, np.float32
MODE = os.environ.get("FAKE_CUPY_MODE", "host")


class _Runtime:
    is_hip = False

    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def deviceSynchronize():
        pass


class _Device:
    def __init__(self, index):
        pass

    def use(self):
        pass


class _Cuda:
    runtime = _Runtime()
    Device = _Device


cuda = _Cuda()


class _Unmapped:
    def __init__(self, a):
        self.a = a

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "data": (0x1000, False),
                "version": 3, "strides": None, "stream": None}

    def __mul__(self, k):
        return _wrap(self.a * k)


def _wrap(a):
    return a if MODE == "host" else _Unmapped(a)


def arange(n, dtype):
    return _wrap(np.arange(n, dtype=dtype))


def zeros_like(x):
    return _wrap(np.zeros_like(getattr(x, "a", x)))
'''


def fake_cupy_environ(directory: str, mode: str) -> dict[str, str]:
    """The environment for a probe child that imports the fake CuPy from ``directory``."""
    import os

    os.makedirs(os.path.join(directory, "cupy"), exist_ok=True)
    with open(os.path.join(directory, "cupy", "__init__.py"), "w", encoding="utf-8") as f:
        f.write(FAKE_CUPY)
    return dict(os.environ, PYTHONPATH=directory, FAKE_CUPY_MODE=mode)


# --- a fake CuPy module for code that imports cupy itself -------------------------------------


class FakeStream:
    """CuPy's current stream, asynchronous as a GPU's: kernels (fills, copies, uploads) queue
    here and run at :meth:`synchronize`, or when a download waits for the stream. MPI reads
    and writes the memory directly, as it does a device buffer: a reader that did not
    synchronise sees the memory before the queued work."""

    def __init__(self) -> None:
        self.queue: list[Any] = []
        self.syncs = 0

    def launch(self, work: Any) -> None:
        self.queue.append(work)

    def drain(self) -> None:
        while self.queue:
            self.queue.pop(0)()

    def synchronize(self) -> None:
        self.syncs += 1
        self.drain()


class FakeCupyArray(FakeDeviceArray):
    """A ``cupy.ndarray`` over host memory: ``get`` and ``set`` check their arguments as
    CuPy's do; implicit conversion to numpy is a ``TypeError``, as in CuPy."""

    def __init__(self, host: np.ndarray, cp: FakeCupy) -> None:
        super().__init__(host)
        self._cp = cp

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed (fake cupy)")

    def get(
        self, stream: Any = None, order: str = "C", out: np.ndarray | None = None
    ) -> np.ndarray:
        """A synchronous download: waits for the work queued on the stream first."""
        self._cp.downloads += 1
        self._cp.stream.drain()
        if out is None:
            return self.host.copy()
        if not isinstance(out, np.ndarray):
            raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
        if out.dtype != self.dtype:
            raise TypeError(f"{self.dtype} array cannot be obtained from {out.dtype} array")
        if out.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {out.shape}")
        if not out.flags.c_contiguous:
            raise ValueError("fake cupy: out must be C-contiguous")
        np.copyto(out, self.host)
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """An upload, queued on the stream (it reads ``arr`` when it runs, as an asynchronous
        copy does)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        self._cp.uploads += 1
        self._cp.stream.launch(lambda: np.copyto(self.host, arr))


class _FakeRuntime:
    def __init__(self, cp: FakeCupy, devices: int, hip: bool) -> None:
        self._cp, self._devices, self.is_hip = cp, devices, hip

    def runtimeGetVersion(self) -> int:
        return 60000000 if self.is_hip else 12080

    def getDeviceCount(self) -> int:
        return self._devices

    def getDeviceProperties(self, device: int) -> dict[str, Any]:
        return {"name": b"Fake GPU"}

    def deviceSynchronize(self) -> None:
        self._cp.stream.synchronize()


class _FakeDevice:
    def __init__(self, cp: FakeCupy, index: int) -> None:
        if not 0 <= index < cp.cuda.runtime.getDeviceCount():
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {index}")
        self._cp, self.id = cp, index

    def use(self) -> None:
        self._cp.device = self.id


class _FakeCuda:
    def __init__(self, cp: FakeCupy, devices: int, hip: bool) -> None:
        self._cp = cp
        self.runtime = _FakeRuntime(cp, devices, hip)

    def Device(self, index: int = 0) -> _FakeDevice:
        return _FakeDevice(self._cp, index)

    def get_current_stream(self) -> FakeStream:
        return self._cp.stream

    def alloc_pinned_memory(self, nbytes: int) -> bytearray:
        """Page-locked memory: an object with the buffer protocol (``numpy.frombuffer``)."""
        self._cp.pinned_allocations += 1
        return bytearray(nbytes)


class FakeCupy(types.ModuleType):
    """Just enough of CuPy for the device paths of ``dtm_mpi`` (``CupyDeviceOps``,
    ``open_backend``, the benchmarks' buffers), on host memory. Put it in ``sys.modules``
    as ``cupy`` (or import it from :func:`fake_cupy_package`'s directory).

    Counters for tests: ``stream.syncs``, ``downloads``, ``uploads``,
    ``pinned_allocations``; ``created`` lists the arrays made while ``recording``."""

    __version__ = "13.0.0+fake"
    float32, float64 = np.float32, np.float64

    def __init__(self, devices: int = 1, hip: bool = False) -> None:
        super().__init__("cupy", "fake CuPy: host memory posing as device memory (tests)")
        self.ndarray = FakeCupyArray
        self.stream = FakeStream()
        self.cuda = _FakeCuda(self, devices, hip)
        self.device: int | None = None
        self.downloads = self.uploads = self.pinned_allocations = 0
        self.recording = False
        self.created: list[FakeCupyArray] = []

    def _new(self, shape: Any, dtype: Any) -> FakeCupyArray:
        host = np.empty(shape, dtype=dtype)
        host.reshape(-1).view(np.uint8)[:] = 0xA5  # uninitialised memory: never all zeros
        out = FakeCupyArray(host, self)
        if self.recording:
            self.created.append(out)
        return out

    def empty(self, shape: Any, dtype: Any = np.float64) -> FakeCupyArray:
        return self._new(shape, dtype)

    def full(self, shape: Any, value: Any, dtype: Any = None) -> FakeCupyArray:
        out = self._new(shape, dtype if dtype is not None else np.asarray(value).dtype)
        self.stream.launch(lambda: out.host.fill(value))  # a fill kernel, queued
        return out

    def ones(self, shape: Any, dtype: Any = np.float64) -> FakeCupyArray:
        return self.full(shape, 1, dtype)

    def zeros(self, shape: Any, dtype: Any = np.float64) -> FakeCupyArray:
        return self.full(shape, 0, dtype)

    def ascontiguousarray(self, x: FakeCupyArray) -> FakeCupyArray:
        out = self._new(x.shape, x.dtype)
        self.stream.launch(lambda: np.copyto(out.host, x.host))
        return out

    def asnumpy(self, x: FakeCupyArray) -> np.ndarray:
        return x.get()


def fake_cupy_package(directory: str, devices: int = 1) -> dict[str, str]:
    """The environment for a child interpreter whose ``import cupy`` gives a :class:`FakeCupy`
    (written under ``directory``; this checkout on ``PYTHONPATH`` for ``tests``)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(os.path.join(directory, "cupy"), exist_ok=True)
    with open(os.path.join(directory, "cupy", "__init__.py"), "w", encoding="utf-8") as f:
        f.write(
            "import sys\n"
            "from tests.comm.fake_device import FakeCupy\n"
            f"_fake = FakeCupy(devices={devices})\n"
            "_fake.__spec__ = __spec__\n"
            "sys.modules[__name__] = _fake\n"
        )
    path = os.pathsep.join([directory, root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, PYTHONPATH=path)
