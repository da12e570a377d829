"""The single-process reference: a module evaluated on global numpy arrays (spec §7).

Every op is its registry reference function on global values; collectives, ``redistribute``
and ``send``/``recv`` are the identity on global values (a ``recv`` yields the value of its
paired ``send``); ``call`` evaluates the callee. This is what the distributed executor must
reproduce, block by block, at every rank count.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from dtm_mpi.errors import UsageError
from dtm_mpi.ir.nodes import Function, Module
from dtm_mpi.ir.registry import OPS, OpKind, Trait, lookup_op
from dtm_mpi.runtime.policies import check_run_size
from dtm_mpi.runtime.values import check_inputs, init_global

__all__ = ["StepResult", "evaluate_function", "run_reference"]

StepResult = tuple[np.ndarray, ...]


def evaluate_function(
    module: Module, f: Function, args: tuple[np.ndarray, ...], step: int
) -> tuple[np.ndarray, ...]:
    """The results of ``f`` on global argument values."""
    lookup_op("add")
    env: dict[str, np.ndarray] = {p.name: a for p, a in zip(f.params, args, strict=True)}
    sent: dict[tuple[object, ...], np.ndarray] = {}
    for op in f.body:
        xs = [env[n] for n in op.operands]
        opdef = OPS[op.name]
        kind = opdef.kind
        if kind.is_identity:  # collectives, redistribute: only the layout changes
            outs: tuple[np.ndarray, ...] = (xs[0],)
        elif kind is OpKind.SEND:
            sent[(op.attr("axis"), op.attr("src"), op.attr("dst"), op.attr("tag"))] = xs[0]
            outs = ()
        elif kind is OpKind.RECV:
            outs = (sent.pop((op.attr("axis"), op.attr("src"), op.attr("dst"), op.attr("tag"))),)
        elif kind is OpKind.CALL:
            callee = module.function(str(op.attr("callee")))
            assert callee is not None
            outs = evaluate_function(module, callee, tuple(xs), step)
        elif opdef.has(Trait.NEEDS_STEP):
            outs = (np.array(step, dtype=np.int64),)
        else:
            outs = tuple(opdef.reference(op, xs, op.result_types))
        for r, v in zip(op.results, outs, strict=True):
            env[r] = v
    return tuple(env[r] for r in f.returns)


def run_reference(
    module: Module, inputs: Mapping[str, np.ndarray] | None = None, *, steps: int = 1
) -> tuple[dict[str, np.ndarray], list[StepResult]]:
    """Run the entry function ``steps`` times from ``inputs`` (else each parameter's init),
    carrying state. Returns the final parameter values (state included) and each step's
    results."""
    entry = module.entry
    if entry is None:
        raise UsageError(f"module {module.name} has no entry function")
    check_run_size(steps)
    given = check_inputs(module, inputs or {})
    values = {
        p.name: given[p.name.lstrip("%")] if p.name.lstrip("%") in given else init_global(p)
        for p in entry.params
    }
    history: list[StepResult] = []
    for step in range(steps):
        args = tuple(values[p.name] for p in entry.params)
        results = evaluate_function(module, entry, args, step)
        history.append(results)
        for spec, value in zip(entry.results, results, strict=True):
            if spec.updates is not None:
                values[spec.updates] = value
    return values, history
