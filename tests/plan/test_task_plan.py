"""The task plan (dtm_mpi/plan/task_plan.py): deterministic (the same needs give the same plan
and hash, over random graphs), every stated rule holds, and it fails closed naming the task;
what a task needs comes from its program, with every mismatch located in the graph file."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm_mpi.errors import PlanError, TaskGraphError
from dtm_mpi.io.task_graph import parse_task_graph, parse_task_graph_text
from dtm_mpi.plan.task_plan import TaskNeeds, plan_tasks, task_plan_text
from dtm_mpi.runtime.task_run import plan_task_graph

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tasks"


@st.composite
def graphs(draw: st.DrawFn) -> tuple[list[TaskNeeds], int]:
    job = draw(st.integers(1, 8))
    n = draw(st.integers(1, 40))
    needs = []
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        needs.append(
            TaskNeeds(
                f"t{i}",
                tuple(f"t{d}" for d in deps),
                draw(st.integers(1, job)),
                draw(st.integers(0, 1 << 40)),
                draw(st.integers(0, 1 << 30)),
            )
        )
    return needs, job


@settings(max_examples=150, deadline=None)
@given(graphs())
def test_the_plan_is_deterministic_and_keeps_every_rule(g: tuple[list[TaskNeeds], int]) -> None:
    needs, job = g
    plan = plan_tasks(needs, job_ranks=job)
    again = plan_tasks([dataclasses.replace(n) for n in needs], job_ranks=job)  # new objects
    assert again == plan and again.hash == plan.hash
    assert sorted(p.task for p in plan.placements) == sorted(n.name for n in needs)
    where = {p.task: p for p in plan.placements}
    for n in needs:
        p = where[n.name]
        assert p.ranks == n.ranks and p.first >= 0 and p.first + p.ranks <= job
        for d in n.deps:  # rule 1: after everything it needs, in a later wave
            assert where[d].wave < p.wave and where[d].level < p.level
    for w in range(plan.waves):  # rule 2: a wave's tasks on disjoint ranks
        used = [r for p in plan.wave(w) for r in p.members]
        assert used and len(used) == len(set(used))
    assert [(p.wave, p.first) for p in plan.placements] == sorted(
        (p.wave, p.first) for p in plan.placements
    )


def test_independent_tasks_share_a_wave_and_the_hash_follows_the_job() -> None:
    needs = [
        TaskNeeds("a", (), 2, 10, 0),
        TaskNeeds("b", (), 1, 10, 0),
        TaskNeeds("c", (), 1, 10, 0),
        TaskNeeds("d", ("a", "b"), 4, 10, 0),
    ]
    plan = plan_tasks(needs, job_ranks=4)
    assert [(p.task, p.wave, p.first) for p in plan.placements] == [
        ("a", 0, 0),
        ("b", 0, 2),
        ("c", 0, 3),
        ("d", 1, 0),
    ]
    narrow = plan_tasks([*needs[:3], TaskNeeds("d", ("a", "b"), 2, 10, 0)], job_ranks=2)
    assert [(p.task, p.wave) for p in narrow.placements] == [
        ("a", 0),
        ("b", 1),
        ("c", 1),
        ("d", 2),
    ]
    assert plan.hash != plan_tasks(needs, job_ranks=5).hash
    text = task_plan_text(plan)
    assert "4 task(s) in 2 wave(s)" in text and plan.hash in text


def test_it_fails_closed_naming_the_task() -> None:
    with pytest.raises(PlanError, match=r"task 'big' needs 8 ranks; the job has 4"):
        plan_tasks([TaskNeeds("big", (), 8, 1, 0)], job_ranks=4)
    with pytest.raises(
        PlanError, match=r"task 'fat' needs 2000 bytes on a rank, over the capacity of 1000"
    ):
        plan_tasks([TaskNeeds("fat", (), 1, 2000, 0)], job_ranks=4, capacity=1000)
    with pytest.raises(PlanError, match=r"task 'gpu' needs an accelerator"):
        plan_tasks([TaskNeeds("gpu", (), 1, 1, 0, accelerator=True)], job_ranks=4)
    assert plan_tasks([TaskNeeds("gpu", (), 1, 1, 0, True)], job_ranks=1, devices=1).waves == 1


def _copy(tmp_path: Path) -> Path:
    for f in EXAMPLES.iterdir():
        shutil.copy(f, tmp_path / f.name)
    return tmp_path / "graph.toml"


def test_the_example_plans_with_costs_from_its_programs(tmp_path: Path) -> None:
    progs, plan = plan_task_graph(parse_task_graph(_copy(tmp_path)), job_ranks=4)
    needs = {p.spec.name: p.needs for p in progs}
    assert needs["preprocess"].ranks == 2 and needs["quantize"].ranks == 1
    assert needs["train"].sent_bytes > 0 and needs["train"].deps == ("preprocess",)
    assert [p.task for p in plan.placements] == ["preprocess", "train", "quantize"]
    with pytest.raises(
        TaskGraphError,
        match=r"graph.toml:11:1: task 'preprocess' needs 2 ranks; the job has 1: it fits nowhere",
    ):
        plan_task_graph(parse_task_graph(tmp_path / "graph.toml"), job_ranks=1)
    with pytest.raises(TaskGraphError, match=r"task 'train' needs \d+ bytes on a rank"):
        plan_task_graph(parse_task_graph(tmp_path / "graph.toml"), job_ranks=2, capacity=5000)


@pytest.mark.parametrize(
    ("old", "new", "where", "words"),
    [
        (
            'inputs = { x = "features"',
            'inputs = { z = "features"',
            ":20:12:",
            "has no parameter %z",
        ),
        (', w = "w_init" }', " }", ":20:1:", "parameter %w of @step has no init"),
        (
            'outputs = { w = "w_trained"',
            'outputs = { result7 = "w_trained"',
            ":21:13:",
            "'result7' is no output of @step",
        ),
        (
            'outputs = { result0 = "features", result1 = "targets" }',
            'outputs = { result1 = "features", result0 = "targets" }',
            ":20:12:",
            "parameter %x is f32[64,16], but tensor 'features' is f32[64,4] (written by task 'preprocess' as result1",
        ),
        (
            'program = "quantize.dtm"',
            'program = "quantize.dtm"\nmesh = "dp=2"',
            ":26:1:",
            "declares no mesh",
        ),
        ("steps = 20", 'steps = 20\nmesh = "tp=2"', ":20:1:", "--mesh sets axis 'tp'"),
    ],
)
def test_program_mismatches_are_located_in_the_graph(
    tmp_path: Path, old: str, new: str, where: str, words: str
) -> None:
    path = _copy(tmp_path)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(TaskGraphError) as info:
        plan_task_graph(parse_task_graph(path), job_ranks=4)
    msg = str(info.value)
    assert msg.startswith(str(path) + where), msg
    assert words in msg, msg


def test_a_program_that_does_not_verify_is_named_with_its_own_location(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    bad = (tmp_path / "quantize.dtm").read_text().replace("block 4 : i8", "block 3 : i8")
    (tmp_path / "quantize.dtm").write_text(bad)
    with pytest.raises(TaskGraphError) as info:
        plan_task_graph(parse_task_graph(path), job_ranks=4)
    msg = str(info.value)
    assert msg.startswith(f"{path}:25:1: task 'quantize': program {tmp_path / 'quantize.dtm'}:"), (
        msg
    )
    assert "quantize.dtm:7:" in msg, msg


def test_a_graph_without_programs_is_refused_before_planning() -> None:
    g = parse_task_graph_text(
        'version = 1\n[[task]]\nname = "a"\nprogram = "missing.dtm"\noutputs = { result0 = "x" }\n',
        "g.toml",
    )
    with pytest.raises(TaskGraphError, match=r"^g.toml:4:1: task 'a': program missing.dtm"):
        plan_task_graph(g, job_ranks=1)
