"""``module_hash``: a versioned hash of a module's meaning.

Definition (docs/spec/ir.md, "Module hash"): ``dtm-mh1:`` followed by the lowercase hex SHA-256
of the UTF-8 canonical text of the module in which (1) every function that names no mesh and
runs on the module's only mesh names it explicitly, and (2) every function's SSA values are
renamed ``%0, %1, ...`` in order of definition (parameters first). Whitespace, comments and
value names therefore do not change the hash; any change of meaning does.
"""

from __future__ import annotations

import dataclasses
import hashlib

from dtm_mpi.ir.nodes import Module
from dtm_mpi.ir.printer import print_module

__all__ = ["HASH_PREFIX", "module_hash"]

HASH_PREFIX = "dtm-mh1:"


def normalized(module: Module) -> Module:
    if len(module.meshes) != 1:
        return module
    only = module.meshes[0].name
    funcs = tuple(
        dataclasses.replace(f, mesh=only) if f.mesh is None else f for f in module.functions
    )
    return dataclasses.replace(module, functions=funcs)


def module_hash(module: Module) -> str:
    text = print_module(normalized(module), positional_names=True)
    return HASH_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()
