"""Mixed precision as a policy of the traced step (``train_step(precision=...)``).

:class:`MixedPrecision` ``(compute="bf16", reduce="f32", master="f32")``, as torchtitan's
FSDP mixed-precision policy runs a Llama: the parameters (the *master* weights) and the
optimizer's state are kept in ``master``; each use of a parameter in the model reads a copy
cast to ``compute`` (after a sharded parameter's gather), so the forward and backward run in
``compute`` as a model of that dtype does in Hugging Face (whose norms, attention softmax and
loss upcast to float32 themselves: :class:`~dtm_mpi.frontend.llm.RMSNorm`, the attention's
softmax, and under this policy :func:`~dtm_mpi.frontend.functional.cross_entropy`, which
upcasts ``bf16``/``f16`` logits); each gradient comes back through the cast's gradient as a
``master`` value, its data-parallel sum (pending through the cast) completed in ``reduce``
(= ``master``); the optimizer updates the masters in ``master``. The casts are IR like every
op (``step.text`` shows them). Checkpoints hold the masters with the names and types of the
step without the policy, and the policy changes no state: a checkpoint resumes with or without
it, and under another compute dtype.

bf16 values are held in binary32 (docs/spec/ir.md Q12): the policy gives bf16's numerics (each
op's result rounded to bf16), not its memory or speed. ``compute="f16"`` adds dynamic loss
scaling (:mod:`dtm_mpi.frontend.loss_scale`: ``init_scale``, ``growth_interval``; skipped
steps counted and reported), not yet in pipelined or accumulating steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtm_mpi.errors import UsageError
from dtm_mpi.ir.types import DType

__all__ = ["MixedPrecision", "parse_precision"]

_COMPUTE = (DType.BF16, DType.F16, DType.F32)
_MASTER = (DType.F32, DType.F64)


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """The dtypes of a training step's compute, gradient reductions and master weights."""

    compute: str = "bf16"
    reduce: str = "f32"
    master: str = "f32"
    init_scale: float = 65536.0
    """``compute="f16"``: the first loss scale (dynamic loss scaling,
    :mod:`dtm_mpi.frontend.loss_scale`); a power of two keeps unscaling exact."""
    growth_interval: int = 2000
    """``compute="f16"``: finite steps in a row before the scale doubles."""

    def __post_init__(self) -> None:
        parse_precision(self)

    @property
    def compute_dtype(self) -> DType:
        return DType(self.compute)

    @property
    def master_dtype(self) -> DType:
        return DType(self.master)


def _dtype(what: str, text: object, allowed: tuple[DType, ...]) -> DType:
    names = ", ".join(d.value for d in allowed)
    try:
        d = DType(text)
    except ValueError:
        raise UsageError(f"MixedPrecision {what}={text!r}: one of {names}") from None
    if d not in allowed:
        raise UsageError(f"MixedPrecision {what}={text!r}: one of {names}")
    return d


def parse_precision(p: MixedPrecision) -> tuple[DType, DType]:
    """``p``'s (compute, master) dtypes, checked: one error naming the field otherwise."""
    compute = _dtype("compute", p.compute, _COMPUTE)
    master = _dtype("master", p.master, _MASTER)
    reduce = _dtype("reduce", p.reduce, (DType.BF16, DType.F16, *_MASTER))
    if reduce is not master:
        raise UsageError(
            f"MixedPrecision reduce={p.reduce!r}: the gradients are reduced in the master "
            f"dtype ({p.master}); another reduce dtype is not supported yet"
        )
    scale = p.init_scale
    if not isinstance(scale, int | float) or not 1.0 <= scale <= 2.0**64:
        raise UsageError(f"MixedPrecision init_scale={scale!r}: a number in [1, 2**64]")
    interval = p.growth_interval
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise UsageError(f"MixedPrecision growth_interval={interval!r}: a whole number >= 1")
    return compute, master
