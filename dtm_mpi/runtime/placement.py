"""``dtm explain --backend cuda|hip``: where each op of the plan runs on a GPU backend (pure:
no GPU, no CuPy needed) — RawKernels from ``kernels/*.cu``, generated kernels (one per fused
group of elementwise ops), cuBLAS, CuPy, or computed on the host and uploaded."""

from __future__ import annotations

from collections import Counter

from dtm_mpi.ir.dtypes import np_dtype
from dtm_mpi.kernels.cuda_backend import placement
from dtm_mpi.plan.fusion import fusion_groups
from dtm_mpi.plan.program import ExecPlan, OpKind

__all__ = ["placement_text"]


def placement_text(plan: ExecPlan, backend: str) -> str:
    """The placement section of ``dtm explain`` for a GPU ``backend``."""
    lines = [f"backend {backend}: where each op runs (per function)"]
    for name, fp in plan.functions:
        groups = fusion_groups(fp)
        fused = {m for g in groups for m in g.members}
        where: Counter[str] = Counter()
        ops_of: dict[str, Counter[str]] = {}
        for i, p in enumerate(fp.ops):
            if p.kind is not OpKind.LOCAL or i in fused:
                continue
            t = p.operand_types[0] if p.operand_types else p.op.result_types[0]
            dtypes = [np_dtype(o.dtype) for o in p.operand_types]
            attrs = dict(p.op.attrs)
            w = placement(p.op.name, dtypes, attrs, t.rank)
            where[w] += 1
            ops_of.setdefault(w, Counter())[p.op.name] += 1
        lines.append(f"  @{name}:")
        for g in groups:
            names = [fp.ops[m].op.name for m in g.members]
            lines.append(
                f"    generated kernel (fused {len(names)} ops -> {g.result}): {' '.join(names)}"
            )
        for w in sorted(where):
            detail = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(ops_of[w].items()))
            lines.append(f"    {w}: {detail}")
        if not groups and not where:
            lines.append("    (no computation: communication only)")
    return "\n".join(lines) + "\n"
