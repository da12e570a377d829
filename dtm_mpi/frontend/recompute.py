"""Activation recomputation (``train_step(recompute=...)``), as a rewrite of the traced step.

A training step is its forward ops, then its reverse ops (:func:`~dtm_mpi.ir.autodiff.
backward`; each reverse op's *origin* is the forward op whose gradient rule emitted it). The
forward values the reverse ops read are what a step holds between its forward and its
backward: the activations. Recomputation cuts the forward pass into *blocks* (the model's
longest list of layers: ``model.layers.0`` .. ``model.layers.L-1``, as pipeline stages are
cut), and for each block, just before the first reverse op of that block, emits again the
block's forward ops that make the values its reverse ops read -- from the values it keeps --
and has those reverse ops read the new copies. The forward's own copies are then freed after
their last forward use (the planner frees every value at its last use), and the copies live
only through that block's backward. Which values a block keeps:

* ``"none"``: no rewrite (every activation held);
* ``"full"``: none of the block's own: everything is recomputed from the block's inputs (and
  the parameters), as torchtitan's full activation checkpointing per block;
* ``"selective"``: the outputs of the contractions (``matmul``) and of communication
  (collectives are not run twice), as torchtitan's per-op selective AC keeps them; the
  elementwise ops, norms, softmax and the like are recomputed;
* a callable ``keep(op_name) -> bool``: the outputs of the ops it keeps.

The recomputed ops are the same ops on the same values, so a step gives the same bits with
any choice (tested in deterministic mode and out of it). Random ops are pure functions of
their seed and offset, so they recompute the same numbers. The rewrite changes the program,
not the state: checkpoints move between the choices (the state is identified by the step
without it, :attr:`~dtm_mpi.frontend.trace.TracedStep.identity`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from dtm_mpi.errors import UsageError

if TYPE_CHECKING:
    from dtm_mpi.frontend.layers import Module as Layer
    from dtm_mpi.frontend.tensor import Tracer
    from dtm_mpi.ir.nodes import Op

__all__ = [
    "CHOICES",
    "Recompute",
    "block_ranges",
    "check_recompute",
    "recompute_ops",
    "rewrite_recompute",
]

Recompute = str | Callable[[str], bool]
"""``"none"``, ``"full"``, ``"selective"``, or ``keep(op_name) -> bool``."""
CHOICES = ("none", "selective", "full")


def check_recompute(choice: Recompute) -> Recompute:
    """``choice``, checked (one error naming the choices otherwise)."""
    if callable(choice) or choice in CHOICES:
        return choice
    raise UsageError(
        f"recompute={choice!r}: one of {', '.join(map(repr, CHOICES))}, or a function of an "
        "op's name saying whether its output is kept"
    )


def _keeps(choice: Recompute) -> Callable[[Op], bool]:
    from dtm_mpi.ir.registry import OPS, OpKind

    if callable(choice):
        fn = choice
        return lambda op: bool(fn(op.name))
    if choice == "full":
        return lambda op: False
    return lambda op: op.name == "matmul" or OPS[op.name].kind is not OpKind.LOCAL


def block_ranges(
    model: Layer, entered: Sequence[tuple[int, str]], forward: int
) -> list[tuple[int, int]]:
    """The forward op ranges ``[start, end)`` of the model's longest list of layers (its
    blocks), from the tracer's (op position, layer path) of every layer call: a block ends
    where the next layer call outside it starts (or the forward pass ends)."""
    lists: dict[str, list[str]] = {}
    for path, _ in model.named_layers():
        head, _, tail = path.rpartition(".")
        if tail.isdigit():
            lists.setdefault(head, []).append(path)
    if not lists:
        raise UsageError(
            "recompute: the model has no list of layers (blocks) to recompute; its layers: "
            + ", ".join(p for p, _ in model.named_layers() if p.count(".") <= 1)
        )
    longest: list[str] = []
    for paths in lists.values():
        if len(paths) > len(longest):
            longest = paths
    blocks = set(longest)
    out: list[tuple[int, int]] = []
    for i, (at, path) in enumerate(entered):
        if path not in blocks:
            continue
        end = forward
        for later, other in entered[i + 1 :]:
            if not other.startswith(path + "."):
                end = later
                break
        out.append((at, end))
    return out


def recompute_ops(
    ops: Sequence[Op],
    forward: int,
    origins: Sequence[int],
    blocks: Sequence[tuple[int, int]],
    choice: Recompute,
    fresh: Callable[[str], str],
) -> tuple[list[Op], list[int]]:
    """The step ``ops`` (``forward`` forward ops, then reverse ops with ``origins``) with each
    block's activations recomputed before its backward (module doc; ``fresh(hint)``: a new
    value name); returns the ops and the reverse ops' origins (a recomputed op's origin is the
    forward op it repeats)."""
    if choice == "none":
        return list(ops), list(origins)
    keep = _keeps(choice)
    fwd, rev = list(ops[:forward]), list(ops[forward:])
    made_at = {n: i for i, op in enumerate(fwd) for n in op.results}
    inserts: dict[int, list[tuple[Op, int]]] = {}  # reverse position -> ops to emit before it
    renames: dict[int, dict[str, str]] = {}  # reverse position -> operand renames
    for start, end in blocks:
        mine = [j for j, o in enumerate(origins) if start <= o < end]
        if not mine:
            continue
        used = {n for j in mine for n in rev[j].operands if start <= made_at.get(n, -1) < end}
        # the block's ops that remake them, from what it keeps and what it did not make
        need: set[int] = set()
        todo = [made_at[n] for n in used if not keep(fwd[made_at[n]])]
        while todo:
            i = todo.pop()
            if i in need:
                continue
            need.add(i)
            for n in fwd[i].operands:
                k = made_at.get(n, -1)
                if start <= k < end and not keep(fwd[k]) and k not in need:
                    todo.append(k)
        if not need:
            continue
        new: dict[str, str] = {}
        emitted: list[tuple[Op, int]] = []
        for i in sorted(need):
            op = fwd[i]
            results = tuple(fresh(n.lstrip("%") + ".re") for n in op.results)
            new.update(zip(op.results, results, strict=True))
            operands = tuple(new.get(n, n) for n in op.operands)
            emitted.append((replace(op, results=results, operands=operands), i))
        inserts.setdefault(mine[0], []).extend(emitted)
        for j in mine:
            renames.setdefault(j, {}).update(new)
    out, out_origins = fwd, []
    for j, op in enumerate(rev):
        for clone, origin in inserts.get(j, ()):
            out.append(clone)
            out_origins.append(origin)
        names = renames.get(j)
        out.append(
            op if not names else replace(op, operands=tuple(names.get(n, n) for n in op.operands))
        )
        out_origins.append(origins[j])
    return out, out_origins


def rewrite_recompute(
    tr: Tracer, model: Layer, forward: int, origins: list[int], choice: Recompute
) -> list[int]:
    """Recompute ``model``'s blocks' activations in the reverse pass of ``tr`` (its ops from
    ``forward`` on, their ``origins``): :func:`recompute_ops`, in place; returns the reverse
    ops' new origins."""
    b = tr.b
    blocks = block_ranges(model, tr.entered, forward)
    body, new_origins = recompute_ops(b.ops, forward, origins, blocks, choice, b.fresh)
    for op in body[forward:]:
        for n, t in zip(op.results, op.result_types, strict=True):
            b.types.setdefault(n, t)
    b.ops[:] = body
    return new_origins
