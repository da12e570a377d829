"""The outputs of an entry function: what ``dtm run -o`` writes and a task of a graph may
store, by key -- ``result0``, ``result1``, ... (the last step's results) and each entry
parameter's name (its final value). The one home of those keys."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from dtm_mpi.errors import UsageError
from dtm_mpi.ir.nodes import Function
from dtm_mpi.ir.types import TensorType

__all__ = ["check_output_keys", "output_types", "output_values"]

T = TypeVar("T")


def check_output_keys(entry: Function) -> None:
    """Refuse an entry function whose outputs would share a key in the ``-o`` file: a
    parameter named like a result key (``%result0`` beside result 0) would overwrite it."""
    results = {f"result{i}" for i in range(len(entry.results))}
    for p in entry.params:
        key = p.name.lstrip("%")
        if key in results:
            where = f"{p.span.file}:{p.span.line}:{p.span.col}: " if p.span.line > 0 else ""
            raise UsageError(
                f"{where}parameter {p.name} of @{entry.name} would be written as {key!r}, the key of "
                f"result {key.removeprefix('result')} of the output file: results and "
                "parameters never share a key; rename the parameter"
            )


def output_values(
    entry: Function, results: Sequence[T], params: Sequence[T]
) -> list[tuple[str, TensorType, T]]:
    """What ``dtm run -o`` writes, as (name, type, value): the last step's results as
    ``result0``, ``result1``, ... and the final value of every entry parameter by name
    (never the same key twice: :func:`check_output_keys`)."""
    check_output_keys(entry)
    named = [
        (f"result{i}", spec.type, v)
        for i, (spec, v) in enumerate(zip(entry.results, results, strict=True))
    ]
    named += [(p.name.lstrip("%"), p.type, v) for p, v in zip(entry.params, params, strict=True)]
    return named


def output_types(entry: Function) -> dict[str, TensorType]:
    """Every output key of ``entry`` and its type."""
    none = [None] * len(entry.params)
    return {name: t for name, t, _ in output_values(entry, [None] * len(entry.results), none)}
