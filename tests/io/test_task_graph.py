"""Task graph files (io/TASKS.md): the example parses; every error the file alone decides is
located FILE:LINE:COL at the task or field; the vectors of io/vectors/tasks/ hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dtm_mpi.errors import TaskGraphError
from dtm_mpi.io.task_graph import parse_task_graph, parse_task_graph_text, task_deps

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tasks" / "graph.toml"
VECTORS = ROOT / "io" / "vectors" / "tasks"

HEAD = 'format = "dtm-tasks"\nversion = 1\nstore = "s"\n'


def _err(text: str, file: str = "g.toml") -> str:
    with pytest.raises(TaskGraphError) as info:
        parse_task_graph_text(text, file)
    return str(info.value)


def test_the_example_parses_with_its_tasks_paths_and_dependencies() -> None:
    g = parse_task_graph(EXAMPLE)
    assert [t.name for t in g.tasks] == ["preprocess", "train", "quantize"]
    assert g.store == EXAMPLE.parent / "store"
    train = g.task("train")
    assert train.program == EXAMPLE.parent / "train.dtm" and train.steps == 20
    assert dict(train.inputs) == {"x": "features", "y": "targets", "w": "w_init"}
    assert dict(train.outputs) == {"w": "w_trained", "result0": "train_loss"}
    assert task_deps(g.tasks) == {
        "preprocess": (),
        "train": ("preprocess",),
        "quantize": ("train",),
    }
    assert g.producers()["w_trained"].name == "train"
    text = EXAMPLE.read_text().splitlines()
    assert 'name = "train"' in text[train.span.line - 1]
    assert "steps" in text[train.at("steps").line - 1]


def test_json_graphs_read_like_toml() -> None:
    doc = {
        "format": "dtm-tasks",
        "version": 1,
        "store": "s",
        "task": [{"name": "a", "program": "a.dtm", "outputs": {"result0": "x"}, "mesh": "dp=2"}],
    }
    g = parse_task_graph_text(json.dumps(doc, indent=1), "g.json")
    assert g.tasks[0].mesh == (("dp", 2),)
    msg = _err(json.dumps(doc)[:-3], "g.json")
    assert msg.startswith("g.json:1:")


@pytest.mark.parametrize(
    ("body", "where", "words"),
    [
        (
            '[[task]]\nname = "a"\nprogram = "a.dtm"\noutputs = { result0 = "x" }\ncolour = 1\n',
            "g.toml:8:1",
            "unknown field 'colour'",
        ),
        ('[[task]]\nname = "a"\noutputs = { result0 = "x" }\n', "g.toml:5:1", "needs program"),
        (
            '[[task]]\nname = "a b"\nprogram = "a.dtm"\noutputs = { result0 = "x" }\n',
            "g.toml:5:1",
            "needs a name",
        ),
        ('[[task]]\nname = "a"\nprogram = "a.dtm"\noutputs = {}\n', "g.toml:7:1", "writes nothing"),
        (
            '[[task]]\nname = "a"\nprogram = "a.dtm"\noutputs = { result0 = "x" }\nsteps = 0\n',
            "g.toml:8:1",
            "steps must be an integer >= 1",
        ),
        (
            '[[task]]\nname = "a"\nprogram = "a.dtm"\noutputs = { result0 = "x" }\nmesh = "dp=0"\n',
            "g.toml:8:1",
            "mesh",
        ),
        (
            '[[task]]\nname = "a"\nprogram = "a.dtm"\noutputs = { result0 = "x" }\nbackend = "tpu"\n',
            "g.toml:8:1",
            "backend must be one of",
        ),
        (
            '[[task]]\nname = "a"\nprogram = "a.dtm"\ninputs = { p = "bad name" }\noutputs = { result0 = "x" }\n',
            "g.toml:7:12",
            "inputs.p",
        ),
        (
            '[[task]]\nname = "a"\nprogram = "a.dtm"\noutputs = { result0 = "x" }\nafter = ["zz"]\n',
            "g.toml:8:1",
            "after names 'zz'",
        ),
    ],
)
def test_field_errors_name_the_task_and_its_line(body: str, where: str, words: str) -> None:
    msg = _err(HEAD + body)
    assert msg.startswith(where + ":") or msg.startswith(where), msg
    assert words in msg, msg
    if 'name = "a"' in body:
        assert "task 'a'" in msg


def test_a_tensor_has_one_producer_and_a_task_one_definition() -> None:
    two = (
        '[[task]]\nname = "a"\nprogram = "a.dtm"\noutputs = { result0 = "x" }\n\n'
        '[[task]]\nname = "b"\nprogram = "b.dtm"\noutputs = { result0 = "y", result1 = "x" }\n'
    )
    msg = _err(HEAD + two)
    assert msg.startswith("g.toml:12:28:") and "task 'a' writes too (g.toml:5:1)" in msg, msg
    again = two.replace('name = "b"', 'name = "a"').replace('result1 = "x"', 'result1 = "z"')
    msg = _err(HEAD + again)
    assert msg.startswith("g.toml:10:1:") and "defined twice (first at g.toml:5:1)" in msg, msg


def test_a_cycle_is_named_with_every_task_on_it() -> None:
    body = (
        '[[task]]\nname = "a"\nprogram = "a.dtm"\ninputs = { p = "z" }\noutputs = { result0 = "x" }\n\n'
        '[[task]]\nname = "b"\nprogram = "b.dtm"\ninputs = { p = "x" }\noutputs = { result0 = "y" }\n\n'
        '[[task]]\nname = "c"\nprogram = "c.dtm"\ninputs = { p = "y" }\noutputs = { result0 = "z" }\n'
    )
    msg = _err(HEAD + body)
    assert msg.startswith("g.toml:5:1:") and "cycle" in msg, msg
    assert re.search(r"a \(5\) -> c \(17\) -> b \(11\) -> a \(5\)", msg), msg
    self_loop = '[[task]]\nname = "a"\nprogram = "a.dtm"\ninputs = { p = "x" }\noutputs = { result0 = "x" }\n'
    assert "a (5) -> a (5)" in _err(HEAD + self_loop)
    after = (
        '[[task]]\nname = "a"\nprogram = "a.dtm"\noutputs = { result0 = "x" }\nafter = ["b"]\n\n'
        '[[task]]\nname = "b"\nprogram = "b.dtm"\ninputs = { p = "x" }\noutputs = { result0 = "y" }\n'
    )
    assert "cycle" in _err(HEAD + after)


def test_syntax_errors_and_header_errors_are_located() -> None:
    assert _err(HEAD + "[[task]\n").startswith("g.toml:4:")
    assert _err('format = "other"\nversion = 1\n').startswith("g.toml:1:1: format must be")
    assert _err("version = 2\n").startswith("g.toml:1:1: version must be 1")
    assert _err('version = 1\nstore = "s"\n').startswith("g.toml:")  # no tasks
    with pytest.raises(TaskGraphError, match="cannot read"):
        parse_task_graph("/nonexistent.toml")


def _vectors() -> list[Path]:
    return sorted(VECTORS.glob("*/*.toml"))


@pytest.mark.parametrize("path", _vectors(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_vectors(path: Path) -> None:
    """``valid/*.toml`` parse and give the dependencies of ``*.deps.json``; ``invalid/*.toml``
    fail with the location and words of ``*.error``."""
    if path.parent.name == "valid":
        g = parse_task_graph(path)
        want = json.loads(path.with_suffix(".deps.json").read_text())
        assert {k: list(v) for k, v in task_deps(g.tasks).items()} == want
        return
    with pytest.raises(TaskGraphError) as info:
        parse_task_graph(path)
    where, words = path.with_suffix(".error").read_text().strip().split(" ", 1)
    got = str(info.value).replace(str(path), path.name)
    assert got.startswith(where + ":") or got.startswith(where + " "), got
    assert words in got, got


def test_there_are_vectors() -> None:
    kinds = {p.parent.name for p in _vectors()}
    assert kinds == {"valid", "invalid"}


def test_the_schema_accepts_every_valid_file_and_the_example() -> None:
    import tomllib

    import jsonschema

    schema = json.loads((ROOT / "io" / "taskgraph.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for path in [EXAMPLE, *sorted((VECTORS / "valid").glob("*.toml"))]:
        doc = tomllib.loads(path.read_text())
        assert not list(validator.iter_errors(doc)), path
    bad = tomllib.loads((VECTORS / "invalid" / "no_outputs.toml").read_text())
    assert list(validator.iter_errors(bad))
