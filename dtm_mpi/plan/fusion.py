"""Elementwise fusion: chains of float elementwise ops that a GPU backend runs as one kernel.

Pure: a function of a :class:`~dtm_mpi.plan.program.FunctionPlan`, the same on every rank.
A group is a tree of elementwise ops (those with the registry's ``FUSIBLE`` trait, on
f16/bf16/f32/f64) whose intermediate values are each used exactly once,
by the next op of the group, and are not returned: the group's last op (its root) computes the
whole tree, reading each outside input once and writing one output, instead of one kernel and
one full-size temporary per op. A ``broadcast_to`` of a replicated vector along the last dim
whose only use is inside a group becomes a broadcast input (``bias[i % cols]``) and is not run
at all: ``gelu(x + broadcast_to(b))`` is the fused bias+gelu of an MLP.

Elementwise ops see aligned local blocks under any layout (the verifier requires equal dims),
so grouping never depends on the mesh. The numpy backend runs op by op (it is the reference).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dtm_mpi.ir.nodes import Op
from dtm_mpi.ir.registry import OPS, Trait
from dtm_mpi.ir.types import DType
from dtm_mpi.plan.program import FunctionPlan, OpKind

__all__ = ["FusedGroup", "FusionNode", "fusion_groups"]

_FLOATS = frozenset({DType.F16, DType.BF16, DType.F32, DType.F64})
MAX_DEPTH = 48
"""The deepest chain one group absorbs (a longer chain is cut into groups): bounds the
generated kernel's expression and the planner's recursion."""


@dataclass(frozen=True, slots=True)
class FusionNode:
    """An op of a group applied to sub-nodes or inputs (``int``: index into the group's
    inputs)."""

    op: str
    args: tuple[FusionNode | int, ...]
    attrs: tuple[tuple[str, str], ...] = ()  # the op's form (``OpDef.form``), e.g. gelu's


@dataclass(frozen=True, slots=True)
class FusedGroup:
    root: int  # index in the function plan's ops: where the group runs
    members: tuple[int, ...]  # every op index the group replaces (root included), in order
    inputs: tuple[str, ...]  # SSA names read (a broadcast input: the vector's name)
    lastdim: tuple[bool, ...]  # per input: a vector along the last dim, broadcast over rows
    tree: FusionNode
    result: str

    @property
    def size(self) -> int:
        return len(self.members)


def _fusible(op: Op) -> bool:
    return (
        Trait.FUSIBLE in OPS[op.name].traits
        and len(op.results) == 1
        and all(t.dtype in _FLOATS for t in op.result_types)
    )


def _bias_vector(op: Op, operand_type: object) -> bool:
    """``broadcast_to`` of a replicated 1-D vector to the rows of a matrix-like result (the
    vector is the result's last dim, which is unsharded)."""
    from dtm_mpi.ir.types import TensorType

    if not OPS[op.name].has(Trait.BROADCASTS) or not isinstance(operand_type, TensorType):
        return False
    out = op.result_types[0]
    return (
        operand_type.rank == 1
        and out.rank >= 1
        and operand_type.shape[0] == out.shape[-1]
        and operand_type.layout.is_replicated
        and not out.layout.dims[-1]
        and operand_type.dtype in _FLOATS
    )


class _Tree:
    """One group being built from its root down: the inputs met and the ops absorbed."""

    def __init__(
        self, fp: FunctionPlan, uses: Counter[str], taken: set[int], producer: dict[str, int]
    ) -> None:
        self.ops = fp.ops
        self.uses, self.taken = uses, taken
        self.producer = producer
        self.inputs: list[str] = []
        self.lastdim: list[bool] = []
        self.members: list[int] = []

    def leaf(self, name: str, bias: bool) -> int:
        for k, key in enumerate(zip(self.inputs, self.lastdim, strict=True)):
            if key == (name, bias):
                return k
        self.inputs.append(name)
        self.lastdim.append(bias)
        return len(self.inputs) - 1

    def _inner(self, name: str) -> int | None:
        """The op producing ``name`` when the group may absorb it (a kernel op whose result
        is used once, here), else None."""
        k = self.producer.get(name)
        ok = k is not None and k not in self.taken and self.uses[name] == 1
        return k if ok and k is not None and self.ops[k].kind is OpKind.LOCAL else None

    def build(self, j: int, depth: int = 0) -> FusionNode:
        self.members.append(j)
        op = self.ops[j].op
        args: list[FusionNode | int] = []
        for name in op.operands:
            k = self._inner(name)
            if k is not None and _fusible(self.ops[k].op) and depth < MAX_DEPTH:
                args.append(self.build(k, depth + 1))
                continue
            if k is not None:
                inner = self.ops[k]
                vector = inner.operand_types[0] if inner.operand_types else None
                if _bias_vector(inner.op, vector):
                    self.members.append(k)
                    args.append(self.leaf(inner.op.operands[0], True))
                    continue
            args.append(self.leaf(name, False))
        return FusionNode(op.name, tuple(args), tuple(OPS[op.name].form(op).items()))


def fusion_groups(fp: FunctionPlan, min_size: int = 2) -> tuple[FusedGroup, ...]:
    """The groups of ``fp`` with at least ``min_size`` ops (absorbed broadcasts count too).
    Roots are found from the end, so each op joins the group of its (only) consumer."""
    uses: Counter[str] = Counter()
    for p in fp.ops:
        uses.update(p.op.operands)
    uses.update(fp.function.returns)
    taken: set[int] = set()
    groups: list[FusedGroup] = []
    producer = {r: i for i, p in enumerate(fp.ops) for r in p.op.results}
    for i in range(len(fp.ops) - 1, -1, -1):
        p = fp.ops[i]
        if i in taken or p.kind is not OpKind.LOCAL or not _fusible(p.op):
            continue
        tree = _Tree(fp, uses, taken, producer)
        root = tree.build(i)
        if len(tree.members) < min_size:
            continue
        taken.update(tree.members)
        groups.append(
            FusedGroup(
                i,
                tuple(sorted(tree.members)),
                tuple(tree.inputs),
                tuple(tree.lastdim),
                root,
                p.op.results[0],
            )
        )
    return tuple(sorted(groups, key=lambda g: g.root))
