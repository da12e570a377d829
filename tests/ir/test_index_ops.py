"""``take`` and ``scatter_add`` (IR 1.1): their sharding rules, numpy semantics on every mesh
(a vocab-parallel table, uneven splits, indices split over another axis), bad indices named
with their global position, and the version rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm_mpi.errors import DtmError, VerifyError
from dtm_mpi.ir import load_module, print_module
from dtm_mpi.runtime.reference import run_reference
from dtm_mpi.runtime.simulate import run_simulated

IDS = [[0, 10, 3], [3, 3, 7], [10, 1, 2], [5, 5, 5]]
EMB = f"""dtm 1.1
module emb
mesh @m = [dp=2, tp=2]

entry func @main(%w: f32[11,6]{{tp,-}}, %u: f32[4,3,6]{{dp,-,-}}, %t: f64[2,11,5]{{-,-,tp}}) -> (
    f32[4,3,6]{{dp,-,-}}, f32[11,6]{{tp,-}}, f64[2,4,3,5]{{-,dp,-,tp}}) on @m {{
  %ids = constant {IDS} : i64[4,3]{{dp,-}}
  %r = take %w, %ids dim 0 : f32[4,3,6]{{dp,-,-}} partial(sum: tp)
  %y = allreduce sum %r on tp : f32[4,3,6]{{dp,-,-}}
  %s = scatter_add %u, %ids dim 0 : f32[11,6]{{tp,-}} partial(sum: dp)
  %g = allreduce sum %s on dp : f32[11,6]{{tp,-}}
  %x = take %t, %ids dim 1 : f64[2,4,3,5]{{-,dp,-,tp}}
  return %y, %g, %x
}}
"""
BINDINGS = [
    (1, {"dp": 1, "tp": 1}),
    (2, {"dp": 1, "tp": 2}),
    (2, {"dp": 2, "tp": 1}),
    (3, {"dp": 1, "tp": 3}),
    (4, {"dp": 2, "tp": 2}),
    (4, {"dp": 1, "tp": 4}),
]


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((11, 6)).astype(np.float32),
        "u": rng.standard_normal((4, 3, 6)).astype(np.float32),
        "t": rng.standard_normal((2, 11, 5)),
    }


@pytest.mark.parametrize(("ranks", "binding"), BINDINGS, ids=[str(b) for _, b in BINDINGS])
def test_take_and_scatter_add_equal_numpy_on_every_mesh(
    ranks: int, binding: dict[str, int]
) -> None:
    module = load_module(EMB, "emb.dtm")
    assert print_module(load_module(print_module(module))) == print_module(module)
    vals = _inputs()
    y, g, x = run_simulated(module, ranks, binding=binding, inputs=vals).results[0]
    ids = np.array(IDS)
    assert np.array_equal(y, vals["w"][ids])  # a lookup is a copy: exact on every mesh
    want = np.zeros((11, 6), np.float32)
    np.add.at(want, ids.reshape(-1), vals["u"].reshape(12, 6))
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)  # dp partial sums: order differs
    assert np.array_equal(x, np.take(vals["t"], ids, axis=1))
    _, ref = run_reference(module, vals)
    assert np.array_equal(ref[0][0], y) and np.array_equal(ref[0][2], x)


def _body(
    lines: str,
    params: str = "%w: f32[11,6]{tp,-}",
    results: str = "f32[4,3,6]{dp,-,-}",
    version: str = "1.1",
) -> str:
    return f"""dtm {version}
module bad
mesh @m = [dp=2, tp=2]
entry func @main({params}) -> {results} on @m {{
{lines}
}}
"""


@pytest.mark.parametrize(
    ("lines", "params", "message"),
    [
        (
            "  %i = constant [1.0, 2.0] : f32[2]\n  %r = take %w, %i dim 0 : f32[2,6]\n  return %r",
            "%w: f32[11,6]",
            "indices must have an integer dtype; got f32",
        ),
        (
            "  %i0 = constant [1, 2] : i64[2]\n  %i = redistribute %i0 : i64[2] partial(sum: dp)\n  %r = take %w, %i dim 0 : f32[2,6]\n  return %r",
            "%w: f32[11,6]",
            "indices cannot be a pending reduction",
        ),
        (
            "  %i = constant [1, 2] : i64[2]{tp}\n  %r = take %w, %i dim 0 : f32[2,6] partial(sum: tp)\n  return %r",
            "%w: f32[11,6]{tp,-}",
            "would use mesh axis 'tp' twice",
        ),
        (
            "  %i = constant [1, 2] : i64[2]\n  %r = take %w, %i dim 2 : f32[2,6]\n  return %r",
            "%w: f32[11,6]",
            "dim 2 is out of range for rank 2",
        ),
        (
            "  %i = constant [1, 2] : i64[2]\n  %r = take %w, %i dim 0 : f32[2,6]\n  return %r",
            "%w: f32[11,6]{tp,-}",
            "the rule gives f32[2,6] partial(sum: tp)",
        ),
        (
            "  %i = constant [1, 2] : i64[2]\n  %r = scatter_add %w, %i dim 0 : f32[5,6]\n  return %r",
            "%w: f32[11,6]",
            "indices [2] must match dims 0..0 of the updates [11, 6]",
        ),
        (
            "  %i = constant [1, 2] : i64[2]{dp}\n  %r = scatter_add %w, %i dim 0 : f32[5,6]\n  return %r",
            "%w: f32[2,6]",
            "the indices must be split as the updates' dims 0..0",
        ),
        (
            "  %i = constant [1, 2] : i64[2]\n  %r = scatter_add %w, %i dim 0 : f32[5,7]\n  return %r",
            "%w: f32[2,6]",
            "result must be f32[N,6]",
        ),
        (
            "  %i = constant [1, 2] : i64[2]\n  %r = scatter_add %w, %i dim 0 : f32[5,6]{-,tp}\n  return %r",
            "%w: f32[2,6]",
            "the rule gives f32[5,6]",
        ),
    ],
)
def test_rule_errors_name_the_op_and_place(lines: str, params: str, message: str) -> None:
    op_line = next(ln for ln in lines.splitlines() if "take" in ln or "scatter_add" in ln)
    src = _body(lines, params, results=op_line.split(" : ", 1)[1])
    with pytest.raises(VerifyError) as err:
        load_module(src, "bad.dtm")
    text = str(err.value)
    line = next(
        n for n, ln in enumerate(src.splitlines(), 1) if "take" in ln or "scatter_add" in ln
    )
    assert message in text and f"bad.dtm:{line}:" in text, text


def test_a_1_0_module_cannot_use_them() -> None:
    with pytest.raises(VerifyError) as err:
        load_module(EMB.replace("dtm 1.1", "dtm 1.0"), "old.dtm")
    assert "old.dtm:8:8" in str(err.value) and "take is new in IR dtm 1.1" in str(err.value)
    old = _body(
        "  %r = neg %w : f32[11,6]{tp,-}\n  return %r", results="f32[11,6]{tp,-}", version="1.0"
    )
    assert print_module(load_module(old)).startswith("dtm 1.0\n")  # 1.0 modules stay 1.0


@pytest.mark.parametrize(
    ("bad", "where"), [("[5, 11, 5]", "index 11 at [3, 1]"), ("[-1, 5, 5]", "index -1 at [3, 0]")]
)
@pytest.mark.parametrize(("ranks", "binding"), [(1, {"dp": 1, "tp": 1}), (4, {"dp": 2, "tp": 2})])
def test_an_index_out_of_range_is_named_with_its_global_place(
    bad: str, where: str, ranks: int, binding: dict[str, int]
) -> None:
    module = load_module(EMB.replace("[5, 5, 5]", bad), "emb.dtm")
    with pytest.raises(DtmError) as err:
        run_simulated(module, ranks, binding=binding, inputs=_inputs())
    text = str(err.value)
    assert f"take: {where} is outside [0, 11) of dim 0" in text and "emb.dtm:8:8" in text, text


SMALL_INDEX = """dtm 1.1
module s
mesh @m = [tp=2]
entry func @main(%x: f32[5]{tp}, %t: f32[512,4]{tp,-}, %g: f32[3,4]) -> (f32[] partial(sum: tp), f32[3,4] partial(sum: tp), f32[512,4]{tp,-}) on @m {
  %i = constant 3 : i64[]
  %r = take %x, %i dim 0 : f32[] partial(sum: tp)
  %u = constant [1, 200, 255] : u8[3]
  %q = take %t, %u dim 0 : f32[3,4] partial(sum: tp)
  %s = scatter_add %g, %u dim 0 : f32[512,4]{tp,-}
  return %r, %q, %s
}
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_scalar_index_and_u8_indices_past_a_blocks_start(ranks: int) -> None:
    """A 0-d index gives a 0-d value; u8 indices into rows beyond 255 of the rank's block
    (its rows start at 256) are compared in a wide type, not wrapped or overflowed."""
    module = load_module(SMALL_INDEX, "s.dtm")
    rng = np.random.default_rng(2)
    vals = {
        "x": rng.standard_normal(5).astype(np.float32),
        "t": rng.standard_normal((512, 4)).astype(np.float32),
        "g": rng.standard_normal((3, 4)).astype(np.float32),
    }
    r, q, s = run_simulated(module, ranks, binding={"tp": ranks}, inputs=vals).results[0]
    assert r.shape == () and r == vals["x"][3]
    assert np.array_equal(q, vals["t"][[1, 200, 255]])
    want = np.zeros((512, 4), np.float32)
    want[[1, 200, 255]] = vals["g"]
    assert np.array_equal(s, want)
    _, ref = run_reference(module, vals)
    assert ref[0][0].shape == ()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    updates=st.integers(0, 300),
    width=st.integers(1, 4),
    dtype=st.sampled_from(["float32", "float64", "float16", "int32"]),
    crowded=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_scatter_adds_in_passes_give_numpys_add_at_bit_for_bit(
    rows: int, updates: int, width: int, dtype: str, crowded: bool, seed: int
) -> None:
    """The embedding gradient's kernel adds in passes (one update per target row each) where
    that is faster, else with ``add.at``: either way each row's updates are added one by one
    in their order, the bits of ``numpy.add.at`` (signed zeros and NaN included)."""
    from dtm_mpi.ir.ops.index import add_in_order

    rng = np.random.default_rng(seed)
    flat = rng.integers(0, min(2, rows) if crowded else rows, updates)
    u = (rng.standard_normal((updates, width)) * 10).astype(dtype)
    if dtype != "int32" and updates:
        u[::5] = -0.0
        u[0, 0] = np.nan if seed % 3 == 0 else u[0, 0]
    want = np.zeros((rows, width), dtype)
    np.add.at(want, flat, u)
    got = np.zeros((rows, width), dtype)
    add_in_order(got, flat, u)
    assert np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
