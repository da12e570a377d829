"""``module_hash``: a versioned hash of a module's meaning.

Definition (docs/spec/ir.md, "Module hash"): ``dtm-mh1:`` followed by the lowercase hex SHA-256
of the UTF-8 canonical text of the module in which (1) every function that names no mesh and
runs on the module's only mesh names it explicitly, and (2) every function's SSA values are
renamed ``%0, %1, ...`` in order of definition (parameters first). Whitespace, comments and
value names therefore do not change the hash; any change of meaning does.

``program_hash`` (docs/spec/ir.md §11.3): the same hash, prefix ``dtm-ph1:``, of the module
with its layouts erased: every identity op (a layout change: ``allreduce``, ``reduce_scatter``,
``allgather``, ``redistribute``, ...) removed, its result read as its operand, every type
replicated, every mesh axis of size 1 and the version 1.0. Two modules with one program hash
compute the same global values from the same global state, on any mesh and under any sharding
choice: what a checkpoint needs of the program that resumes it.
"""

from __future__ import annotations

import dataclasses
import hashlib

from dtm_mpi.ir.nodes import Function, Module
from dtm_mpi.ir.printer import print_module
from dtm_mpi.ir.registry import OPS, all_ops
from dtm_mpi.ir.types import Layout, TensorType

__all__ = ["HASH_PREFIX", "PROGRAM_HASH_PREFIX", "module_hash", "program_hash"]

HASH_PREFIX = "dtm-mh1:"
PROGRAM_HASH_PREFIX = "dtm-ph1:"


def normalized(module: Module) -> Module:
    if len(module.meshes) != 1:
        return module
    only = module.meshes[0].name
    funcs = tuple(
        dataclasses.replace(f, mesh=only) if f.mesh is None else f for f in module.functions
    )
    return dataclasses.replace(module, functions=funcs)


def _digest(prefix: str, module: Module) -> str:
    text = print_module(module, positional_names=True)
    return prefix + hashlib.sha256(text.encode("utf-8")).hexdigest()


def module_hash(module: Module) -> str:
    return _digest(HASH_PREFIX, normalized(module))


def _replicated(t: TensorType) -> TensorType:
    return t.with_layout(Layout.replicated(t.rank))


def _erase(f: Function) -> Function:
    alias: dict[str, str] = {}

    def name(v: str) -> str:
        return alias.get(v, v)

    body = []
    for op in f.body:
        if OPS[op.name].kind.is_identity:  # the same global value: read its operand instead
            for r in op.results:
                alias[r] = name(op.operands[0])
            continue
        body.append(
            dataclasses.replace(
                op,
                operands=tuple(name(v) for v in op.operands),
                result_types=tuple(_replicated(t) for t in op.result_types),
            )
        )
    return dataclasses.replace(
        f,
        params=tuple(dataclasses.replace(p, type=_replicated(p.type)) for p in f.params),
        results=tuple(dataclasses.replace(r, type=_replicated(r.type)) for r in f.results),
        body=tuple(body),
        returns=tuple(name(v) for v in f.returns),
    )


def program_hash(module: Module) -> str:
    """The hash of ``module``'s program with its layouts erased (module doc)."""
    all_ops()
    erased = dataclasses.replace(
        normalized(module),
        version=(1, 0),
        meshes=tuple(
            dataclasses.replace(m, axes=tuple((a, 1) for a, _ in m.axes)) for m in module.meshes
        ),
    )
    erased = dataclasses.replace(erased, functions=tuple(_erase(f) for f in erased.functions))
    return _digest(PROGRAM_HASH_PREFIX, erased)
