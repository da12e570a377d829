"""The numpy kernels on local blocks under the uneven-split rule (spec §5): creation ops give
each rank its block of the global tensor, reductions over a sharded dim give contributions
whose reduction is the global value (``mean`` divides by the global count; an empty block
contributes the identity), and the kernel registry covers every op that is not communication."""

from __future__ import annotations

import numpy as np
import pytest

from dtm_mpi.errors import KernelError
from dtm_mpi.ir import load_module
from dtm_mpi.ir.nodes import Module, Op
from dtm_mpi.ir.registry import OPS, lookup_op
from dtm_mpi.ir.types import Layout, ReduceOp, TensorType
from dtm_mpi.kernels import COMM_OPS, KernelContext, backend_kernels, kernel_for
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.runtime.simulate import run_simulated
from dtm_mpi.sharding import MeshShape, local_block, local_offsets, local_shape, reduce_arrays

LITERAL = (
    "["
    + ", ".join("[" + ", ".join(f"{i * 7 + j + 0.25}" for j in range(7)) + "]" for i in range(10))
    + "]"
)

CREATE = f"""dtm 1.0
module create_blocks

mesh @m = [dp=3, tp=2]

entry func @main(%o: i64[]) -> () on @m {{
  %i1 = iota dim 1 : f32[10,7]{{dp,tp}}
  %i0 = iota dim 0 : i32[10,7]{{dp,tp}}
  %ig = iota dim 0 : i64[10,7]{{(tp,dp),-}}
  %rn = random normal seed 7 offset %o mean 1.0 std 2.0 : f32[10,7]{{dp,tp}}
  %ru = random uniform seed 3 low -1.0 high 1.0 : f64[10,7]{{(tp,dp),-}}
  %c = constant {LITERAL} : f32[10,7]{{dp,tp}}
  %cs = constant 2.5 : f16[10,7]{{-,(dp,tp)}}
  return
}}
"""

MESH = MeshShape((("dp", 3), ("tp", 2)))


def ops_of(text: str) -> dict[str, Op]:
    module = load_module(text, "kernels.dtm")
    entry = module.entry
    assert entry is not None
    return {op.results[0]: op for op in entry.body if op.results}


def context(
    op: Op, operand_types: tuple[TensorType, ...], mesh: MeshShape, rank: int, step: int = 0
) -> KernelContext:
    t = op.result_types[0]
    return KernelContext(
        op,
        operand_types,
        op.result_types,
        (local_shape(t.shape, t.layout, mesh, rank),),
        (local_offsets(t.shape, t.layout, mesh, rank),),
        step,
    )


@pytest.mark.parametrize("name", ["%i1", "%i0", "%ig", "%rn", "%ru", "%c", "%cs"])
def test_creation_blocks_are_blocks_of_the_global_tensor(name: str) -> None:
    module = load_module(CREATE, "kernels.dtm")
    entry = module.entry
    assert entry is not None
    op = ops_of(CREATE)[name]
    offset = np.array(5, dtype=np.int64)
    xs = [offset] if op.operands else []
    operand_types = tuple(entry.params[0].type for _ in op.operands)
    t = op.result_types[0]
    (whole,) = OPS[op.name].reference(op, xs, op.result_types)
    assert whole.shape == (10, 7)
    kernel = kernel_for("numpy", op.name)
    covered = np.zeros((10, 7), dtype=int)
    for rank in range(MESH.size):
        (block,) = kernel(context(op, operand_types, MESH, rank), xs)
        index = local_block(t.shape, t.layout, MESH, rank)
        assert block.dtype == whole.dtype
        np.testing.assert_array_equal(block, whole[index], err_msg=f"rank {rank}")
        covered[index] += 1
    # the blocks tile the tensor, once per replica over the axes the layout does not use
    replicas = MESH.size // max(1, MESH.group_size(t.layout.sharded_axes))
    assert (covered == replicas).all()


def test_uneven_block_shapes() -> None:
    t = ops_of(CREATE)["%i1"].result_types[0]
    shapes = [local_shape(t.shape, t.layout, MESH, r) for r in range(MESH.size)]
    assert shapes == [(4, 4), (4, 3), (4, 4), (4, 3), (2, 4), (2, 3)]


def test_random_offset_changes_values() -> None:
    op = ops_of(CREATE)["%rn"]
    module = load_module(CREATE, "kernels.dtm")
    assert module.entry is not None
    types = (module.entry.params[0].type,)
    kernel = kernel_for("numpy", "random")
    a = kernel(context(op, types, MESH, 4), [np.array(0, np.int64)])[0]
    b = kernel(context(op, types, MESH, 4), [np.array(1, np.int64)])[0]
    assert a.shape == b.shape == (2, 4)
    assert not np.array_equal(a, b)


# --- reductions over a sharded dim -----------------------------------------------------------


def reduction_module(op: str, dtype: str, n: int, k: int, keep: bool) -> str:
    kd = " keepdims" if keep else ""
    pending = "sum" if op in ("sum", "mean") else op
    shape = "[1,3]" if keep else "[3]"
    dims = "{-,-}" if keep else ""
    init = "init normal(seed=4, std=1.0)" if dtype.startswith("f") else ""
    return f"""dtm 1.0
module red

mesh @m = [dp={k}]

entry func @main(%x: {dtype}[{n},3]{{dp,-}} {init}) -> {dtype}{shape}{dims} on @m {{
  %p = {op} %x dims [0]{kd} : {dtype}{shape}{dims} partial({pending}: dp)
  %y = allreduce {pending} %p on dp : {dtype}{shape}{dims}
  return %y
}}
"""


def contributions(module: Module, x: np.ndarray, k: int) -> list[np.ndarray]:
    entry = module.entry
    assert entry is not None
    op = entry.body[0]
    mesh = MeshShape((("dp", k),))
    t = entry.params[0].type
    kernel = kernel_for("numpy", op.name)
    return [
        kernel(context(op, (t,), mesh, r), [x[local_block(t.shape, t.layout, mesh, r)]])[0]
        for r in range(k)
    ]


@pytest.mark.parametrize(("n", "k"), [(10, 3), (10, 4), (2, 4), (7, 1)])
def test_mean_divides_by_the_global_count(n: int, k: int) -> None:
    module = load_module(reduction_module("mean", "f64", n, k, False))
    x = np.random.default_rng(n).standard_normal((n, 3))
    parts = contributions(module, x, k)
    mesh = MeshShape((("dp", k),))
    layout = Layout((("dp",), ()))
    for r, part in enumerate(parts):
        block: np.ndarray = x[local_block((n, 3), layout, mesh, r)]
        np.testing.assert_allclose(part, block.sum(axis=0) / n, rtol=1e-13, atol=1e-15)
        assert np.isfinite(part).all()  # an empty block contributes 0, not 0/0
    np.testing.assert_allclose(reduce_arrays(parts, ReduceOp.SUM), x.mean(axis=0), rtol=1e-12)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "f64", "i32", "i8", "u8"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_extremum_with_empty_blocks(op: str, dtype: str, keep: bool) -> None:
    # n = 2 over 4 ranks: ranks 2 and 3 hold empty blocks and contribute the identity
    module = load_module(reduction_module(op, dtype, 2, 4, keep))
    npd = np.dtype(
        {"f32": "float32", "f64": "float64", "i32": "int32", "i8": "int8", "u8": "uint8"}[dtype]
    )
    x = np.array([[3, 1, 2], [1, 5, 0]]).astype(npd)
    parts = contributions(module, x, 4)
    if npd.kind == "f":
        identity = -np.inf if op == "max" else np.inf
    else:
        info = np.iinfo(npd)
        identity = info.min if op == "max" else info.max
    shape = (1, 3) if keep else (3,)
    for r in (2, 3):
        assert parts[r].shape == shape and parts[r].dtype == npd
        assert (parts[r] == identity).all(), (r, parts[r])
    fn = np.max if op == "max" else np.min
    np.testing.assert_array_equal(parts[0], fn(x[:1], axis=0, keepdims=keep))
    total = reduce_arrays(parts, ReduceOp.MAX if op == "max" else ReduceOp.MIN)
    np.testing.assert_array_equal(total, fn(x, axis=0, keepdims=keep))


@pytest.mark.parametrize("op", ["max", "min", "sum", "mean"])
def test_reduction_with_empty_blocks_end_to_end(op: str) -> None:
    module = load_module(reduction_module(op, "f32", 2, 4, False))
    got = run_simulated(module, 4, steps=1, timeout_s=30)
    _, ref = run_reference(module, steps=1)
    np.testing.assert_allclose(got.results[0][0], ref[0][0], rtol=1e-6)
    assert np.isfinite(got.results[0][0]).all()


# --- other block-aware kernels ---------------------------------------------------------------

SLICE = """dtm 1.0
module sl

mesh @m = [dp=3, tp=2]

entry func @main(%x: f32[10,6]{dp,-}) -> () on @m {
  %s = slice %x start [0, 2] limit [10, 5] : f32[10,3]{dp,-}
  %t = step_index : i64[]
  return
}
"""


def test_slice_keeps_sharded_dims_whole() -> None:
    module = load_module(SLICE)
    assert module.entry is not None
    t_in = module.entry.params[0].type
    op = ops_of(SLICE)["%s"]
    x = np.arange(60, dtype=np.float32).reshape(10, 6)
    kernel = kernel_for("numpy", "slice")
    for r in range(MESH.size):
        block = x[local_block(t_in.shape, t_in.layout, MESH, r)]
        (out,) = kernel(context(op, (t_in,), MESH, r), [block])
        t = op.result_types[0]
        np.testing.assert_array_equal(out, x[:, 2:5][local_block(t.shape, t.layout, MESH, r)])


def test_step_index_is_the_step() -> None:
    op = ops_of(SLICE)["%t"]
    (out,) = kernel_for("numpy", "step_index")(context(op, (), MESH, 5, step=7), [])
    assert out.dtype == np.int64 and out.shape == () and int(out) == 7


# --- the registry ----------------------------------------------------------------------------


def test_every_local_op_has_a_numpy_kernel() -> None:
    lookup_op("add")
    local = set(OPS) - COMM_OPS
    assert len(local) >= 30
    table = backend_kernels("numpy")
    for name in sorted(local):
        assert callable(kernel_for("numpy", name)), name
    assert set(table) == local
    assert not set(table) & COMM_OPS


@pytest.mark.parametrize("name", sorted(COMM_OPS))
def test_communication_ops_have_no_kernel(name: str) -> None:
    with pytest.raises(KernelError, match=rf"backend 'numpy' has no kernel for op '{name}'"):
        kernel_for("numpy", name)


def test_unknown_backend() -> None:
    with pytest.raises(KernelError, match="nosuch"):
        kernel_for("nosuch", "add")
    with pytest.raises(KernelError, match="nosuch"):
        backend_kernels("nosuch")


def test_broadcast_to_is_a_read_only_view_of_its_operand() -> None:
    """No copy (a GPT step copied 63 broadcasts); a write into it fails loudly."""
    text = """dtm 1.0
module b
mesh @m = [dp=2]
entry func @f(%x: f32[1,5]) -> (f32[6,5]{dp,-}) on @m {
  %y = broadcast_to %x : f32[6,5]
  %z = redistribute %y : f32[6,5]{dp,-}
  return %z
}
"""
    op = ops_of(text)["%y"]
    mesh = MeshShape((("dp", 2),))
    x = np.arange(5, dtype=np.float32).reshape(1, 5)
    (got,) = kernel_for("numpy", "broadcast_to")(context(op, (op_types(text, "%x"),), mesh, 1), [x])
    assert got.shape == (6, 5) and np.shares_memory(got, x)
    np.testing.assert_array_equal(got, np.broadcast_to(x, (6, 5)))
    with pytest.raises(ValueError):
        got[0, 0] = 1.0


def op_types(text: str, name: str) -> TensorType:
    module = load_module(text, "kernels.dtm")
    entry = module.entry
    assert entry is not None
    return next(p.type for p in entry.params if p.name == name)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_softmax_worked_in_place_gives_the_formulas_bits(log: bool, dtype: str) -> None:
    from dtm_mpi.ir.ops.reduce import _softmax_np

    x = (np.random.default_rng(0).standard_normal((7, 33)) * 4).astype(dtype)
    shifted = x - np.max(x, axis=-1, keepdims=True)
    if log:
        want = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
    else:
        e = np.exp(shifted)
        want = e / np.sum(e, axis=-1, keepdims=True)
    got = _softmax_np(x, 1, log)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_layer_norm_works_in_binary32_below_f64() -> None:
    """f32 in binary32 (within a few float32 roundings of the binary64 formula), f64 in
    binary64 (to its last bits)."""
    from dtm_mpi.ir.ops.reduce import _layer_norm_ref

    text = """dtm 1.0
module ln
mesh @m = [dp=1]
entry func @f(%x: f32[64,96], %g: f32[96], %b: f32[96]) -> (f32[64,96]) on @m {
  %y = layer_norm %x, %g, %b eps 0.00001 : f32[64,96]
  return %y
}
"""
    op = ops_of(text)["%y"]
    rng = np.random.default_rng(1)
    x64, g64, b64 = rng.normal(3, 2, (64, 96)), rng.normal(1, 0.1, 96), rng.normal(0, 0.1, 96)

    def exact(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
        x, g, b = (v.astype(np.float64) for v in (x, g, b))
        c = x - x.mean(axis=-1, keepdims=True)
        return c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + 1e-5) * g + b

    f32 = [v.astype(np.float32) for v in (x64, g64, b64)]
    (got,) = _layer_norm_ref(op, f32, op.result_types)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, exact(*f32), rtol=0, atol=4e-6)
    from dtm_mpi.ir.types import DType

    t64 = TensorType(DType.F64, (64, 96), Layout.replicated(2))
    (got64,) = _layer_norm_ref(op, [x64, g64, b64], (t64,))
    np.testing.assert_allclose(got64, exact(x64, g64, b64), rtol=0, atol=1e-14)
