"""Optimizers that emit their update into the traced training step.

Each optimizer's state (momentum, Adam's moments) is a ``state`` parameter of the step
(``init zeros``), carried between steps and saved in checkpoints with the weights, named
``opt.<kind>.<parameter path>``. Adam's bias correction reads the executor's step
(``step_index``), so a resumed run continues it. Updates are written with traced tensors; the
layouts are the parameters' own (the gradients arrive in them, completed over ``dp``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dtm_mpi.errors import UsageError
from dtm_mpi.frontend.tensor import Tensor, Tracer
from dtm_mpi.ir.nodes import Init, InitKind
from dtm_mpi.ir.types import DType, Layout, TensorType

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_by_global_norm"]


class Optimizer:
    """Turns (parameter, gradient) pairs into the parameters' next values, followed by the
    next values of the state parameters it created (:meth:`state`), in creation order."""

    def update(
        self, tr: Tracer, params: Sequence[tuple[str, Tensor]], grads: Sequence[Tensor]
    ) -> list[Tensor]:
        raise NotImplementedError

    @staticmethod
    def state(tr: Tracer, kind: str, path: str, like: Tensor) -> Tensor:
        """A new zero-initialised state parameter shaped and laid out like ``like``."""
        v = tr.b.add_param(f"opt.{kind}.{path}", like.type, state=True, init=Init(InitKind.ZEROS))
        return Tensor(v, tr)

    @staticmethod
    def step(tr: Tracer, dtype: DType) -> Tensor:
        """The 1-based number of the step being run, as a ``dtype`` scalar."""
        i = tr.apply("step_index", [], {}, [TensorType(DType.I64, (), Layout(()))])
        return i.cast(dtype) + 1.0


def _check(name: str, value: float, low: float, high: float | None = None) -> None:
    if not (value >= low and (high is None or value < high)):
        rng = f"[{low}, {high})" if high is not None else f">= {low}"
        raise UsageError(f"{name} must be {rng}; got {value}")


@dataclass(frozen=True)
class SGD(Optimizer):
    """``p -= lr * (g + wd p)``, with heavy-ball momentum ``b = mu b + g`` when ``momentum``."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0)
        _check("momentum", self.momentum, 0.0, 1.0)
        _check("weight_decay", self.weight_decay, 0.0)

    def update(
        self, tr: Tracer, params: Sequence[tuple[str, Tensor]], grads: Sequence[Tensor]
    ) -> list[Tensor]:
        news, states = [], []
        for (path, p), grad in zip(params, grads, strict=True):
            g = grad + p * self.weight_decay if self.weight_decay else grad
            if self.momentum:
                g = self.state(tr, "momentum", path, p) * self.momentum + g
                states.append(g)
            news.append(p - g * self.lr)
        return news + states


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``p -= lr (m^ / (sqrt(v^) +
    eps) + wd p)`` with bias-corrected moments ``m^``, ``v^``."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        _check("lr", self.lr, 0.0)
        _check("betas[0]", self.betas[0], 0.0, 1.0)
        _check("betas[1]", self.betas[1], 0.0, 1.0)
        _check("eps", self.eps, 0.0)
        _check("weight_decay", self.weight_decay, 0.0)

    def update(
        self, tr: Tracer, params: Sequence[tuple[str, Tensor]], grads: Sequence[Tensor]
    ) -> list[Tensor]:
        if not params:
            return []
        b1, b2 = self.betas
        t = self.step(tr, params[0][1].dtype)
        bc1 = 1.0 - (t * math.log(b1)).exp() if b1 > 0 else None
        bc2 = 1.0 - (t * math.log(b2)).exp() if b2 > 0 else None
        news, states = [], []
        for (path, p), g in zip(params, grads, strict=True):
            m = self.state(tr, "m", path, p)
            v = self.state(tr, "v", path, p)
            m2 = m * b1 + g * (1.0 - b1)
            v2 = v * b2 + g * g * (1.0 - b2)
            mh = m2 / bc1 if bc1 is not None else m2
            vh = v2 / bc2 if bc2 is not None else v2
            step = mh / (vh.sqrt() + self.eps)
            if self.weight_decay:
                step = step + p * self.weight_decay
            news.append(p - step * self.lr)
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
            grads = [g + p * self.weight_decay for (_, p), g in zip(params, grads, strict=True)]
        plain = AdamW(self.lr, self.betas, self.eps, 0.0)
        return plain.update(tr, params, grads)


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
