"""Dynamic loss scaling for float16 compute (``MixedPrecision(compute="f16")``), traced into
the step as torch's ``GradScaler`` runs it.

float16's range ends at 65,504 and its normal numbers at 6.1e-5, so small gradients flush to
zero unless the loss is scaled up before the reverse pass. The step keeps three float32 state
scalars (``amp.scale``: the scale over ``init_scale``, ``amp.good``: the finite steps since
it last changed, ``amp.skipped``: the steps skipped so far): the reverse pass starts from
``loss x scale``; the gradients are divided by the scale; where their square sum is not
finite (an overflow somewhere: one scalar reduction, not a check per tensor) the step keeps
every parameter and optimizer state as it was (``where``: a skipped step), halves the scale
and counts the skip; after ``growth_interval`` finite steps in a row it doubles the scale.
The scale is a power of two times ``init_scale``, so scaling and unscaling are exact. The
step reports ``loss_scale`` and ``skipped`` (the running count) as metrics. The learning-rate
schedule and Adam's bias correction follow the step index, skipped steps included (torch's
AdamW does not count a skipped step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtm_mpi.frontend.functional import where
from dtm_mpi.frontend.optim import square_sum
from dtm_mpi.frontend.tensor import Tensor, Tracer
from dtm_mpi.ir.nodes import Init, InitKind
from dtm_mpi.ir.types import DType, Layout, TensorType

if TYPE_CHECKING:
    from dtm_mpi.ir.build import Value

__all__ = ["METRICS", "STATE", "LossScaler"]

METRICS = ("loss_scale", "skipped")
"""The metrics a loss-scaled step reports after its loss."""
STATE = ("amp.scale", "amp.good", "amp.skipped")
"""The scaler's state parameters: where a resumed checkpoint lacks them (one of a step
without the scaler), they start from their init."""
_FLT_MAX = 3.4028234663852886e38


@dataclass
class LossScaler:
    """The traced scaler of one step (module doc)."""

    tr: Tracer
    init_scale: float
    growth_interval: int
    scale: Tensor
    good: Tensor
    skipped: Tensor
    finite: Tensor | None = None

    @classmethod
    def traced(cls, tr: Tracer, init_scale: float, growth_interval: int) -> LossScaler:
        scalar = TensorType(DType.F32, (), Layout(()))

        def state(name: str, init: InitKind) -> Tensor:
            return Tensor(tr.b.add_param(name, scalar, state=True, init=Init(init)), tr)

        return cls(
            tr,
            init_scale,
            growth_interval,
            state(STATE[0], InitKind.ONES),
            state(STATE[1], InitKind.ZEROS),
            state(STATE[2], InitKind.ZEROS),
        )

    @property
    def factor(self) -> Tensor:
        """The loss scale of this step."""
        return self.scale * self.init_scale

    def seed(self, loss: Tensor) -> Tensor:
        """What the reverse pass differentiates: the scaled loss."""
        return loss * self.factor.cast(loss.dtype)

    def unscale(self, grads: list[Tensor]) -> list[Tensor]:
        """The gradients divided by the scale; records whether all of them are finite."""
        inv = 1.0 / self.factor
        out = [g * inv.cast(g.dtype) for g in grads]
        total = square_sum(out).cast(DType.F32)
        self.finite = total <= _FLT_MAX  # false for inf and NaN
        return out

    def guard(self, news: list[Tensor], olds: list[Tensor]) -> list[Tensor]:
        """Each new value where the step's gradients were finite, else the old one."""
        assert self.finite is not None
        return [where(self.finite, n, o) for n, o in zip(news, olds, strict=True)]

    def updates(self) -> tuple[list[tuple[Value, str]], list[Value]]:
        """The scaler's state updates (value, state name) and its metrics' values."""
        assert self.finite is not None
        ok = self.finite
        grown = (self.good + 1.0) >= float(self.growth_interval)
        scale = where(ok, where(grown, self.scale * 2.0, self.scale), self.scale * 0.5)
        good = where(ok, where(grown, self.good * 0.0, self.good + 1.0), self.good * 0.0)
        skipped = self.skipped + where(ok, self.skipped * 0.0, self.skipped * 0.0 + 1.0)
        ups = [
            (scale.value, self.scale.value.name),
            (good.value, self.good.value.name),
            (skipped.value, self.skipped.value.name),
        ]
        return ups, [self.factor.value, skipped.value]
