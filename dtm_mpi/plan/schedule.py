"""Pipeline schedules: per rank of a pipeline, the order of its forward and backward work per
microbatch and stage, with every boundary send and receive and its tag -- pure planning, the
same on every rank, checked before any data moves.

A pipeline of ``ranks`` ranks runs ``ranks * chunks`` *stages* (consecutive parts of the
model); stage ``s`` runs on rank ``s % ranks`` (with ``chunks`` > 1 each rank holds ``chunks``
non-adjacent stages: the interleaved layout of Megatron-LM). A step feeds ``microbatches``
microbatches through every stage. Per microbatch and stage the work is:

* ``F`` -- the forward pass (needs the previous stage's activations);
* ``B`` -- the whole backward pass (needs the next stage's input gradient);
* ``I`` and ``W`` -- the backward pass split into its input-gradient part (what the previous
  stage waits for) and its weight-gradient part (which nothing downstream waits for), as in
  Zero Bubble pipeline parallelism (Qi et al., ICLR 2024): ``zb-h1`` runs ``W`` in what would
  otherwise be idle time.

Schedules (:class:`ScheduleKind`): ``gpipe`` (every forward, then every backward), ``1f1b``
(PipeDream-flush / Megatron: a warm-up of forwards, then one forward and one backward in
turn), ``interleaved`` (1F1B over ``chunks`` stages per rank, Megatron-LM's interleaved
schedule; ``microbatches`` a multiple of ``ranks``) and ``zb-h1``. :func:`plan_schedule`
builds the per-rank orders with their transfers; :func:`check_schedule` proves the sends and
receives pair up (peer, tag) and that the orders complete without a deadlock, with blocking
receives and sends that do not wait for their receiver; :func:`time_schedule` gives the
predicted time-line, bubble fraction and peak activations per rank under a cost model
(:class:`StageCosts`); :func:`schedule_text` shows it.

Memory model: the activations of one (microbatch, stage) are held from its forward until its
weight gradient is computed (``B``, or ``W`` under ``zb-h1``): :attr:`ScheduleTiming.peak_held`
counts them per rank (1F1B's is at most ``ranks`` where GPipe's is ``microbatches``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from dtm_mpi.errors import PlanError, UsageError

__all__ = [
    "Compute",
    "PipelineShape",
    "Recv",
    "Schedule",
    "ScheduleKind",
    "ScheduleTiming",
    "Send",
    "Span",
    "StageCosts",
    "Transfer",
    "Work",
    "check_schedule",
    "parse_optional_schedule",
    "parse_schedule",
    "plan_schedule",
    "schedule_text",
    "time_schedule",
]


class ScheduleKind(Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"


def parse_schedule(text: str) -> ScheduleKind:
    """The schedule named ``text`` (a :class:`UsageError` naming the choices otherwise)."""
    found = parse_optional_schedule(text)
    if found is None:
        names = ", ".join(k.value for k in ScheduleKind)
        raise UsageError(f"unknown pipeline schedule {text!r}; choose one of {names}")
    return found


def parse_optional_schedule(text: str) -> ScheduleKind | None:
    for kind in ScheduleKind:
        if kind.value == text.strip().lower():
            return kind
    return None


class Work(Enum):
    """One stage's work for one microbatch."""

    F = "F"  # forward
    B = "B"  # the whole backward
    I = "I"  # noqa: E741  (the backward's input-gradient part)
    W = "W"  # the backward's weight-gradient part


class Transfer(Enum):
    """What crosses a stage boundary: activations forward, input gradients backward."""

    ACT = "act"
    GRAD = "grad"


@dataclass(frozen=True, slots=True)
class Compute:
    work: Work
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.work.value}(mb {self.microbatch}, stage {self.stage})"


@dataclass(frozen=True, slots=True)
class _Message:
    """``what`` of (``microbatch``, ``stage``: the producing stage), to or from rank
    ``peer``, with ``tag``."""

    what: Transfer
    microbatch: int
    stage: int
    peer: int
    tag: int

    def _text(self, verb: str, way: str) -> str:
        return f"{verb} {self.what.value}(mb {self.microbatch}, stage {self.stage}) {way} rank {self.peer} tag {self.tag}"


@dataclass(frozen=True, slots=True)
class Send(_Message):
    """Send to ``peer`` (returns without waiting for the receiver)."""

    def __str__(self) -> str:
        return self._text("send", "to")


@dataclass(frozen=True, slots=True)
class Recv(_Message):
    """Receive from ``peer`` (waits for the message)."""

    def __str__(self) -> str:
        return self._text("recv", "from")


Action = Compute | Send | Recv


@dataclass(frozen=True, slots=True)
class PipelineShape:
    """``ranks`` pipeline ranks (the ``pp`` axis), ``microbatches`` per step, ``chunks``
    stages per rank."""

    ranks: int
    microbatches: int
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise UsageError(f"a pipeline needs at least 1 rank; got {self.ranks}")
        if self.microbatches < 1:
            raise UsageError(f"--microbatches must be >= 1; got {self.microbatches}")
        if self.chunks < 1:
            raise UsageError(f"chunks per rank must be >= 1; got {self.chunks}")

    @property
    def stages(self) -> int:
        return self.ranks * self.chunks

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def tag(self, what: Transfer, microbatch: int, stage: int) -> int:
        """The message tag of ``what`` produced by (``microbatch``, ``stage``): unique in a
        step, so a receiver may take its messages in another order than they were sent."""
        return (microbatch * self.stages + stage) * 2 + (what is Transfer.GRAD)

    @property
    def max_tag(self) -> int:
        return self.tag(Transfer.GRAD, self.microbatches - 1, self.stages - 1)


@dataclass(frozen=True, slots=True)
class StageCosts:
    """The cost model of one stage's work for one microbatch (any unit: the ratios matter):
    ``forward``, the backward's ``input_grad`` and ``weight_grad`` parts (``B`` takes their
    sum), ``transfer``, the time a boundary message of the stage takes to arrive, and
    ``receive``, the time its receiving rank takes to take such a message once it has
    arrived (copying it in: idle time for the pipeline, not a pass)."""

    forward: float = 1.0
    input_grad: float = 1.0
    weight_grad: float = 1.0
    transfer: float = 0.0
    receive: float = 0.0

    def of(self, work: Work) -> float:
        if work is Work.F:
            return self.forward
        if work is Work.B:
            return self.input_grad + self.weight_grad
        return self.input_grad if work is Work.I else self.weight_grad


@dataclass(frozen=True, slots=True)
class Schedule:
    """Each pipeline rank's actions in order (:func:`plan_schedule`)."""

    kind: ScheduleKind
    shape: PipelineShape
    actions: tuple[tuple[Action, ...], ...]

    def computes(self, rank: int) -> tuple[Compute, ...]:
        return tuple(a for a in self.actions[rank] if isinstance(a, Compute))


@dataclass(frozen=True, slots=True)
class Span:
    start: float
    end: float
    compute: Compute


@dataclass(frozen=True, slots=True)
class ScheduleTiming:
    """A schedule's predicted time-line (:func:`time_schedule`)."""

    spans: tuple[tuple[Span, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    peak_held: tuple[int, ...]
    """Per rank: the most (microbatch, stage) activations held at once."""

    @property
    def bubble(self) -> float:
        """The idle share of the ranks' time: ``1 - busy / (ranks * makespan)``."""
        total = self.makespan * len(self.busy)
        return 1.0 - sum(self.busy) / total if total > 0 else 0.0


# --- the orders ---------------------------------------------------------------------------


def plan_schedule(
    kind: ScheduleKind,
    shape: PipelineShape,
    costs: Sequence[StageCosts] | None = None,
) -> Schedule:
    """The actions of every rank of ``shape`` under ``kind``: its computes in order, each
    receive just before the compute that needs it and each send just after the compute that
    produced it. ``costs`` (per stage; default: F = I = W) orders ``zb-h1``'s ``W`` passes;
    the other schedules do not depend on it. Checked (:func:`check_schedule`)."""
    _check_kind(kind, shape)
    stage_costs = _costs(shape, costs)
    if kind is ScheduleKind.GPIPE:
        orders = [_gpipe(shape, r) for r in range(shape.ranks)]
    elif kind is ScheduleKind.ZB_H1:
        orders = _zero_bubble(shape, stage_costs)
    else:  # 1f1b, and interleaved (its chunks > 1)
        orders = [_one_f_one_b(shape, r) for r in range(shape.ranks)]
    schedule = Schedule(kind, shape, tuple(_with_transfers(shape, order) for order in orders))
    check_schedule(schedule)
    return schedule


def _check_kind(kind: ScheduleKind, shape: PipelineShape) -> None:
    if kind is ScheduleKind.INTERLEAVED:
        if shape.chunks < 2:
            raise UsageError("the interleaved schedule needs at least 2 chunks (stages) per rank")
        if shape.microbatches % shape.ranks:
            raise UsageError(
                f"the interleaved schedule needs microbatches in multiples of the pipeline ranks ({shape.ranks}); got {shape.microbatches}"
            )
    elif shape.chunks != 1:
        raise UsageError(
            f"the {kind.value} schedule runs one stage per rank; several chunks per rank need the interleaved schedule"
        )


def _costs(shape: PipelineShape, costs: Sequence[StageCosts] | None) -> tuple[StageCosts, ...]:
    if costs is None:
        return (StageCosts(),) * shape.stages
    if len(costs) != shape.stages:
        raise UsageError(f"{len(costs)} stage costs for {shape.stages} stages")
    return tuple(costs)


def _gpipe(shape: PipelineShape, rank: int) -> list[Compute]:
    m = range(shape.microbatches)
    return [Compute(Work.F, i, rank) for i in m] + [Compute(Work.B, i, rank) for i in m]


def _one_f_one_b(shape: PipelineShape, rank: int) -> list[Compute]:
    """1F1B over a rank's ``chunks`` stages (one chunk: PipeDream-flush; more: Megatron-LM's
    interleaved order, microbatches in groups of ``ranks`` per chunk)."""
    p, v, m = shape.ranks, shape.chunks, shape.microbatches
    total = m * v

    def forward(k: int) -> Compute:
        chunk = (k // p) % v
        return Compute(Work.F, (k // (p * v)) * p + k % p, chunk * p + rank)

    def backward(k: int) -> Compute:
        chunk = v - 1 - (k // p) % v
        return Compute(Work.B, (k // (p * v)) * p + k % p, chunk * p + rank)

    warmup = (p - rank - 1) if v == 1 else (p - rank - 1) * 2 + (v - 1) * p
    warmup = min(warmup, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def _zero_bubble(shape: PipelineShape, costs: tuple[StageCosts, ...]) -> list[list[Compute]]:
    """ZB-H1: each rank keeps 1F1B's order of forwards and input-gradient passes; a weight
    pass waits until the rank would otherwise idle (its next pass's input has not arrived, by
    the cost model) or until holding another microbatch's activations would pass 1F1B's peak
    (``ranks``). Built by simulating the ranks together, so the order is a pure function of
    the shape and the costs."""
    p = shape.ranks
    seqs = [
        [Compute(Work.I if c.work is Work.B else c.work, c.microbatch, c.stage) for c in order]
        for order in (_one_f_one_b(shape, r) for r in range(p))
    ]
    done: dict[Compute, float] = {}  # a compute's end time, once placed
    orders: list[list[Compute]] = [[] for _ in range(p)]
    pending: list[list[Compute]] = [[] for _ in range(p)]  # I done, W not yet
    nxt, t, held = [0] * p, [0.0] * p, [0] * p
    blocked: set[int] = set()  # waiting for an input no rank has produced yet
    while True:
        active = [r for r in range(p) if nxt[r] < len(seqs[r]) or pending[r]]
        if not active:
            return orders
        free = [r for r in active if r not in blocked]
        if not free:
            raise PlanError(f"zb-h1 does not complete: ranks {active} wait for each other")
        r = min(free, key=lambda r: (t[r], r))
        step = seqs[r][nxt[r]] if nxt[r] < len(seqs[r]) else None
        ready = _ready_at(shape, costs, step, done) if step is not None else None
        capped = step is not None and step.work is Work.F and held[r] >= p
        if step is not None and ready is not None and ready <= t[r] and not capped:
            work, nxt[r] = step, nxt[r] + 1
        elif pending[r] and (step is None or capped or ready is None or ready > t[r]):
            work = pending[r].pop(0)
        elif ready is not None:  # nothing to fill the wait with: idle until the input arrives
            t[r] = ready
            continue
        else:
            blocked.add(r)
            continue
        t[r] += costs[work.stage].of(work.work)
        done[work] = t[r]
        orders[r].append(work)
        blocked.clear()
        if work.work is Work.F:
            held[r] += 1
        elif work.work is Work.I:
            pending[r].append(Compute(Work.W, work.microbatch, work.stage))
        else:
            held[r] -= 1


def _ready_at(
    shape: PipelineShape,
    costs: tuple[StageCosts, ...],
    step: Compute,
    done: dict[Compute, float],
) -> float | None:
    """When ``step``'s input from another stage is available (None: not produced yet)."""
    dep = _needs(shape, step)
    if dep is None:
        return 0.0
    end = done.get(dep)
    if end is None:
        return None
    local = shape.rank_of(dep.stage) == shape.rank_of(step.stage)
    return end + (0.0 if local else costs[dep.stage].transfer)


def _needs(shape: PipelineShape, c: Compute) -> Compute | None:
    """The other stage's compute whose output ``c`` needs: the previous stage's forward of
    the microbatch, or the next stage's backward (input-gradient) pass."""
    if c.work is Work.F:
        return Compute(Work.F, c.microbatch, c.stage - 1) if c.stage > 0 else None
    if c.work in (Work.B, Work.I) and c.stage < shape.stages - 1:
        return Compute(c.work, c.microbatch, c.stage + 1)
    return None


def _with_transfers(shape: PipelineShape, order: list[Compute]) -> tuple[Action, ...]:
    out: list[Action] = []
    for c in order:
        src = _input_from(shape, c)
        if src is not None and shape.rank_of(src[1]) != shape.rank_of(c.stage):
            what, stage = src
            out.append(
                Recv(
                    what,
                    c.microbatch,
                    stage,
                    shape.rank_of(stage),
                    shape.tag(what, c.microbatch, stage),
                )
            )
        out.append(c)
        dst = _output_to(shape, c)
        if dst is not None and shape.rank_of(dst[1]) != shape.rank_of(c.stage):
            what, stage = dst
            out.append(
                Send(
                    what,
                    c.microbatch,
                    c.stage,
                    shape.rank_of(stage),
                    shape.tag(what, c.microbatch, c.stage),
                )
            )
    return tuple(out)


def _input_from(shape: PipelineShape, c: Compute) -> tuple[Transfer, int] | None:
    """What ``c`` takes from another stage (:func:`_needs`), and the producing stage."""
    dep = _needs(shape, c)
    if dep is None:
        return None
    return (Transfer.ACT if c.work is Work.F else Transfer.GRAD), dep.stage


def _output_to(shape: PipelineShape, c: Compute) -> tuple[Transfer, int] | None:
    """What ``c`` sends to another stage, and the consuming stage."""
    if c.work is Work.F and c.stage < shape.stages - 1:
        return Transfer.ACT, c.stage + 1
    if c.work in (Work.B, Work.I) and c.stage > 0:
        return Transfer.GRAD, c.stage - 1
    return None


# --- checking and timing ------------------------------------------------------------------


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`PlanError` naming the rank and action unless every stage's work for every
    microbatch is on its rank exactly once, every send pairs with one receive (the peers, the
    tag) and the orders complete with blocking receives: no deadlock, no pass before its
    inputs."""
    shape, name = schedule.shape, schedule.kind.value
    works = (Work.F, Work.I, Work.W) if schedule.kind is ScheduleKind.ZB_H1 else (Work.F, Work.B)
    want = {
        Compute(w, i, s)
        for w in works
        for i in range(shape.microbatches)
        for s in range(shape.stages)
    }
    seen: set[Compute] = set()
    sends: dict[tuple[Transfer, int, int], tuple[int, Send]] = {}
    recvs: dict[tuple[Transfer, int, int], tuple[int, Recv]] = {}
    for r, actions in enumerate(schedule.actions):
        for a in actions:
            where = f"pipeline schedule {name}: rank {r}: {a}"
            if isinstance(a, Compute):
                if a not in want or shape.rank_of(a.stage) != r or a in seen:
                    raise PlanError(f"{where}: not this rank's, or not once")
                seen.add(a)
                continue
            if a.tag != shape.tag(a.what, a.microbatch, a.stage):
                raise PlanError(
                    f"{where}: the tag of this message is {shape.tag(a.what, a.microbatch, a.stage)}"
                )
            key = (a.what, a.microbatch, a.stage)
            table: dict = sends if isinstance(a, Send) else recvs  # type: ignore[type-arg]
            if key in table:
                raise PlanError(f"{where}: sent or received twice")
            table[key] = (r, a)
    if want - seen:
        raise PlanError(f"pipeline schedule {name}: no rank runs {min(want - seen, key=str)}")
    for key in sends.keys() | recvs.keys():
        if key not in sends or key not in recvs:
            r, a = sends.get(key) or recvs[key]
            raise PlanError(
                f"pipeline schedule {name}: rank {r}: {a} has no matching {'receive' if key in sends else 'send'}"
            )
        (src, send), (dst, recv) = sends[key], recvs[key]
        if send.peer != dst or recv.peer != src:
            raise PlanError(
                f"pipeline schedule {name}: rank {src}: {send} is received by rank {dst} from rank {recv.peer}"
            )
    time_schedule(schedule)


def time_schedule(schedule: Schedule, costs: Sequence[StageCosts] | None = None) -> ScheduleTiming:
    """The schedule's predicted time-line under ``costs`` (per stage; default F = I = W = 1,
    no transfer time): each rank runs its actions in order, a receive waits for its message
    and then takes its receiving time, a send does not wait. Raises :class:`PlanError` for a
    deadlock (naming every waiting rank and what it waits for) or a pass placed before its
    inputs."""
    shape, name = schedule.shape, schedule.kind.value
    stage_costs = _costs(shape, costs)
    p = shape.ranks
    idx, t = [0] * p, [0.0] * p
    held, peak, busy = [0] * p, [0] * p, [0.0] * p
    arrivals: dict[tuple[Transfer, int, int], float] = {}
    received: set[tuple[Transfer, int, int]] = set()
    ends: dict[Compute, float] = {}
    spans: list[list[Span]] = [[] for _ in range(p)]
    while True:
        moved = False
        for r in range(p):
            actions = schedule.actions[r]
            while idx[r] < len(actions):
                a = actions[idx[r]]
                if isinstance(a, Send):
                    arrivals[(a.what, a.microbatch, a.stage)] = t[r] + stage_costs[a.stage].transfer
                elif isinstance(a, Recv):
                    key = (a.what, a.microbatch, a.stage)
                    if key not in arrivals:
                        break
                    t[r] = max(t[r], arrivals[key]) + stage_costs[a.stage].receive
                    received.add(key)
                else:
                    _check_inputs(shape, name, r, a, ends, received)
                    start, t[r] = t[r], t[r] + stage_costs[a.stage].of(a.work)
                    ends[a] = t[r]
                    busy[r] += t[r] - start
                    spans[r].append(Span(start, t[r], a))
                    frees = Work.W if schedule.kind is ScheduleKind.ZB_H1 else Work.B
                    held[r] += 1 if a.work is Work.F else -1 if a.work is frees else 0
                    peak[r] = max(peak[r], held[r])
                idx[r] += 1
                moved = True
        if all(idx[r] == len(schedule.actions[r]) for r in range(p)):
            break
        if not moved:
            waits = "; ".join(
                f"rank {r} at {schedule.actions[r][idx[r]]}"
                for r in range(p)
                if idx[r] < len(schedule.actions[r])
            )
            raise PlanError(f"pipeline schedule {name} deadlocks: {waits}")
    return ScheduleTiming(tuple(tuple(s) for s in spans), max(t), tuple(busy), tuple(peak))


def _check_inputs(
    shape: PipelineShape,
    name: str,
    rank: int,
    c: Compute,
    ends: dict[Compute, float],
    received: set[tuple[Transfer, int, int]],
) -> None:
    """``c``'s inputs are there: its own forward (a backward pass), its input-gradient pass
    (a weight pass), and the other stage's output (received, or computed on this rank)."""
    local: list[Compute] = []
    if c.work in (Work.B, Work.I):
        local.append(Compute(Work.F, c.microbatch, c.stage))
    if c.work is Work.W:
        local.append(Compute(Work.I, c.microbatch, c.stage))
    dep = _needs(shape, c)
    src = _input_from(shape, c)
    if dep is not None and src is not None:
        what, stage = src
        if shape.rank_of(stage) == rank:
            local.append(dep)
        elif (what, c.microbatch, stage) not in received:
            raise PlanError(
                f"pipeline schedule {name}: rank {rank}: {c} runs before it receives {what.value}(mb {c.microbatch}, stage {stage})"
            )
    for need in local:
        if need not in ends:
            raise PlanError(f"pipeline schedule {name}: rank {rank}: {c} runs before {need}")


def schedule_text(
    schedule: Schedule, timing: ScheduleTiming | None = None, width: int = 160
) -> str:
    """Each rank's time-line (one column per time unit of the cheapest pass: ``F3`` is
    microbatch 3's forward, ``B``/``I``/``W`` its backward or parts, ``.`` idle; ``F3.1`` its
    second chunk), the predicted bubble and the peak activations held per rank."""
    timing = timing or time_schedule(schedule)
    shape = schedule.shape
    lines = [
        f"pipeline schedule {schedule.kind.value}: {shape.ranks} rank(s), {shape.stages} stage(s), "
        f"{shape.microbatches} microbatch(es); predicted bubble {timing.bubble:.1%}; "
        f"activations held at most (per rank): {' '.join(map(str, timing.peak_held))}"
    ]
    unit = min(
        (s.end - s.start for spans in timing.spans for s in spans if s.end > s.start), default=1.0
    )
    cell = 5 if shape.chunks > 1 else 4
    columns = round(timing.makespan / unit)
    if columns * cell > width:
        lines.append(f"(time-line of {columns} units not shown; the order per rank:)")
        for r in range(shape.ranks):
            lines.append(
                f"rank {r}: " + " ".join(_label(s.compute, shape) for s in timing.spans[r])
            )
        return "\n".join(lines) + "\n"
    for r in range(shape.ranks):
        row, at = [], 0
        for s in timing.spans[r]:
            start, n = round(s.start / unit), max(1, round((s.end - s.start) / unit))
            row.append(".".ljust(cell) * (start - at))
            row.append(_label(s.compute, shape).ljust(n * cell - 1, "-") + " ")
            at = start + n
        row.append(".".ljust(cell) * (columns - at))
        lines.append(f"rank {r} | " + "".join(row).rstrip())
    return "\n".join(lines) + "\n"


def _label(c: Compute, shape: PipelineShape) -> str:
    chunk = f".{c.stage // shape.ranks}" if shape.chunks > 1 else ""
    return f"{c.work.value}{c.microbatch}{chunk}"
