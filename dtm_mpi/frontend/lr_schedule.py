"""Learning-rate schedules computed inside the traced step from the executor's step index.

A :class:`Schedule` is a pure description (kind, peak, warmup, total, floor, decay): the step
computes its factor for step ``s`` (``step_index``, 0-based; saved in every checkpoint, so a
resumed run continues the curve on any mesh) with IR ops, and the optimizer multiplies its
peak learning rate by it. :meth:`Schedule.factor` is the same formula on Python floats, for
plots and checks; the tests hold the two equal.

The factor ``f(s)``, with ``W`` warmup steps, ``T`` total steps and ``floor`` the fraction of
the peak it decays to:

* warmup (``s < W``): ``(s + 1) / W``, reaching the peak at the last warmup step;
* ``constant``: 1 after warmup;
* ``cosine``: ``floor + (1 - floor) * (1 + cos(pi * p)) / 2``, ``p = (s - W) / (T - W)``
  clipped to [0, 1] (so ``floor`` from step ``T`` on);
* ``linear``: ``floor + (1 - floor) * (1 - p)``;
* ``wsd`` (warmup-stable-decay): 1 until step ``T - D`` (``D``: ``decay`` steps), then linear
  to ``floor`` over the last ``D`` steps.

The factor is computed in float32 (float64 for float64 parameters) and cast to the
parameters' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.tensor import Tensor, Tracer
from dtm_mpi.ir.types import DType, Layout, TensorType

__all__ = ["KINDS", "Schedule", "schedule"]

KINDS = ("constant", "cosine", "linear", "wsd")


@dataclass(frozen=True, slots=True)
class Schedule:
    """A learning-rate schedule (module doc); make one with :func:`schedule`."""

    kind: str
    peak: float
    warmup: int
    total: int
    floor: float
    decay: int

    def factor(self, step: int) -> float:
        """The factor of step ``step`` (0-based) as Python floats (the traced step computes
        the same in its dtype)."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "wsd":
            start = self.total - self.decay
            p = min(max((step - start) / self.decay, 0.0), 1.0)
            return self.floor + (1.0 - self.floor) * (1.0 - p)
        p = min(max((step - self.warmup) / max(self.total - self.warmup, 1), 0.0), 1.0)
        if self.kind == "cosine":
            return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * p))
        return self.floor + (1.0 - self.floor) * (1.0 - p)

    def lr(self, step: int) -> float:
        """The learning rate of step ``step``: ``peak * factor(step)``."""
        return self.peak * self.factor(step)

    def traced_factor(self, tr: Tracer, dtype: DType) -> Tensor:
        """The factor of the step being run, traced from ``step_index``, as a ``dtype``
        scalar (computed in float32, float64 for float64)."""
        work = DType.F64 if dtype is DType.F64 else DType.F32
        s = tr.apply("step_index", [], {}, [TensorType(DType.I64, (), Layout(()))]).cast(work)
        one = tr.constant(1.0, TensorType(work, (), Layout(())))

        def clip01(x: Tensor) -> Tensor:
            zero = tr.constant(0.0, x.type)
            return tr.apply("minimum", [tr.apply("maximum", [x, zero]), one])

        if self.kind == "constant":
            after = one
        elif self.kind == "wsd":
            p = clip01((s - float(self.total - self.decay)) * (1.0 / self.decay))
            after = (one - p) * (1.0 - self.floor) + self.floor
        else:
            span = float(max(self.total - self.warmup, 1))
            p = clip01((s - float(self.warmup)) * (1.0 / span))
            cosine = self.kind == "cosine"
            wave = ((p * math.pi).cos() + 1.0) * 0.5 if cosine else one - p
            after = wave * (1.0 - self.floor) + self.floor
        if self.warmup:
            ramp = (s + 1.0) * (1.0 / self.warmup)
            after = tr.apply("where", [s < float(self.warmup), ramp, after])
        return after if work is dtype else after.cast(dtype)


def schedule(
    kind: str,
    *,
    peak: float,
    total: int,
    warmup: int = 0,
    floor: float = 0.0,
    decay: int | None = None,
) -> Schedule:
    """A learning-rate schedule (module doc): ``kind`` one of ``constant``, ``cosine``,
    ``linear``, ``wsd``; ``peak`` the learning rate after warmup; ``total`` the steps of the
    run; ``warmup`` the linear warmup steps; ``floor`` the fraction of ``peak`` it decays to
    (in [0, 1]); ``decay`` (``wsd`` only) the steps of the final decay (default a tenth of
    ``total``). Passed as an optimizer's ``lr``."""
    if kind not in KINDS:
        raise UsageError(f"schedule kind {kind!r} is not one of {', '.join(KINDS)}")
    if not (isinstance(peak, int | float) and peak >= 0 and math.isfinite(peak)):
        raise UsageError(f"schedule peak must be a finite learning rate >= 0; got {peak!r}")
    for name, value in (("total", total), ("warmup", warmup)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UsageError(f"schedule {name} must be a whole number of steps >= 0; got {value!r}")
    if total < 1:
        raise UsageError(f"schedule total must be at least 1 step; got {total}")
    if warmup > total:
        raise UsageError(f"schedule warmup ({warmup} steps) is longer than total ({total})")
    if not (isinstance(floor, int | float) and 0.0 <= floor <= 1.0):
        raise UsageError(f"schedule floor is a fraction of the peak in [0, 1]; got {floor!r}")
    if decay is not None and kind != "wsd":
        raise UsageError(f"decay is the final decay of a 'wsd' schedule, not of {kind!r}")
    d = max(1, total // 10) if decay is None else decay
    if kind == "wsd" and (
        not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= total - warmup
    ):
        raise UsageError(
            f"wsd decay must be 1 to {total - warmup} steps (total less warmup); got {d!r}"
        )
    return Schedule(kind, float(peak), warmup, total, float(floor), d)
