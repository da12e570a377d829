"""Every IR op, registered in :data:`dtm_mpi.ir.registry.OPS` on import (one module a family)."""

from dtm_mpi.ir.ops import (  # noqa: F401
    collective,
    create,
    elementwise,
    index,
    linalg,
    quant,
    reduce,
    shape,
    update,
)
