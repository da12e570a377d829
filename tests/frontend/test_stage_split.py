"""Pipeline stages from the frontend (dtm_mpi.frontend.stage_split, dtm_mpi.ir.stages): a
traced forward cut before named layers, its boundary routes (skip connections included), and
the located errors for splits that cannot be."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtm_mpi import frontend as dtm
from dtm_mpi.errors import TraceError, UsageError
from dtm_mpi.frontend import functional as fn
from dtm_mpi.frontend.stage_split import forward_stages
from dtm_mpi.ir.nodes import Param
from dtm_mpi.ir.stages import partition_stages

HERE = Path(__file__).name
TOKENS = {
    "ids": dtm.Input((4, 8), "i32", ("dp", None)),
    "tgt": dtm.Input((4, 8), "i32", ("dp", None)),
}


def _lm_loss(m: dtm.nn.GPT, ids: dtm.Tensor, tgt: dtm.Tensor) -> dtm.Tensor:
    logits = m(ids)
    return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def test_a_gpt_cut_before_three_blocks_is_four_stages_passing_the_residual_stream() -> None:
    model = dtm.nn.GPT(16, 8, 32, 2, 4)
    part = forward_stages(
        model,
        _lm_loss,
        mesh=dtm.Mesh(dp=1, tp=2),
        inputs=TOKENS,
        splits=["blocks.1", "blocks.2", "blocks.3"],
    )
    assert len(part.stages) == 4
    # one route per boundary: the residual stream [B, T, D], from each stage to the next
    assert [(r.src, r.dst, r.type.shape) for r in part.routes] == [
        (0, (1,), (4, 8, 32)),
        (1, (2,), (4, 8, 32)),
        (2, (3,), (4, 8, 32)),
    ]
    for s in part.stages:
        assert s.receives == tuple(r.value for r in part.routes if s.index in r.dst)
        assert s.sends == tuple(r.value for r in part.routes if r.src == s.index)
    # every parameter on the stage of its layer; the tokens where they are used
    for path, _, _, _ in model.named_parameters():
        k = int(path.split(".")[1]) if path.startswith("blocks.") else None
        want = k if k is not None else (0 if path in ("tok.weight", "pos") else 3)
        assert part.stage_of("%" + path) == want, path
    assert [s.inputs for s in part.stages] == [("%ids",), (), (), ("%tgt",)]
    assert "route %" in part.text() and "stage 3:" in part.text()


class _Skip(dtm.nn.Module):
    """Three layers; the first one's output is also added before the last (a skip
    connection over a stage)."""

    def __init__(self) -> None:
        self.a = dtm.nn.Linear(8, 8)
        self.b = dtm.nn.Linear(8, 8)
        self.c = dtm.nn.Linear(8, 8)

    def forward(self, x: dtm.Tensor) -> dtm.Tensor:
        h = fn.gelu(self.a(x))
        out: dtm.Tensor = self.c(fn.gelu(self.b(h))) + h  # h: made on stage 0, used on 1 and 2
        return out


def _cls_loss(m: dtm.nn.Module, x: dtm.Tensor, y: dtm.Tensor) -> dtm.Tensor:
    return fn.cross_entropy(m(x), y)


VECTORS = {"x": dtm.Input((4, 8), "f32", ("dp", None)), "y": dtm.Input((4,), "i32", ("dp",))}


def _split(model: dtm.nn.Module, splits: list[str]) -> object:
    return forward_stages(model, _cls_loss, mesh=dtm.Mesh(dp=1), inputs=VECTORS, splits=splits)


def test_a_skip_connection_over_a_stage_is_a_route_to_both_later_stages() -> None:
    part = _split(_Skip(), ["b", "c"])
    h = [r for r in part.routes if r.src == 0]  # type: ignore[attr-defined]
    assert len(h) == 1 and h[0].dst == (1, 2) and h[0].type.shape == (4, 8)
    assert [r.dst for r in part.routes if r.src == 1] == [(2,)]  # type: ignore[attr-defined]


class _Tied(dtm.nn.Module):
    def __init__(self) -> None:
        self.a = dtm.nn.Linear(8, 8)
        self.b = dtm.nn.Linear(8, 8)

    def forward(self, x: dtm.Tensor) -> dtm.Tensor:
        h = self.a(x)
        out: dtm.Tensor = self.a(self.b(h))  # a's weights again, after the split
        return out


def test_a_layer_used_on_two_stages_is_refused_at_the_users_line() -> None:
    with pytest.raises(TraceError) as info:
        _split(_Tied(), ["b"])
    err = info.value
    assert "parameter %a.weight is used on pipeline stage 0" in err.message
    assert "a parameter lives on one stage" in err.message
    assert err.span.file.endswith(HERE) and "self.a(self.b(h))" in str(err)


@pytest.mark.parametrize(
    ("splits", "message"),
    [
        (["d"], "pipeline split 'd': the model has no layer with this path (its layers: a, b, c)"),
        (["c", "b"], "pipeline splits follow the forward order: 'b' runs before 'c'"),
        (["b", "b"], "pipeline split 'b' is given twice"),
    ],
)
def test_bad_splits_are_one_error_naming_them(splits: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        _split(_Skip(), splits)


class _Unused(_Skip):
    def __init__(self) -> None:
        super().__init__()
        self.spare = dtm.nn.Linear(8, 8)


def test_a_split_at_a_layer_never_called_is_refused() -> None:
    with pytest.raises(UsageError, match="pipeline split 'spare': the traced function never calls"):
        _split(_Unused(), ["spare"])


def test_a_stage_without_ops_is_refused() -> None:
    from dtm_mpi.ir.types import DType, Layout, TensorType

    t = TensorType((2,), DType.F32, Layout(((),)))
    with pytest.raises(
        UsageError, match=r"pipeline stage 0 has no ops \(the cuts are at ops \[0, 0\] of 0\)"
    ):
        partition_stages([Param("%x", t)], [], [0, 0])
