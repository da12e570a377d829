"""Pipeline schedules (dtm_mpi.plan.schedule): the predicted time-lines against the closed
forms of the literature (GPipe and 1F1B: bubble (p-1)/(m+p-1); Megatron-LM's interleaved
schedule: (p-1)/(v m + p-1); Zero Bubble's ZB-H1: a third of 1F1B's bubble at 1F1B's peak
memory), and the checks that refuse a schedule whose sends, receives or order are wrong."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dtm_mpi.errors import PlanError, UsageError
from dtm_mpi.plan.schedule import (
    Compute,
    PipelineShape,
    Recv,
    Schedule,
    ScheduleKind,
    Send,
    StageCosts,
    Work,
    check_schedule,
    parse_schedule,
    plan_schedule,
    schedule_text,
    time_schedule,
)

GPIPE, ONE, INTER, ZB = (
    ScheduleKind.GPIPE,
    ScheduleKind.ONE_F_ONE_B,
    ScheduleKind.INTERLEAVED,
    ScheduleKind.ZB_H1,
)
RANKS = (1, 2, 3, 4, 8)
MICRO = (1, 2, 3, 4, 8, 16)


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", MICRO)
def test_gpipe_and_1f1b_take_m_plus_p_minus_1_slots_and_1f1b_holds_at_most_p(
    p: int, m: int
) -> None:
    """F = 1, B = 2 (I = W = 1): a slot is F + B = 3; both take (m + p - 1) slots; GPipe holds
    every microbatch's activations, 1F1B at most p - r on rank r."""
    gpipe = time_schedule(plan_schedule(GPIPE, PipelineShape(p, m)))
    one = time_schedule(plan_schedule(ONE, PipelineShape(p, m)))
    for timing in (gpipe, one):
        assert timing.makespan == 3 * (m + p - 1)
        assert timing.bubble == pytest.approx((p - 1) / (m + p - 1))
        assert timing.busy == (3.0 * m,) * p
    assert gpipe.peak_held == (m,) * p
    assert one.peak_held == tuple(min(p - r, m) for r in range(p))
    if m > p:
        assert max(one.peak_held) < max(gpipe.peak_held)


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("v", (2, 3))
@pytest.mark.parametrize("groups", (1, 2, 4))
def test_interleaved_divides_the_bubble_by_the_chunks(p: int, v: int, groups: int) -> None:
    """Megatron-LM: v stages per rank, each a v-th of the model (costs / v): the bubble
    (p - 1)/(v m + p - 1)."""
    m = p * groups
    costs = [StageCosts(1 / v, 1 / v, 1 / v)] * (p * v)
    timing = time_schedule(plan_schedule(INTER, PipelineShape(p, m, v)), costs)
    assert timing.makespan == pytest.approx(3 * m + 3 * (p - 1) / v)
    assert timing.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    one = time_schedule(plan_schedule(ONE, PipelineShape(p, m)))
    assert timing.bubble < one.bubble


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", MICRO)
def test_zb_h1_has_a_third_of_1f1bs_bubble_at_1f1bs_peak(p: int, m: int) -> None:
    """F = I = W: ZB-H1's idle time is (p - 1)(F + I - W) = p - 1 against 1F1B's 3(p - 1)
    once m >= p; never above 1F1B's, and never holding more activations than 1F1B's peak."""
    zb = time_schedule(plan_schedule(ZB, PipelineShape(p, m)))
    one = time_schedule(plan_schedule(ONE, PipelineShape(p, m)))
    if m >= p:
        assert zb.makespan == 3 * m + (p - 1)
    assert zb.makespan <= one.makespan
    if p > 1 and m >= p:
        assert zb.bubble < one.bubble
        idle = zb.makespan * p - sum(zb.busy)
        assert idle == pytest.approx((one.makespan * p - sum(one.busy)) / 3)
    assert max(zb.peak_held) <= max(one.peak_held)


TIMELINES = [  # worked by hand: (receive, makespan, rank 0's passes, rank 1's first two)
    (0.0, 14.0, [(0, 1), (1, 2), (5, 7), (7, 8), (8, 10), (12, 14)], [(1.5, 2.5), (2.5, 4.5)]),
    (
        0.25,
        15.0,
        [(0, 1), (1, 2), (5.5, 7.5), (7.5, 8.5), (8.75, 10.75), (13, 15)],
        [(1.75, 2.75), (2.75, 4.75)],
    ),
]


@pytest.mark.parametrize(("receive", "makespan", "rank0", "rank1"), TIMELINES)
def test_transfer_and_receiving_times_are_on_the_critical_path(
    receive: float,
    makespan: float,
    rank0: list[tuple[float, float]],
    rank1: list[tuple[float, float]],
) -> None:
    """2 ranks, 3 microbatches under 1F1B, a message takes 0.5 to arrive. Without receiving
    time rank 0 waits for the gradient of microbatch 2 until 12 and its backward ends at 14;
    when taking an arrived message costs its receiver 0.25 (idle for the pipeline), rank 0's
    backward of microbatch 0 waits for the gradient that arrives at 5.25 and starts at 5.5,
    and the step ends at 15."""
    costs = [StageCosts(1, 1, 1, transfer=0.5, receive=receive)] * 2
    timing = time_schedule(plan_schedule(ONE, PipelineShape(2, 3)), costs)
    assert timing.makespan == makespan
    assert [(s.start, s.end) for s in timing.spans[0]] == rank0
    assert [(s.start, s.end) for s in timing.spans[1]][:2] == rank1
    assert timing.bubble == 1 - 18 / (2 * makespan)  # the receiving time is not busy


def test_every_boundary_message_is_one_send_and_one_receive_with_a_unique_tag() -> None:
    schedule = plan_schedule(INTER, PipelineShape(2, 4, 2))
    sends = [(r, a) for r, acts in enumerate(schedule.actions) for a in acts if isinstance(a, Send)]
    recvs = [(r, a) for r, acts in enumerate(schedule.actions) for a in acts if isinstance(a, Recv)]
    # 4 stages: 3 boundaries, each crossed by every microbatch's activations and gradient
    assert len(sends) == len(recvs) == 3 * 4 * 2
    assert len({a.tag for _, a in sends}) == len(sends)
    assert max(a.tag for _, a in sends) <= schedule.shape.max_tag
    for r, s in sends:
        (dst, recv) = next((q, b) for q, b in recvs if b.tag == s.tag)
        assert (s.peer, recv.peer) == (dst, r)
    # on one rank, a receive comes just before the pass that needs it
    acts = schedule.actions[1]
    for i, a in enumerate(acts):
        if isinstance(a, Recv):
            after = acts[i + 1]
            assert isinstance(after, Compute) and after.microbatch == a.microbatch


def _replace(schedule: Schedule, rank: int, actions: list[object]) -> Schedule:
    rows = list(schedule.actions)
    rows[rank] = tuple(actions)  # type: ignore[arg-type]
    return dataclasses.replace(schedule, actions=tuple(rows))


def test_a_pass_before_its_input_arrives_is_refused_naming_the_rank() -> None:
    schedule = plan_schedule(ONE, PipelineShape(2, 2))
    acts = list(schedule.actions[1])
    recv = next(i for i, a in enumerate(acts) if isinstance(a, Recv))
    acts[recv], acts[recv + 1] = acts[recv + 1], acts[recv]  # F(mb 0) before its activations
    with pytest.raises(
        PlanError,
        match=re.escape("rank 1: F(mb 0, stage 1) runs before it receives act(mb 0, stage 0)"),
    ):
        check_schedule(_replace(schedule, 1, acts))


def test_an_order_that_deadlocks_names_every_waiting_rank() -> None:
    """Rank 0 waits for a gradient before sending the activations it depends on."""
    schedule = plan_schedule(ONE, PipelineShape(2, 2))
    acts = list(schedule.actions[0])
    grad = next(i for i, a in enumerate(acts) if isinstance(a, Recv))
    acts.insert(0, acts.pop(grad))
    with pytest.raises(
        PlanError,
        match=r"deadlocks: rank 0 at recv grad\(mb 0, stage 1\) from rank 1 tag \d+; rank 1 at recv act\(mb 0, stage 0\)",
    ):
        check_schedule(_replace(schedule, 0, acts))


def test_an_unpaired_or_mistagged_message_is_refused() -> None:
    schedule = plan_schedule(GPIPE, PipelineShape(2, 2))
    acts = list(schedule.actions[0])
    i = next(i for i, a in enumerate(acts) if isinstance(a, Send))
    dropped = acts[:i] + acts[i + 1 :]
    with pytest.raises(
        PlanError, match=r"rank 1: recv act\(mb 0, stage 0\) from rank 0 tag 0 has no matching send"
    ):
        check_schedule(_replace(schedule, 0, dropped))
    send = acts[i]
    assert isinstance(send, Send)
    acts[i] = dataclasses.replace(send, tag=send.tag + 100)
    with pytest.raises(PlanError, match=r"rank 0: send act.*the tag of this message is 0"):
        check_schedule(_replace(schedule, 0, acts))


def test_work_missing_or_on_the_wrong_rank_is_refused() -> None:
    schedule = plan_schedule(ONE, PipelineShape(2, 2))
    acts = [a for a in schedule.actions[0] if a != Compute(Work.B, 1, 0)]
    with pytest.raises(PlanError, match=re.escape("no rank runs B(mb 1, stage 0)")):
        check_schedule(_replace(schedule, 0, acts))
    moved = [*schedule.actions[0], Compute(Work.F, 0, 1)]
    with pytest.raises(PlanError, match=re.escape("rank 0: F(mb 0, stage 1): not this rank's")):
        check_schedule(_replace(schedule, 0, moved))


def test_bad_choices_are_usage_errors() -> None:
    assert parse_schedule("1F1B") is ONE and parse_schedule("zb-h1") is ZB
    with pytest.raises(
        UsageError,
        match="unknown pipeline schedule 'pipedream'; choose one of gpipe, 1f1b, interleaved, zb-h1",
    ):
        parse_schedule("pipedream")
    with pytest.raises(
        UsageError, match="microbatches in multiples of the pipeline ranks \\(4\\); got 6"
    ):
        plan_schedule(INTER, PipelineShape(4, 6, 2))
    with pytest.raises(UsageError, match="at least 2 chunks"):
        plan_schedule(INTER, PipelineShape(4, 8))
    with pytest.raises(UsageError, match="several chunks per rank need the interleaved schedule"):
        plan_schedule(ONE, PipelineShape(2, 4, 2))
    with pytest.raises(UsageError, match="--microbatches must be >= 1"):
        PipelineShape(2, 0)
    with pytest.raises(UsageError, match="3 stage costs for 2 stages"):
        plan_schedule(ZB, PipelineShape(2, 2), [StageCosts()] * 3)


def test_the_time_line_text() -> None:
    text = schedule_text(plan_schedule(ONE, PipelineShape(2, 2)))
    assert text == (
        "pipeline schedule 1f1b: 2 rank(s), 2 stage(s), 2 microbatch(es); predicted bubble 33.3%; "
        "activations held at most (per rank): 2 1\n"
        "rank 0 | F0- F1- .   .   B0----- .   B1-----\n"
        "rank 1 | .   F0- B0----- F1- B1----- .   .\n"
    )
    long = schedule_text(plan_schedule(ONE, PipelineShape(2, 64)))
    assert "time-line of 195 units not shown" in long and "rank 1: F0 B0 F1 B1" in long
    zb = schedule_text(plan_schedule(ZB, PipelineShape(2, 2)))
    assert "I0-" in zb and "W0-" in zb
