"""``dtm conformance``: the conformance cases over the language-neutral vectors
(``io/vectors/``) and the runtime, and the claim matrix they support.

Levels (what each claims; a case belongs to one):

* **L0** IR and local execution: every IR vector parses, verifies, prints canonically and has
  its recorded module hash; every invalid one is refused at its recorded line and column;
  every valid module runs on simulated ranks at its declared mesh to the reference (spec §7).
* **L1** membership, wire, collectives, P2P: every wire vector decodes to its values (and
  encodes to its bytes); every invalid frame is refused naming its part; under ``mpirun``
  with two or more ranks, the vectors that plan at the job's size run through the MPI runtime
  (handshake, collectives, send/recv) to the reference on every rank.
* **L2** store, task graph, CAP_QUANT: the task graph vectors; the manifest vector validates;
  every dtype round-trips through a store; ``quantize``/``dequantize`` agree with the spec's
  formula written out independently; the quantized allreduce stays within its stated bound.
* **L3** checkpoint, cancel, checksum, quota, resize: a checkpoint written on one mesh resumes
  on another to the same bits (deterministic mode); a cancelled save leaves nothing; a damaged
  data file is detected; a save over the quota is refused; a live resize runs (under
  ``mpirun`` only).
* **GPU**: the RawKernels against numpy on the rank's device (only where one exists).

A level is **claimed** when every one of its cases ran here; ``dtm conformance`` exits 1 when a
case of any level fails.
"""

from __future__ import annotations

import enum
import json
import re
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dtm_mpi.errors import DtmError, UsageError

__all__ = [
    "LEVELS",
    "CaseResult",
    "against_reference",
    "assert_close",
    "Level",
    "default_vectors",
    "inputs_for",
    "matrix_text",
    "run_conformance",
    "tolerance",
]


class Level(enum.Enum):
    L0 = "L0"
    L1 = "L1"
    L2 = "L2"
    L3 = "L3"
    GPU = "GPU"


LEVELS: dict[Level, str] = {
    Level.L0: "IR and local execution",
    Level.L1: "membership, wire, collectives, P2P",
    Level.L2: "store, task graph, CAP_QUANT",
    Level.L3: "checkpoint, cancel, checksum, quota, resize",
    Level.GPU: "GPU kernels",
}


@dataclass(frozen=True, slots=True)
class CaseResult:
    level: Level
    name: str
    ok: bool | None  # None: not run here
    detail: str = ""


def default_vectors() -> Path:
    """``io/vectors`` of the checkout this package is imported from."""
    return Path(__file__).resolve().parents[1] / "io" / "vectors"


Case = Callable[[], str | None]  # raises on failure; a string: not run here (why)


# --- shared with the tests: inputs and tolerances of a run against the reference -------------


def inputs_for(module: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Random values for every entry parameter without a usable init (none, or ``store``).
    Floats are in ±[0.5, 1.5] (safe for div, log of |x|, rsqrt of squares)."""
    from dtm_mpi.ir.dtypes import np_dtype
    from dtm_mpi.ir.nodes import InitKind

    entry = module.entry
    assert entry is not None
    rng = np.random.default_rng(seed)
    out = {}
    for p in entry.params:
        if p.init is not None and p.init.kind is not InitKind.STORE:
            continue
        shape, dtype = p.type.shape, np_dtype(p.type.dtype)
        if dtype.kind == "f":
            value = rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)
        elif dtype.kind == "b":
            value = rng.integers(0, 2, shape).astype(bool)
        else:
            value = rng.integers(-3, 4, shape)
        out[p.name.lstrip("%")] = np.asarray(value).astype(dtype)
    return out


def tolerance(module: Any, value: np.ndarray) -> float:
    """The tolerance of ``value`` against the reference: by the least precise float dtype of
    the module (a result inherits its rounding; spec §7.1)."""
    sizes = [
        t.dtype.itemsize
        for f in module.functions
        for t in [*(p.type for p in f.params), *(t for op in f.body for t in op.result_types)]
        if t.dtype.is_float
    ]
    return {2: 8e-3, 4: 2e-5, 8: 1e-12}[min(min(sizes, default=8), value.dtype.itemsize)]


def assert_close(module: Any, got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: {got.dtype}{got.shape} against {want.dtype}{want.shape}")
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    tol = tolerance(module, want)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


def against_reference(
    module: Any,
    inputs: dict[str, np.ndarray],
    steps: int,
    params: Mapping[str, np.ndarray],
    results: Sequence[Sequence[np.ndarray]],
) -> None:
    """A run of ``steps`` steps of ``module`` from ``inputs`` against the reference (spec §7):
    ``results``, the results of its last ``len(results)`` steps (all of them, or the last one
    a ``-o`` file holds), and ``params``, every entry parameter's final value by name."""
    from dtm_mpi.runtime.reference import run_reference

    ref_params, ref_results = run_reference(module, inputs, steps=steps)
    for s, (got, want) in enumerate(
        zip(results, ref_results[steps - len(results) :], strict=True), steps - len(results)
    ):
        if len(got) != len(want):
            raise AssertionError(f"step {s}: {len(got)} results, the reference {len(want)}")
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_close(module, np.asarray(a), b, f"step {s} result {i}")
    for name, value in ref_params.items():
        assert_close(module, np.asarray(params[name.lstrip("%")]), value, f"parameter {name}")


# --- the cases ---------------------------------------------------------------------------------


def _load(path: Path) -> Any:
    from dtm_mpi.ir import check_text

    module, errors = check_text(path.read_text(encoding="utf-8"), path.name)
    if errors or module is None:
        raise AssertionError(f"{path.name}: {errors[0] if errors else 'no module'}")
    return module


def _ir_valid(path: Path, hashes: dict[str, str]) -> Case:
    def case() -> None:
        from dtm_mpi.ir import module_hash, parse_module, print_module

        module = _load(path)
        printed = print_module(module)
        if print_module(parse_module(printed, path.name)) != printed:
            raise AssertionError("the canonical form is not a fixed point")
        if module_hash(module) != hashes.get(path.name):
            raise AssertionError(
                f"module hash {module_hash(module)} != recorded {hashes.get(path.name)}"
            )

    return case


_EXPECT = re.compile(r"// expect: (\d+):(\d+): (.+)")


def _ir_invalid(path: Path) -> Case:
    def case() -> None:
        from dtm_mpi.ir import check_text

        text = path.read_text(encoding="utf-8")
        m = _EXPECT.fullmatch(text.split("\n", 1)[0])
        if m is None:
            raise AssertionError("no '// expect: LINE:COL: fragment' first line")
        _, errors = check_text(text, path.name)
        if not errors:
            raise AssertionError("accepted; it must be refused")
        e = errors[0]
        where = (e.span.line, e.span.col)
        if where != (int(m.group(1)), int(m.group(2))) or m.group(3) not in str(e):
            raise AssertionError(
                f"first diagnostic {e.span.line}:{e.span.col}: {e}; expected {m.group(1)}:{m.group(2)}: {m.group(3)}"
            )

    return case


def _exec_local(path: Path) -> Case:
    def case() -> str | None:
        from dtm_mpi.ir.verify import function_mesh
        from dtm_mpi.runtime.simulate import run_simulated

        module = _load(path)
        mesh = function_mesh(module, module.entry)
        sizes = dict(mesh.axes) if mesh is not None else None
        nranks = int(np.prod(list(sizes.values()))) if sizes else 1
        if nranks > 8:
            return f"declares {nranks} ranks"
        inputs = inputs_for(module)
        try:
            got = run_simulated(module, nranks, binding=sizes, inputs=inputs, steps=2, timeout_s=30)
        except DtmError as exc:
            if "out of range" in str(exc):  # names coordinates beyond its declared mesh
                return "names mesh coordinates beyond its declared sizes"
            raise
        against_reference(module, inputs, 2, got.params, got.results)
        return None

    return case


def _wire(path: Path, valid: bool) -> Case:
    def case() -> None:
        from dtm_mpi.comm.frames import MessageType, decode_frame, encode_frame
        from dtm_mpi.errors import ProtocolError

        doc = json.loads(path.read_text())
        frame = bytes.fromhex(doc["frame"])
        if valid:
            values = {k: tuple(x) if isinstance(x, list) else x for k, x in doc["values"].items()}
            got = decode_frame(frame, expect=MessageType[doc["type"]])
            if dict(got.values) != values:
                raise AssertionError("decoded values differ")
            if (
                not doc.get("decode_only")
                and encode_frame(MessageType[doc["type"]], values) != frame
            ):
                raise AssertionError("encoded bytes differ")
            return
        try:
            decode_frame(frame, expect=MessageType.HELLO)
        except ProtocolError as exc:
            if exc.field != doc["part"]:
                raise AssertionError(f"refused naming {exc.field!r}, not {doc['part']!r}") from None
            return
        raise AssertionError("accepted; it must be refused")

    return case


def _tasks(path: Path, valid: bool) -> Case:
    def case() -> None:
        from dtm_mpi.errors import TaskGraphError
        from dtm_mpi.io.task_graph import parse_task_graph, task_deps

        if valid:
            g = parse_task_graph(path)
            want = json.loads(path.with_suffix(".deps.json").read_text())
            if {k: list(v) for k, v in task_deps(g.tasks).items()} != want:
                raise AssertionError("dependencies differ")
            return
        where, words = path.with_suffix(".error").read_text().strip().split(" ", 1)
        try:
            parse_task_graph(path)
        except TaskGraphError as exc:
            got = str(exc).replace(str(path), path.name)
            if not got.startswith(where) or words not in got:
                raise AssertionError(f"{got!r}; expected {where} … {words}") from None
            return
        raise AssertionError("accepted; it must be refused")

    return case


def _manifest(path: Path) -> Case:
    def case() -> None:
        from dtm_mpi.io.hashing import canonical_json
        from dtm_mpi.io.manifest import parse_manifest, validate_manifest

        doc = json.loads(path.read_text())
        m = parse_manifest(canonical_json(doc), path.name)
        validate_manifest(m, path.name)
        if m.to_bytes() != canonical_json(doc):
            raise AssertionError("the manifest does not round-trip to its canonical bytes")

    return case


def _store_roundtrip() -> None:
    from dtm_mpi.comm.handles import self_comm
    from dtm_mpi.io.store import committed_name
    from dtm_mpi.io.tools import bf16_bits, put_tensors, read_tensor

    rng = np.random.default_rng(3)
    values: dict[str, np.ndarray] = {
        "f16": rng.standard_normal(5).astype(np.float16),
        "bf16": rng.integers(0, 1 << 15, 4).astype(np.uint16),
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64": rng.standard_normal(2),
        "i8": rng.integers(-128, 128, 6).astype(np.int8),
        "i32": rng.integers(-9, 9, 3).astype(np.int32),
        "i64": rng.integers(-9, 9, (2, 2)).astype(np.int64),
        "u8": rng.integers(0, 256, 3).astype(np.uint8),
        "bool": rng.integers(0, 2, 4).astype(bool),
    }
    with tempfile.TemporaryDirectory(prefix="dtm-conformance-") as d:
        store = Path(d)
        put_tensors(store, self_comm(), values)
        for name, v in values.items():
            got = read_tensor(store / committed_name(0), name)
            if name == "bf16":
                got = bf16_bits(got)
            if got.tobytes() != v.tobytes():
                raise AssertionError(f"{name} changed on its way through the store")


def _quant_formula() -> None:
    from dtm_mpi.ir import check_text
    from dtm_mpi.runtime.reference import run_reference

    text = (
        "dtm 1.0\nmodule q\n"
        "entry func @main(%x: f32[6,32]) -> (i8[6,32], f32[6,4], f32[6,32]) requires [CAP_QUANT] {\n"
        "  %q, %s = quantize %x block 8 : i8[6,32], f32[6,4]\n"
        "  %y = dequantize %q, %s block 8 : f32[6,32]\n"
        "  return %q, %s, %y\n}\n"
    )
    module, errors = check_text(text, "quant")
    assert module is not None and not errors, errors
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((6, 32)) * rng.uniform(0.01, 100, (6, 1))).astype(np.float32)
    x[0, :8] = 0.0  # an all-zero block: scale 1
    _, (res,) = run_reference(module, {"x": x})
    b = x.astype(np.float64).reshape(6, 4, 8)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 127, 1.0)
    q = np.clip(np.round(b / scale), -127, 127).astype(np.int8).reshape(6, 32)  # half to even
    s = scale.reshape(6, 4).astype(np.float32)
    y = (q.reshape(6, 4, 8).astype(np.float64) * s.astype(np.float64)[..., None]).reshape(6, 32)
    np.testing.assert_array_equal(res[0], q, err_msg="quantize values")
    np.testing.assert_array_equal(res[1], s, err_msg="quantize scales")
    np.testing.assert_allclose(res[2], y.astype(np.float32), rtol=1e-7, err_msg="dequantize")
    bound = np.repeat(scale.reshape(6, 4), 8, axis=1) / 2
    if not np.all(np.abs(res[2].astype(np.float64) - x) <= bound * (1 + 1e-6) + 1e-30):
        raise AssertionError("a dequantized value is further than half a step from its input")


def _quant_allreduce() -> None:
    """The quantized allreduce on 3 simulated ranks within io/WIRE.md §6's bound."""
    from dtm_mpi.comm.quantized import QuantizedComm, error_bound
    from dtm_mpi.comm.sim import SimComm, run_ranks
    from dtm_mpi.ir.types import ReduceOp
    from dtm_mpi.sharding.mesh import MeshShape
    from dtm_mpi.sharding.steps import allreduce_spec

    mesh, n, block = MeshShape((("dp", 3),)), 5000, 32
    rng = np.random.default_rng(11)
    xs = [(rng.standard_normal(n) * 10.0**r).astype(np.float32) for r in range(3)]

    def body(comm: SimComm) -> np.ndarray:
        spec = allreduce_spec(mesh, comm.rank, ("dp",), ReduceOp.SUM, n)
        return QuantizedComm(comm, block).allreduce(xs[comm.rank], ("dp",), spec)

    outs = run_ranks(mesh, body, timeout_s=30)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    bound = error_bound(xs, block)
    for out in outs:
        if not np.array_equal(out, outs[0]):
            raise AssertionError("the members got different bits")
        if not np.all(np.abs(out - exact) <= bound):
            raise AssertionError("an element is outside the stated bound")


def _ckpt_other_mesh(root: Path) -> None:
    from dtm_mpi.runtime.policies import checkpoint_policy
    from dtm_mpi.runtime.simulate import run_simulated

    module = _load(root / "examples" / "tp_mlp.dtm")
    with tempfile.TemporaryDirectory(prefix="dtm-conformance-") as d:
        store = str(Path(d) / "s")
        run_simulated(
            module,
            4,
            binding={"dp": 2, "tp": 2},
            steps=2,
            deterministic=True,
            checkpoint=checkpoint_policy(store, every=2),
        )
        resumed = run_simulated(
            module,
            2,
            binding={"dp": 1, "tp": 2},
            steps=4,
            deterministic=True,
            checkpoint=checkpoint_policy(store, resume=True),
        )
    whole = run_simulated(module, 2, binding={"dp": 1, "tp": 2}, steps=4, deterministic=True)
    for k, v in whole.params.items():
        if resumed.params[k].tobytes() != v.tobytes():
            raise AssertionError(f"{k}: the resumed run differs from the uninterrupted one")


def _store_with(d: Path, **kw: Any) -> Any:
    from dtm_mpi.comm.handles import self_comm
    from dtm_mpi.io.checkpoint import CheckpointStore

    return CheckpointStore(d, self_comm(), **kw)


def _specs(values: dict[str, np.ndarray]) -> list[Any]:
    from dtm_mpi.io.ckpt_plan import TensorSpec
    from dtm_mpi.io.tools import dtm_dtype
    from dtm_mpi.ir.types import Layout, TensorType

    return [
        (TensorSpec(k, TensorType(dtm_dtype(v, k), v.shape, Layout.replicated(v.ndim))), v)
        for k, v in values.items()
    ]


def _x1() -> Any:
    from dtm_mpi.sharding.mesh import MeshShape

    return MeshShape((("x", 1),))


def _ckpt_cancel() -> None:
    import threading

    from dtm_mpi.io.store import list_checkpoints

    values = {f"t{i}": np.full(1000, i, np.float32) for i in range(4)}
    with tempfile.TemporaryDirectory(prefix="dtm-conformance-") as d:
        ckpt = _store_with(Path(d))
        go = threading.Event()
        try:  # the writer waits before its first tensor until the cancel is asked for
            handle = ckpt.save_async(1, _x1(), _specs(values), before_tensor=lambda i: go.wait(30))
            handle.cancel_requested = True
            go.set()
            cancelled = handle.cancel()
        finally:
            ckpt.close()
        left = list_checkpoints(Path(d))
        if not cancelled:
            raise AssertionError("a save cancelled before its first tensor committed")
        if left:
            raise AssertionError(f"a cancelled save left {[e.path.name for e in left]}")


def _ckpt_checksum() -> None:
    from dtm_mpi.errors import StorageError
    from dtm_mpi.io.store import committed_name
    from dtm_mpi.io.tools import read_tensor

    values = {"w": np.arange(4096, dtype=np.float32)}
    with tempfile.TemporaryDirectory(prefix="dtm-conformance-") as d:
        ckpt = _store_with(Path(d))
        try:
            ckpt.save(0, _x1(), _specs(values))
        finally:
            ckpt.close()
        data = Path(d) / committed_name(0) / "data-000000.h5"
        raw = bytearray(data.read_bytes())
        at = raw.find(np.arange(4096, dtype=np.float32).tobytes()[4000:4016])
        if at < 0:
            raise AssertionError("the tensor's bytes are not stored contiguously where expected")
        raw[at] ^= 0x40
        data.write_bytes(bytes(raw))
        try:
            read_tensor(Path(d) / committed_name(0), "w")
        except StorageError as exc:
            if "'w'" not in str(exc):
                raise AssertionError(f"detected, but not named: {exc}") from None
            return
        raise AssertionError("a flipped bit in a data file was read back silently")


def _ckpt_quota() -> None:
    from dtm_mpi.errors import QuotaError
    from dtm_mpi.io.store import list_checkpoints

    values = {"w": np.zeros(1 << 16, np.float32)}
    with tempfile.TemporaryDirectory(prefix="dtm-conformance-") as d:
        ckpt = _store_with(Path(d), quota_bytes=1 << 12)
        try:
            ckpt.save(0, _x1(), _specs(values))
        except QuotaError:
            if any(e.committed for e in list_checkpoints(Path(d))):
                raise AssertionError("refused, but a checkpoint was committed") from None
            return
        finally:
            ckpt.close()
        raise AssertionError("a save over the quota was not refused")


def _gpu() -> str | None:
    from dtm_mpi.kernels.backends import BackendKind, backend_problem, probe_devices

    p = probe_devices()
    kind = BackendKind.HIP if p.vendor == "hip" else BackendKind.CUDA
    why = backend_problem(kind, p)
    if why:
        return why
    from dtm_mpi.kernels import launch
    from dtm_mpi.kernels.devices import open_backend

    dev = open_backend(kind)
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    got = dev.to_host(launch.softmax(dev.to_device(x)))
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    return None


def _cases(vectors: Path, root: Path, world: Any) -> Iterator[tuple[Level, str, Case]]:
    hashes = json.loads((vectors / "ir" / "hashes.json").read_text())
    for p in sorted((vectors / "ir" / "valid").glob("*.dtm")):
        yield Level.L0, f"ir/valid/{p.name}", _ir_valid(p, hashes)
    for p in sorted((vectors / "ir" / "invalid").glob("*.dtm")):
        yield Level.L0, f"ir/invalid/{p.name}", _ir_invalid(p)
    for p in sorted((vectors / "ir" / "valid").glob("*.dtm")):
        yield Level.L0, f"run/{p.stem} (simulated, against the reference)", _exec_local(p)
    for kind in ("valid", "invalid"):
        for p in sorted((vectors / "wire" / kind).glob("*.json")):
            yield Level.L1, f"wire/{kind}/{p.name}", _wire(p, kind == "valid")
    for p in sorted((vectors / "ir" / "valid").glob("*.dtm")):
        yield Level.L1, f"mpi/{p.stem} (the MPI runtime, against the reference)", _mpi_run(p, world)
    for kind in ("valid", "invalid"):
        for p in sorted((vectors / "tasks" / kind).glob("*.toml")):
            yield Level.L2, f"tasks/{kind}/{p.name}", _tasks(p, kind == "valid")
    for p in sorted((vectors / "manifest").glob("*.json")):
        yield Level.L2, f"manifest/{p.name}", _manifest(p)
    yield Level.L2, "store: every dtype through a store, the same bytes", _store_roundtrip
    yield Level.L2, "CAP_QUANT: quantize/dequantize against the spec's formula", _quant_formula
    yield Level.L2, "CAP_QUANT: quantized allreduce within its stated bound", _quant_allreduce
    yield (
        Level.L3,
        "checkpoint on dp=2,tp=2 resumed on dp=1,tp=2, the same bits",
        lambda: _ckpt_other_mesh(root),
    )
    yield Level.L3, "cancel: a cancelled save leaves no checkpoint", _ckpt_cancel
    yield Level.L3, "checksum: a flipped bit in a data file is named", _ckpt_checksum
    yield Level.L3, "quota: a save over the quota is refused", _ckpt_quota
    yield (
        Level.L3,
        "resize: shrunk to one rank and grown back, the same bits",
        lambda: _resize(world, root),
    )
    yield Level.GPU, "softmax RawKernel against numpy", _gpu


def _mpi_run(path: Path, world: Any) -> Case:
    """The vector on its declared mesh through the MPI runtime (on the job's first ranks, as
    many as the mesh has), against the reference on the group's first rank."""

    def case() -> str | None:
        if world is None or int(world.Get_size()) < 2:
            return "needs mpirun with 2 or more ranks"
        from dtm_mpi.comm.handles import free, split
        from dtm_mpi.ir.verify import function_mesh
        from dtm_mpi.runtime.mpirun import run_under_mpi
        from dtm_mpi.runtime.request import RunRequest
        from dtm_mpi.runtime.step_loop import RunHooks

        module = _load(path)
        size, rank = int(world.Get_size()), int(world.Get_rank())
        mesh = function_mesh(module, module.entry)
        sizes = dict(mesh.axes) if mesh is not None else None
        need = int(np.prod(list(sizes.values()))) if sizes else size
        if need > size:
            return f"needs {need} ranks (its declared mesh)"
        group = split(world, 0 if rank < need else None, rank)
        if group is None:
            return None
        inputs = inputs_for(module)
        outputs: dict[str, np.ndarray] = {}
        hooks = RunHooks(values=inputs, on_outputs=outputs.update)
        request = RunRequest(
            str(path), binding=sizes, steps=2, module=module, hooks=hooks, label="dtm conformance"
        )
        try:
            run_under_mpi(request, world=group)
            if rank == 0:  # the -o file's outputs: the last step's results, every parameter
                last = [outputs[f"result{i}"] for i in range(len(module.entry.results))]
                against_reference(module, inputs, 2, outputs, [last])
        finally:
            free(group)
        return None

    return case


def _resize(world: Any, root: Path) -> str | None:
    """Under mpirun: tp_mlp on every rank over dp, shrunk to one rank after step 1 and grown
    back after step 2, in deterministic mode: the same bits as one rank's run."""
    if world is None or int(world.Get_size()) < 2:
        return "a live resize needs mpirun with 2 or more ranks"
    from dtm_mpi.config import set_setting
    from dtm_mpi.runtime.mpirun import run_under_mpi
    from dtm_mpi.runtime.policies import resize_policy
    from dtm_mpi.runtime.request import RunRequest
    from dtm_mpi.runtime.simulate import run_simulated
    from dtm_mpi.runtime.step_loop import RunHooks

    path = root / "examples" / "tp_mlp.dtm"
    module = _load(path)
    size = int(world.Get_size())
    outputs: dict[str, np.ndarray] = {}
    at = ((1, {"dp": 1, "tp": 1}), (2, {"dp": size, "tp": 1}))
    from dtm_mpi.config import get_config

    was = get_config().deterministic
    set_setting("deterministic", True)
    try:
        run_under_mpi(
            RunRequest(
                str(path),
                binding={"dp": size, "tp": 1},
                steps=3,
                module=module,
                hooks=RunHooks(on_outputs=outputs.update),
                resize=resize_policy(at),
                label="dtm conformance",
            ),
            world=world,
        )
    finally:
        set_setting("deterministic", int(was))
    if int(world.Get_rank()) == 0:
        want = run_simulated(module, 1, binding={"dp": 1, "tp": 1}, steps=3, deterministic=True)
        for k, v in want.params.items():
            if outputs[k].tobytes() != v.tobytes():
                raise AssertionError(f"{k}: the resized run differs from one rank's")
    return None


def run_conformance(
    levels: Sequence[Level] = tuple(Level), *, vectors: Path | None = None, world: Any = None
) -> list[CaseResult]:
    """Run every case of ``levels``; ``world``: the job's communicator under mpirun (the MPI
    cases run on it; every rank calls), None alone."""
    vectors = vectors or default_vectors()
    if not (vectors / "ir" / "hashes.json").is_file():
        raise UsageError(f"{vectors}: not a vectors folder (no ir/hashes.json); give --vectors")
    root = vectors.parents[1]
    out = []
    for level, name, case in _cases(vectors, root, world):
        if level not in levels:
            continue
        try:
            why = case()
            out.append(CaseResult(level, name, None if why else True, why or ""))
        except (AssertionError, DtmError, OSError, ValueError, KeyError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            out.append(CaseResult(level, name, False, detail))
        except Exception as exc:  # a bug in the implementation: say where
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            out.append(
                CaseResult(
                    level, name, False, f"{type(exc).__name__}: {exc} ({tb.filename}:{tb.lineno})"
                )
            )
    return out


def matrix_text(results: Sequence[CaseResult], *, verbose: bool = False) -> str:
    """The claim matrix: per level, cases run and passed, and whether it is claimed."""
    lines = [f"{'level':<6} {'claim':<45} {'run':>5} {'passed':>7}  status"]
    for level, title in LEVELS.items():
        mine = [r for r in results if r.level is level]
        if not mine:
            continue
        ran = [r for r in mine if r.ok is not None]
        failed = [r for r in ran if not r.ok]
        skipped = [r for r in mine if r.ok is None]
        if failed:
            status = f"FAIL ({len(failed)})"
        elif not ran:
            status = f"not claimed: {skipped[0].detail}"
        elif skipped:
            reasons = sorted({r.detail for r in skipped})
            status = f"pass, not claimed: {len(skipped)} not run ({'; '.join(reasons)[:90]})"
        else:
            status = "claimed: pass"
        lines.append(
            f"{level.value:<6} {title:<45} {len(ran):>5} {len(ran) - len(failed):>7}  {status}"
        )
    bad = [r for r in results if r.ok is False]
    if bad:
        lines += ["", "failures:"] + [f"  {r.level.value} {r.name}: {r.detail}" for r in bad]
    if verbose:
        lines += ["", "cases:"] + [
            f"  {r.level.value} {'ok  ' if r.ok else 'FAIL' if r.ok is False else 'skip'} {r.name}{': ' + r.detail if r.detail else ''}"
            for r in results
        ]
    return "\n".join(lines)
