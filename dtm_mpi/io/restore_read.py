"""Restore's read and exchange: every stored chunk read once, verified, sent where needed.

Pure plan in (:class:`~dtm_mpi.io.ckpt_plan.RestorePlan`, the same on every rank), thin execution
here: per round, each rank reads the chunks the plan gives it from their data files
(a :class:`~dtm_mpi.io.backend.ShardReader`, serial independent reads; straight into the output
when it is the chunk's only consumer), checks each against its content hash, and one
Alltoallv moves every piece to the ranks whose target block needs it. Damage is returned,
not raised: the caller agrees on it and applies the recovery rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtm_mpi.comm.objects import alltoallv_bytes
from dtm_mpi.config import get_config, spare_cpu
from dtm_mpi.errors import IntegrityError
from dtm_mpi.io.backend import ShardReader
from dtm_mpi.io.ckpt_plan import RestorePlan
from dtm_mpi.io.manifest import ShardRecord
from dtm_mpi.io.verification import chunk_mismatch
from dtm_mpi.ir.dtypes import np_dtype

__all__ = ["Reader", "hash_thread_wanted", "read_plan"]


Damage = tuple[str, str, str, str]
"""(tensor, shard id, message, file): one damaged chunk, as the caller gathers it."""


@dataclass(frozen=True, slots=True)
class Reader:
    """Who reads: the communicator, this rank, and the deadline each read runs under."""

    comm: Any
    rank: int
    size: int
    timeout_s: float
    deadline: Callable[[str], AbstractContextManager[Any]]


def read_plan(
    ctx: Reader, files: ShardReader, plan: RestorePlan, into: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], list[Damage]]:
    """Read, verify and distribute every round of ``plan`` (collective: the exchanges),
    into the arrays of ``into`` where given (checked by the caller), else new ones.
    Reads are independent and serial (each chunk is whole rows of one shard dataset,
    contiguous in its data file, read by exactly one rank); a chunk that cannot be read
    or does not match its hash is reported as (tensor, shard, message, file)."""
    me = ctx.rank
    outs = {}
    offsets = []
    for ti, (name, t) in enumerate(plan.targets):
        block = plan.block(ti, me)
        outs[name] = (
            into[name]
            if name in into
            else np.empty(tuple(s.stop - s.start for s in block), dtype=np_dtype(t.dtype))
        )
        offsets.append(block)
    damaged: list[Damage] = []
    by_item: dict[int, list[int]] = {}
    for k, p in enumerate(plan.pieces):
        by_item.setdefault(p.item, []).append(k)
    rounds: dict[int, list[int]] = {}
    for k, it in enumerate(plan.items):
        rounds.setdefault(it.round, []).append(k)
    # Chunks only this rank consumes go straight into its output and take no part in an
    # exchange: read them first, each run of consecutive chunks of a shard in one call.
    direct = {
        k: d
        for k, it in enumerate(plan.items)
        if it.reader == me and (d := _direct(ctx, plan, k, by_item, offsets[it.tensor])) is not None
    }
    threaded = hash_thread_wanted()
    runs = _direct_runs(plan, direct, outs, PIPELINED_RUN_BYTES if threaded else RUN_BYTES)
    damaged.extend(
        _read_runs(ctx, files, plan, runs, direct, outs, threaded=threaded and len(runs) > 1)
    )
    for rnd in sorted(rounds):  # the same rounds on every rank: the plan is shared
        round_items = rounds[rnd]
        data: dict[int, np.ndarray] = {}
        mine = [k for k in round_items if plan.items[k].reader == me and k not in direct]
        if mine:
            # one deadline for the round's reads (arming one per chunk cost 5% of a restore)
            with ctx.deadline(f"restore: reading round {rnd}"):
                for k in mine:
                    bad = _read_item(ctx, files, plan, k, by_item, offsets, outs, data)
                    if bad is not None:
                        damaged.append(bad)
        _exchange(ctx, plan, round_items, by_item, data, outs, offsets)
    return outs, damaged


RUN_BYTES = 256 << 20
"""Most bytes one read of a run of direct chunks takes (each read runs under one deadline)."""

PIPELINED_RUN_BYTES = 16 << 20
"""The same when a second thread verifies one run while the next is read (smaller runs: the
first read and the last hash are the parts that do not overlap)."""


def hash_thread_wanted() -> bool:
    """Whether restores verify on a second thread: ``DTM_CKPT_HASH_THREAD``, or where it is
    ``auto``, whether this rank may run on at least twice as many CPUs as its share of the
    node (its affinity, and the CPUs divided among the ranks its launcher put on the node).
    Hashing (XXH3, GIL released) then overlaps the next read instead of following it."""
    chosen = get_config().ckpt_hash_thread
    return spare_cpu() if chosen is None else chosen


def _direct_runs(
    plan: RestorePlan, direct: dict[int, tuple[slice, ...]], outs: dict[str, np.ndarray], limit: int
) -> list[list[int]]:
    """The direct items as runs: consecutive chunks of one shard whose places in the output
    follow each other as whole rows (one contiguous view), at most ``limit`` bytes each."""
    runs: list[list[int]] = []
    size = 0
    for k in sorted(
        direct, key=lambda k: (plan.items[k].tensor, plan.items[k].shard, plan.items[k].chunk)
    ):
        it, where = plan.items[k], direct[k]
        out = outs[plan.targets[it.tensor][0]]
        nbytes = out[where].nbytes if where else out.nbytes
        if runs and where and out[where].flags.c_contiguous:
            prev = plan.items[runs[-1][-1]]
            last = direct[runs[-1][-1]]
            if (
                (prev.tensor, prev.shard, prev.chunk + 1) == (it.tensor, it.shard, it.chunk)
                and last
                and last[0].stop == where[0].start
                and last[1:] == where[1:]
                and size + nbytes <= limit
            ):
                runs[-1].append(k)
                size += nbytes
                continue
        runs.append([k])
        size = nbytes
    return runs


def _read_run(
    ctx: Reader,
    files: ShardReader,
    plan: RestorePlan,
    run: list[int],
    direct: dict[int, tuple[slice, ...]],
    outs: dict[str, np.ndarray],
    *,
    checked: bool,
) -> list[Damage] | None:
    """Read a run of direct chunks with one call: its damage if the read fails, else [].
    ``checked``: also verify each piece while it is cached (one pass); None then where the
    shard's storage does not allow it (the caller reads, then verifies)."""
    first, last = plan.items[run[0]], plan.items[run[-1]]
    name = plan.targets[first.tensor][0]
    art = plan.artifacts[first.tensor]
    shard = art.shards[first.shard]
    where = direct[run[0]]
    if where:
        where = (slice(where[0].start, direct[run[-1]][0].stop), *where[1:])
    try:
        if not checked:
            files.read_rows(art, shard, first.chunk, last.chunk, outs[name], where or None)
            return []
        problems = files.read_rows_checked(
            art, shard, first.chunk, last.chunk, outs[name], where or None
        )
    except Exception as exc:  # local: reported with the damage, agreed by the caller
        return [_unreadable(files, name, shard, f"chunks {first.chunk}..{last.chunk}", exc)]
    if problems is None:
        return None
    file = str(files.ckpt / shard.file)
    return [
        (name, shard.id, f"{p} (read by rank {ctx.rank})", file) for p in problems if p is not None
    ]


def _verify_run(
    ctx: Reader,
    files: ShardReader,
    plan: RestorePlan,
    run: list[int],
    direct: dict[int, tuple[slice, ...]],
    outs: dict[str, np.ndarray],
) -> list[Damage]:
    """The damage of the chunks of a run that was read (their content hashes checked)."""
    first = plan.items[run[0]]
    name = plan.targets[first.tensor][0]
    shard = plan.artifacts[first.tensor].shards[first.shard]
    checked = (
        _verify(
            ctx,
            files,
            name,
            shard,
            plan.items[k].chunk,
            outs[name][direct[k]] if direct[k] else outs[name],
        )
        for k in run
    )
    return [d for d in checked if d is not None]


def _read_runs(
    ctx: Reader,
    files: ShardReader,
    plan: RestorePlan,
    runs: list[list[int]],
    direct: dict[int, tuple[slice, ...]],
    outs: dict[str, np.ndarray],
    *,
    threaded: bool,
) -> list[Damage]:
    """Read the runs in order and verify each: right after its read, or (``threaded``) on one
    worker thread while the next run is read. Every wait (a read, a run's hashes) runs under
    the restore's deadline."""
    damaged: list[Damage] = []
    with ExitStack() as stack:
        pool = (
            stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="dtm-restore-hash"))
            if threaded
            else None
        )
        pending: Future[list[Damage]] | None = None
        for run in runs:
            with ctx.deadline(
                f"restore: reading {len(run)} chunk(s) of tensor {plan.targets[plan.items[run[0]].tensor][0]!r}"
            ):
                # no spare core: hash each piece right after reading it, while it is cached;
                # with one, hashing a run on the worker while the next is read is faster
                checked = (
                    None
                    if pool is not None
                    else _read_run(ctx, files, plan, run, direct, outs, checked=True)
                )
                if checked is not None:  # read and verified in one pass
                    damaged.extend(checked)
                    continue
                failed = _read_run(ctx, files, plan, run, direct, outs, checked=False) or []
                if pending is not None:
                    damaged.extend(pending.result())
                    pending = None
                if failed:
                    damaged.extend(failed)
                elif pool is None:
                    damaged.extend(_verify_run(ctx, files, plan, run, direct, outs))
                else:
                    pending = pool.submit(_verify_run, ctx, files, plan, run, direct, outs)
        if pending is not None:
            with ctx.deadline("restore: verifying the last chunks read"):
                damaged.extend(pending.result())
    return damaged


def _read_item(
    ctx: Reader,
    files: ShardReader,
    plan: RestorePlan,
    k: int,
    by_item: dict[int, list[int]],
    offsets: list[tuple[slice, ...]],
    outs: dict[str, np.ndarray],
    data: dict[int, np.ndarray],
) -> Damage | None:
    """Read and verify item ``k`` (straight into the output when this rank is its only
    consumer, else into ``data[k]``); returns its damage, or None."""
    item = plan.items[k]
    name = plan.targets[item.tensor][0]
    art = plan.artifacts[item.tensor]
    shard = art.shards[item.shard]
    direct = _direct(ctx, plan, k, by_item, offsets[item.tensor])
    if direct is None:  # sent on: it must exist even if the read fails (the plan fixes the
        data[k] = np.empty(item.shape, dtype=outs[name].dtype)  # bytes every rank expects)
    try:
        if direct is not None:
            buf = files.read_chunk(art, shard, item.chunk, outs[name], direct or None)
        else:
            buf = files.read_chunk(art, shard, item.chunk, data[k])
    except Exception as exc:  # local: reported with the damage, agreed by the caller
        if direct is None:
            data[k][...] = 0
        return _unreadable(files, name, shard, f"chunk {item.chunk}", exc)
    return _verify(ctx, files, name, shard, item.chunk, buf)


def _unreadable(
    files: ShardReader, name: str, shard: ShardRecord, what: str, exc: Exception
) -> Damage:
    """The damage of ``what`` (a chunk or a run of them) that could not be read."""
    if isinstance(exc, IntegrityError):  # ShardFiles names the file and the problem
        return (name, shard.id, str(exc).split(f"{shard.id!r}: ", 1)[-1], exc.file)
    return (
        name,
        shard.id,
        f"{what} cannot be read: {type(exc).__name__}: {exc}",
        str(files.ckpt / shard.file),
    )


def _verify(
    ctx: Reader, files: ShardReader, name: str, shard: ShardRecord, chunk: int, data: np.ndarray
) -> Damage | None:
    """The damage of chunk ``chunk`` read as ``data`` if its content hash differs, else None."""
    problem = chunk_mismatch(shard, chunk, data)
    if problem is None:
        return None
    return (name, shard.id, f"{problem} (read by rank {ctx.rank})", str(files.ckpt / shard.file))


def _direct(
    ctx: Reader, plan: RestorePlan, k: int, by_item: dict[int, list[int]], block: tuple[slice, ...]
) -> tuple[slice, ...] | None:
    """Where item ``k`` lands in this rank's output when this rank is its only consumer
    (read straight into the output, no copy), else None."""
    pieces = by_item.get(k, [])
    if len(pieces) != 1 or plan.pieces[pieces[0]].dest != ctx.rank:
        return None
    region = plan.items[k].region
    if plan.pieces[pieces[0]].region != region:
        return None
    return _relative(region, block)


def _exchange(
    ctx: Reader,
    plan: RestorePlan,
    round_items: list[int],
    by_item: dict[int, list[int]],
    data: dict[int, np.ndarray],
    outs: dict[str, np.ndarray],
    offsets: list[tuple[slice, ...]],
) -> None:
    """Send every piece of this round's items to its rank (collective, one Alltoallv)."""
    me, n = ctx.rank, ctx.size
    sends: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(n)]  # (view, nbytes)
    recv_plan: list[list[int]] = [[] for _ in range(n)]
    itemsizes = [np_dtype(t.dtype).itemsize for _, t in plan.targets]
    for k in round_items:
        item = plan.items[k]
        name = plan.targets[item.tensor][0]
        for pk in by_item.get(k, []):
            p = plan.pieces[pk]
            if item.reader == me and k in data:
                local = _relative(p.region, item.region)
                part = data[k][local]
                if p.dest == me:
                    out = _relative(p.region, offsets[item.tensor])
                    outs[name][out] = part
                else:
                    sends[p.dest].append((part, part.size * itemsizes[item.tensor]))
            elif p.dest == me and item.reader != me:
                recv_plan[item.reader].append(pk)
    if _nothing_moves(plan, round_items, by_item):
        return
    send_counts = [sum(nb for _, nb in parts) for parts in sends]
    recv_counts = [
        sum(
            math.prod(plan.pieces[pk].shape) * itemsizes[plan.items[plan.pieces[pk].item].tensor]
            for pk in pks
        )
        for pks in recv_plan
    ]
    send = np.empty(sum(send_counts), dtype=np.uint8)  # packed in place: no extra copies
    pos = 0
    for parts in sends:
        for part, nb in parts:
            send[pos : pos + nb].view(part.dtype).reshape(part.shape)[...] = part
            pos += nb
    got = alltoallv_bytes(
        ctx.comm,
        send,
        send_counts,
        recv_counts,
        timeout_s=ctx.timeout_s,
        what="restore: exchange",
        phase="checkpoint",
    )
    del send
    pos = 0
    for src in range(n):
        for pk in recv_plan[src]:
            p = plan.pieces[pk]
            item = plan.items[p.item]
            name = plan.targets[item.tensor][0]
            nbytes = math.prod(p.shape) * itemsizes[item.tensor]
            out = _relative(p.region, offsets[item.tensor])
            outs[name][out] = got[pos : pos + nbytes].view(outs[name].dtype).reshape(p.shape)
            pos += nbytes


def _nothing_moves(
    plan: RestorePlan, round_items: list[int], by_item: dict[int, list[int]]
) -> bool:
    """True when no piece of the round crosses ranks (decided from the plan: the same
    answer on every rank, so all skip the exchange together)."""
    return all(
        plan.pieces[pk].dest == plan.items[k].reader
        for k in round_items
        for pk in by_item.get(k, [])
    )


def _relative(region: tuple[slice, ...], origin: tuple[slice, ...]) -> tuple[slice, ...]:
    """``region`` (global) relative to the block that starts at ``origin``."""
    return tuple(
        slice(r.start - o.start, r.stop - o.start) for r, o in zip(region, origin, strict=True)
    )
