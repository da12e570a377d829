"""``dtm explain``: what each rank does, op by op, as a table.

For every op of the entry function (and of each function it calls): the result's local shape
on each rank, the communication steps the plan inserts, the bytes each rank sends/receives,
and the bytes alive on each rank while the op runs; then totals. A value that is the same on
every rank is printed once; otherwise one entry per rank (``r0:… r1:…``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dtm_mpi.errors import PlanError
from dtm_mpi.plan.cost import FunctionCost, function_cost, function_costs
from dtm_mpi.plan.program import ExecPlan

__all__ = ["check_memory", "explain_text", "human_bytes"]


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n_f = n / 1024
        if n_f < 1024 or unit == "TiB":
            return f"{n_f:.1f} {unit}" if n_f < 100 else f"{n_f:.0f} {unit}"
        n = int(n_f)
    return f"{n} B"  # pragma: no cover


def per_rank(values: Sequence[Any], fmt: Callable[[Any], str] = str) -> str:
    if values and values.count(values[0]) == len(values):  # one text, formatted once
        return fmt(values[0])
    texts = [fmt(v) for v in values]
    if len(set(texts)) == 1:
        return texts[0]
    return " ".join(f"r{r}:{t}" for r, t in enumerate(texts))


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, s)) + "]"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _function_lines(plan: ExecPlan, name: str, cost: FunctionCost) -> list[str]:
    rows = [["#", "line", "op", "result", "local shape", "communication", "sent/recv", "live"]]
    for i, c in enumerate(cost.ops, start=1):
        op = c.plan_op.op
        result = ", ".join(op.results) or "-"
        shapes = per_rank(c.local_shapes, lambda per: " ".join(map(_shape, per)) or "-")
        moved = per_rank(
            list(zip(c.sent, c.received, strict=True)),
            lambda sr: f"{human_bytes(sr[0])}/{human_bytes(sr[1])}",
        )
        rows.append(
            [
                str(i),
                str(op.span.line),
                op.name,
                result,
                shapes,
                "; ".join(c.comm) or "-",
                moved if any(c.sent) or any(c.received) else "-",
                per_rank(c.live, human_bytes),
            ]
        )
    return [f"function @{name}", *("  " + line for line in _table(rows))]


def _overlap_lines(plan: ExecPlan) -> list[str]:
    """The collectives that overlap computation, bucket by bucket (``DTM_OVERLAP``)."""
    out = []
    for name, fp in plan.functions:
        for i, b in enumerate(fp.buckets, 1):
            names = ", ".join(fp.ops[m].op.results[0] for m in b.members)
            after = fp.ops[b.start - 1].op.name if b.start > 0 else "the start"
            before = fp.ops[b.finish].op.name if b.finish < len(fp.ops) else "the return"
            busy = sum(1 for j in b.overlapped if j not in b.members)
            what = "allgather" if b.op is None else f"allreduce {b.op.value}"
            label = "prefetch" if b.op is None else "bucket"
            out.append(
                f"  @{name} {label} {i}: {what} on {','.join(b.axes)} of {names} ({human_bytes(b.nbytes)}): starts after op {b.start - 1} ({after}), completes before op {b.finish} ({before}); {busy} ops run meanwhile"
            )
    if not out:
        return []
    return [
        "overlapped collectives (DTM_OVERLAP=1: started when ready on a side thread, completed when needed; allreduces in buckets, gathers of parameters stored sharded one ahead):",
        *out,
        "",
    ]


def _repeated_lines(plan: ExecPlan) -> list[str]:
    """Values the plan moves to the same layout more than once with communication (a
    parameter's gathers aside: regathering one for the backward is deliberate, FSDP)."""
    out = []
    for name, fp in plan.functions:
        params = {q.name for q in fp.function.params}
        seen: dict[tuple[str, object], list[int]] = {}
        for i, p in enumerate(fp.ops, start=1):
            moved = p.redist is not None and any(s.kind.is_collective for s in p.redist.steps)
            if moved and p.op.operands[0] not in params:
                seen.setdefault((p.op.operands[0], p.op.result_types[0].layout), []).append(i)
        for (value, _), at in seen.items():
            if len(at) > 1:
                t = fp.ops[at[1] - 1].op.result_types[0]
                where = fp.ops[at[1] - 1].where
                out.append(
                    f"  @{name}: {value} moved to {t} {len(at)} times (ops {', '.join(map(str, at))}; the second at {where})"
                )
    if not out:
        return []
    return ["values moved to one layout more than once (each time with communication):", *out, ""]


def explain_text(plan: ExecPlan) -> str:
    """The whole explanation of ``plan``."""
    mesh = plan.mesh
    lines = [
        f"module {plan.module.name} on mesh {mesh} ({mesh.size} rank{'s' if mesh.size != 1 else ''})",
        "",
    ]
    entry_cost = None
    costs = function_costs(plan)
    for name, _ in plan.functions:
        cost = costs[name]
        if name == plan.entry:
            entry_cost = cost
        lines += [*_function_lines(plan, name, cost), ""]
    assert entry_cost is not None
    lines += _overlap_lines(plan)
    lines += _repeated_lines(plan)
    counts = ", ".join(f"{k} x{n}" for k, n in entry_cost.collectives) or "none"
    lines += [
        "totals per step (entry function, calls included):",
        f"  communication steps: {counts}",
        f"  bytes sent:     {per_rank(entry_cost.sent, human_bytes)}",
        f"  bytes received: {per_rank(entry_cost.received, human_bytes)}",
        f"  peak memory:    {per_rank(entry_cost.peak, human_bytes)}",
        f"  + kept outputs: {per_rank(entry_cost.retained, human_bytes)}"
        "  (MPI: collective outputs of 64 KiB or more kept for reuse, one per op, at most)",
    ]
    return "\n".join(lines) + "\n"


def check_memory(plan: ExecPlan, limit: int) -> None:
    """Raise :class:`PlanError` if any rank's peak (values alive at once, plus the collective
    outputs kept for reuse) exceeds ``limit`` bytes, naming the rank, the op where the peak is
    reached and both figures."""
    cost = function_cost(plan, plan.entry_plan)
    for rank, (values, kept) in enumerate(zip(cost.peak, cost.retained, strict=True)):
        peak = values + kept
        if peak > limit:
            at = max(cost.ops, key=lambda c: c.live[rank]) if cost.ops else None
            where = f" at {at.plan_op.op.name} ({at.plan_op.where})" if at is not None else ""
            raise PlanError(
                f"the plan needs {human_bytes(peak)} ({peak} bytes) on rank {rank}{where}, over "
                f"--max-bytes-per-rank {human_bytes(limit)} ({limit} bytes)"
            )
