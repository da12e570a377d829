"""Pipeline stages of a forward pass: a function body cut into consecutive stages, and the
boundary routes between them (pure: IR in, a partition out).

A forward body (the ops of a model and its loss, before the reverse pass) is cut before given
op positions (:func:`partition_stages`); stage ``s`` runs the ops from its cut to the next.
Every value an op of one stage produces and an op of a later stage uses crosses on a
:class:`Route` from the producer's stage to each consumer's stage -- the next stage's input,
or a skip connection to a stage further on, planned alike. A parameter lives on the one stage
whose ops use it; the fed inputs go straight to every stage that uses them (each stage's
loader gives its blocks), so neither travels.

Refused with the user's line: a parameter used by two stages (tied weights across stages), a
stage without ops.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from dtm_mpi.errors import SourceSpan, UsageError, VerifyError
from dtm_mpi.ir.nodes import NO_SPAN, Op, Param
from dtm_mpi.ir.types import TensorType

__all__ = ["Route", "Stage", "StagePartition", "partition_stages"]


@dataclass(frozen=True, slots=True)
class Route:
    """``value`` (of ``type``) made on stage ``src``, used on stages ``dst`` (each later)."""

    value: str
    type: TensorType
    src: int
    dst: tuple[int, ...]
    span: SourceSpan = NO_SPAN

    def __str__(self) -> str:
        to = ", ".join(map(str, self.dst))
        return f"{self.value}: {self.type} from stage {self.src} to stage {to}"


@dataclass(frozen=True, slots=True)
class Stage:
    """Stage ``index``: its ``ops`` (in order), the ``params`` and fed ``inputs`` they use,
    the routed values it ``receives`` and ``sends`` (names, in route order)."""

    index: int
    ops: tuple[Op, ...]
    params: tuple[str, ...]
    inputs: tuple[str, ...]
    receives: tuple[str, ...]
    sends: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StagePartition:
    stages: tuple[Stage, ...]
    routes: tuple[Route, ...]

    def stage_of(self, param: str) -> int:
        """The stage holding parameter ``param``."""
        for s in self.stages:
            if param in s.params:
                return s.index
        raise KeyError(param)

    def text(self) -> str:
        """One line per stage (its ops and parameters) and per route."""
        lines = []
        for s in self.stages:
            lines.append(
                f"stage {s.index}: {len(s.ops)} ops; parameters {', '.join(s.params) or 'none'}"
                + (f"; inputs {', '.join(s.inputs)}" if s.inputs else "")
            )
        lines += [f"route {r}" for r in self.routes]
        return "\n".join(lines) + "\n"


def partition_stages(
    params: Sequence[Param], body: Sequence[Op], cuts: Sequence[int], fed: Sequence[str] = ()
) -> StagePartition:
    """Cut ``body`` before the op positions ``cuts`` (increasing, inside the body): stage 0
    is ``body[:cuts[0]]``, the last ``body[cuts[-1]:]``. ``params``: the function's
    parameters; those named in ``fed`` (with or without ``%``) are the step's fed inputs."""
    bounds = [0, *cuts, len(body)]
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        if b <= a:
            raise UsageError(
                f"pipeline stage {s} has no ops (the cuts are at ops {list(cuts)} of {len(body)})"
            )
    fed_names = {"%" + n.lstrip("%") for n in fed}
    param_names = {p.name for p in params}
    made: dict[str, tuple[int, TensorType, SourceSpan]] = {}  # value -> (stage, type, span)
    used_by: dict[str, list[int]] = {}
    param_stage: dict[str, tuple[int, SourceSpan]] = {}
    stage_inputs: list[list[str]] = [[] for _ in range(len(bounds) - 1)]
    stage_params: list[list[str]] = [[] for _ in range(len(bounds) - 1)]
    for s in range(len(bounds) - 1):
        for op in body[bounds[s] : bounds[s + 1]]:
            for name in op.operands:
                if name in param_names:
                    _place_param(
                        name, s, op.span, fed_names, param_stage, stage_inputs, stage_params
                    )
                elif name not in made:
                    raise VerifyError(f"{name} is used before it is defined", op.span)
                elif made[name][0] != s and s not in used_by.setdefault(name, []):
                    used_by[name].append(s)
            for name, t in zip(op.results, op.result_types, strict=True):
                made[name] = (s, t, op.span)
    routes = tuple(
        Route(name, made[name][1], made[name][0], tuple(sorted(dst)), made[name][2])
        for name, dst in used_by.items()
        if dst
    )
    stages = tuple(
        Stage(
            s,
            tuple(body[bounds[s] : bounds[s + 1]]),
            tuple(stage_params[s]),
            tuple(stage_inputs[s]),
            tuple(r.value for r in routes if s in r.dst),
            tuple(r.value for r in routes if r.src == s),
        )
        for s in range(len(bounds) - 1)
    )
    return StagePartition(stages, routes)


def _place_param(
    name: str,
    stage: int,
    span: SourceSpan,
    fed: set[str],
    param_stage: dict[str, tuple[int, SourceSpan]],
    stage_inputs: list[list[str]],
    stage_params: list[list[str]],
) -> None:
    if name in fed:  # each stage's loader gives its blocks of a fed input
        if name not in stage_inputs[stage]:
            stage_inputs[stage].append(name)
        return
    first = param_stage.get(name)
    if first is None:
        param_stage[name] = (stage, span)
        stage_params[stage].append(name)
    elif first[0] != stage:
        raise VerifyError(
            f"parameter {name} is used on pipeline stage {first[0]} (line {first[1].line}) and on stage {stage} here: "
            "a parameter lives on one stage (weights tied across stages are not supported)",
            span,
        )
