"""Optimizers that emit their update into the traced training step.

Each optimizer's state (momentum, Adam's moments) is a ``state`` parameter of the step
(``init zeros``), carried between steps and saved in checkpoints with the weights, named
``opt.<kind>.<parameter path>``. Adam's bias correction reads the executor's step
(``step_index``), so a resumed run continues it. Updates are written with traced tensors; the
layouts are the parameters' own (the gradients arrive in them, completed over ``dp``).

**Sharded optimizer state** (ZeRO stages 1 and 2): with ``shard="dp"`` every parameter that
is not already split over ``dp`` has its gradient *reduce-scattered* over ``dp`` along its
first dim (instead of allreduced), each rank updates its block of the parameter with its block
of the optimizer state (stored split over ``dp``: 1/dp of the state per rank), and the new
parameter is *all-gathered*: the same bytes as the allreduce, 1/dp of the update work and of the
state. It is a layout choice only: a checkpoint holds the same global tensors either way, so a
run restores onto any mesh and either choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.lr_schedule import Schedule, schedule
from dtm_mpi.frontend.mesh import require_axis
from dtm_mpi.frontend.tensor import Tensor, Tracer
from dtm_mpi.frontend.traced_params import sharded_storage
from dtm_mpi.ir.nodes import Attr, Init, InitKind
from dtm_mpi.ir.ops.update import ADAMW_DTYPES
from dtm_mpi.ir.types import DType, Layout, TensorType

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "Schedule", "clip_by_global_norm", "schedule"]


class Optimizer:
    """Turns (parameter, gradient) pairs into the parameters' next values, followed by the
    next values of the state parameters it created (:meth:`state`), in creation order."""

    shard: str | None = None
    """The mesh axis the update and the optimizer state are split over (ZeRO-1/2; module
    doc), or None: every rank updates whole parameters."""
    lr: float | Schedule

    @property
    def peak_lr(self) -> float:
        """The learning rate, or a schedule's peak."""
        return self.lr.peak if isinstance(self.lr, Schedule) else float(self.lr)

    def lr_factor(self, tr: Tracer, dtype: DType) -> Tensor | None:
        """The schedule's factor of the step being run as a ``dtype`` scalar, or None for a
        constant learning rate."""
        return self.lr.traced_factor(tr, dtype) if isinstance(self.lr, Schedule) else None

    def scaled_lr(self, tr: Tracer, factor: Tensor | None) -> Tensor | float:
        """The step's learning rate from its :meth:`lr_factor`: ``peak * factor`` rounded to
        the factor's dtype (as the ``adamw`` op's ``scale`` computes it), or the float."""
        if factor is None:
            return self.peak_lr
        return tr.constant(self.peak_lr, factor.type) * factor

    def grad_layout(self, t: TensorType) -> Layout | None:
        """The layout a parameter of type ``t`` takes its gradient in (None: ``t``'s own,
        completed): with :attr:`shard`, the layout it would be stored in sharded over the axis
        (:func:`~dtm_mpi.frontend.traced_params.sharded_storage`), unless that is ``t``'s."""
        if self.shard is None:
            return None
        split = sharded_storage(t, self.shard)
        return None if split == t else split.layout.with_partial(None)

    def check_mesh(self, axes: tuple[str, ...]) -> None:
        """Raise :class:`UsageError` unless :attr:`shard` (if any) is one of ``axes``."""
        if self.shard is not None:
            require_axis(f"{type(self).__name__}(shard={self.shard!r})", self.shard, axes)

    def local(self, p: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """The parameter and its gradient in the layout the update runs in: the gradient's
        :meth:`grad_layout` (a gradient that arrives complete is sliced there, no traffic),
        the parameter taken to it (a local slice)."""
        want = self.grad_layout(p.type)
        if want is None:
            return p, g
        if g.layout != want:
            g = g.redistribute(want)
        return p.redistribute(want), g

    def update(
        self, tr: Tracer, params: Sequence[tuple[str, Tensor]], grads: Sequence[Tensor]
    ) -> list[Tensor]:
        raise NotImplementedError

    @staticmethod
    def state(tr: Tracer, kind: str, path: str, like: Tensor) -> Tensor:
        """A new zero-initialised state parameter shaped and laid out like ``like`` (its
        layout without a pending reduction)."""
        t = like.type.with_layout(like.layout.with_partial(None))
        v = tr.b.add_param(f"opt.{kind}.{path}", t, state=True, init=Init(InitKind.ZEROS))
        return Tensor(v, tr)

    @staticmethod
    def step(tr: Tracer, dtype: DType) -> Tensor:
        """The 1-based number of the step being run, as a ``dtype`` scalar."""
        i = tr.apply("step_index", [], {}, [TensorType(DType.I64, (), Layout(()))])
        return i.cast(dtype) + 1.0


def _check_lr(value: object) -> None:
    if isinstance(value, Schedule):
        return
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise UsageError(
            f"lr must be a number or a schedule (dtm.optim.schedule(...)); got {value!r}"
        )
    _check("lr", float(value), 0.0)


def _check(name: str, value: float, low: float, high: float | None = None) -> None:
    if not (value >= low and (high is None or value < high)):
        rng = f"[{low}, {high})" if high is not None else f">= {low}"
        raise UsageError(f"{name} must be {rng}; got {value}")


@dataclass(frozen=True)
class SGD(Optimizer):
    """``p -= lr * (g + wd p)``, with heavy-ball momentum ``b = mu b + g`` when ``momentum``."""

    lr: float | Schedule
    momentum: float = 0.0
    weight_decay: float = 0.0
    shard: str | None = None

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check("momentum", self.momentum, 0.0, 1.0)
        _check("weight_decay", self.weight_decay, 0.0)
        _check_shard(self.shard)

    def update(
        self, tr: Tracer, params: Sequence[tuple[str, Tensor]], grads: Sequence[Tensor]
    ) -> list[Tensor]:
        news, states = [], []
        lrs: dict[DType, Tensor | float] = {}
        for (path, whole), full in zip(params, grads, strict=True):
            p, grad = self.local(whole, full)
            g = grad + p * self.weight_decay if self.weight_decay else grad
            if self.momentum:
                g = self.state(tr, "momentum", path, g) * self.momentum + g
                states.append(g)
            if p.dtype not in lrs:
                lrs[p.dtype] = self.scaled_lr(tr, self.lr_factor(tr, p.dtype))
            news.append(p - g * lrs[p.dtype])
        return news + states


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``p -= lr (m^ / (sqrt(v^) +
    eps) + wd p)`` with bias-corrected moments ``m^``, ``v^``."""

    lr: float | Schedule = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    shard: str | None = None

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check("betas[0]", self.betas[0], 0.0, 1.0)
        _check("betas[1]", self.betas[1], 0.0, 1.0)
        _check("eps", self.eps, 0.0)
        _check("weight_decay", self.weight_decay, 0.0)
        _check_shard(self.shard)

    def update(
        self, tr: Tracer, params: Sequence[tuple[str, Tensor]], grads: Sequence[Tensor]
    ) -> list[Tensor]:
        if not params:
            return []
        b1, b2 = self.betas
        corrections: dict[DType, tuple[Tensor | None, Tensor | None]] = {}
        factors: dict[DType, Tensor | None] = {}
        news, states = [], []
        for (path, whole), full in zip(params, grads, strict=True):
            p, g = self.local(whole, full)
            if p.dtype not in corrections:  # 1 - beta^t, once a step and dtype
                t = self.step(tr, p.dtype)
                corrections[p.dtype] = (
                    1.0 - (t * math.log(b1)).exp() if b1 > 0 else None,
                    1.0 - (t * math.log(b2)).exp() if b2 > 0 else None,
                )
                factors[p.dtype] = self.lr_factor(tr, p.dtype)
            bc1, bc2 = corrections[p.dtype]
            factor = factors[p.dtype]
            m = self.state(tr, "m", path, g)
            v = self.state(tr, "v", path, g)
            if p.dtype in ADAMW_DTYPES:  # one op: the same bits as the ops below
                scalar = TensorType(p.dtype, (), Layout(()))
                c1 = bc1 if bc1 is not None else tr.constant(1.0, scalar)
                c2 = bc2 if bc2 is not None else tr.constant(1.0, scalar)
                attrs: dict[str, Attr] = {
                    "lr": self.peak_lr,
                    "beta1": float(b1),
                    "beta2": float(b2),
                    "eps": float(self.eps),
                    "decay": float(self.weight_decay),
                }
                ins = [p, g, m, v, c1, c2] + ([factor] if factor is not None else [])
                p2, m2, v2 = tr.apply_n("adamw", ins, attrs, [g.type] * 3)
                news.append(p2)
                states += [m2, v2]
                continue
            m2 = m * b1 + g * (1.0 - b1)
            v2 = v * b2 + g * g * (1.0 - b2)
            mh = m2 / bc1 if bc1 is not None else m2
            vh = v2 / bc2 if bc2 is not None else v2
            step = mh / (vh.sqrt() + self.eps)
            if self.weight_decay:
                step = step + p * self.weight_decay
            news.append(p - step * self.scaled_lr(tr, factor))
            states += [m2, v2]
        return news + states


@dataclass(frozen=True)
class Adam(AdamW):
    """Adam (no weight decay unless given; then L2-style decay added to the gradient)."""

    weight_decay: float = 0.0

    def update(
        self, tr: Tracer, params: Sequence[tuple[str, Tensor]], grads: Sequence[Tensor]
    ) -> list[Tensor]:
        if self.weight_decay:
            grads = [
                gl + pl * self.weight_decay
                for pl, gl in (self.local(p, g) for (_, p), g in zip(params, grads, strict=True))
            ]
        plain = AdamW(self.lr, self.betas, self.eps, 0.0, self.shard)
        return plain.update(tr, params, grads)


def _check_shard(axis: str | None) -> None:
    if axis is not None and not (isinstance(axis, str) and axis.isidentifier()):
        raise UsageError(f"shard must be a mesh axis name such as 'dp'; got {axis!r}")


def clip_by_global_norm(grads: Sequence[Tensor], max_norm: float) -> tuple[list[Tensor], Tensor]:
    """The gradients scaled by ``min(1, max_norm / (norm + 1e-6))``, where ``norm`` is the
    2-norm of all of them together (each square sum completed over its shards), and norm."""
    _check("max_norm", max_norm, 0.0)
    if not grads:
        raise UsageError("clip_by_global_norm needs at least one gradient")
    total = square_sum(grads)
    scale, norm = clip_scale(total, max_norm)
    return [g * scale for g in grads], norm


def square_sum(grads: Sequence[Tensor]) -> Tensor:
    """The sum of the squares of every element of ``grads`` (each completed over its shards)."""
    total = None
    for g in grads:
        sq = (g * g).sum().complete()
        total = sq if total is None else total + sq
    assert total is not None
    return total


def clip_scale(total: Tensor, max_norm: float) -> tuple[Tensor, Tensor]:
    """``min(1, max_norm / (norm + 1e-6))`` and ``norm = sqrt(total)``: the factor that clips
    gradients whose square sum is ``total`` to global norm ``max_norm`` (a pipeline's stages
    each sum their own gradients' squares, the totals added over the pipeline first)."""
    _check("max_norm", max_norm, 0.0)
    norm = total.sqrt()
    scale = (1.0 / (norm + 1e-6)) * max_norm
    one = scale.tracer.constant(1.0, scale.type)
    return scale.tracer.apply("minimum", [scale, one]), norm
