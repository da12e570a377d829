"""What a task graph keeps in its store (dtm_mpi/io/task_records.py, io/TASKS.md §5): records
round-trip and a damaged one only means the task runs; staleness flows down the records from a
changed tensor (``dtm store ls`` shows it, ``dtm store get`` warns); ``dtm store deprecate``
moves tensors along the lifecycle and refuses a move it does not allow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dtm_mpi.cli import main
from dtm_mpi.errors import LifecycleError
from dtm_mpi.io.manifest import Lifecycle
from dtm_mpi.io.store import committed_name, read_latest
from dtm_mpi.io.task_records import (
    TaskRecord,
    identity,
    read_record,
    read_records,
    record_holds,
    stale_tensors,
    task_key,
    write_record,
)
from dtm_mpi.io.tools import put_tensor, put_tensors, read_manifest
from tests.test_cli_store import comm


def _latest(store: Path):  # type: ignore[no-untyped-def]
    step = read_latest(store)
    assert step is not None
    return read_manifest(store / committed_name(step))


def _graph_store(tmp_path: Path) -> Path:
    """raw -> task p -> f -> task q -> g, all stored, with the records a run would write."""
    store = tmp_path / "s"
    store.mkdir()
    rng = np.random.default_rng(0)
    put_tensors(
        store,
        comm(),
        {"raw": rng.standard_normal(8), "f": rng.standard_normal(8), "g": rng.standard_normal(2)},
    )
    m = _latest(store)
    ids = {a.name: identity(a) for a in m.artifacts}
    write_record(
        store, TaskRecord("p", "1" * 64, m.step, (("f", ids["f"]),), (("raw", ids["raw"]),))
    )
    write_record(store, TaskRecord("q", "2" * 64, m.step, (("g", ids["g"]),), (("f", ids["f"]),)))
    return store


def test_records_round_trip_and_a_bad_one_means_run(tmp_path: Path) -> None:
    store = _graph_store(tmp_path)
    rec = read_record(store, "p")
    assert (
        rec is not None
        and rec.inputs[0][0] == "raw"
        and [r.task for r in read_records(store)] == ["p", "q"]
    )
    assert record_holds(rec, "1" * 64, _latest(store)) and not record_holds(
        rec, "3" * 64, _latest(store)
    )
    (store / "tasks" / "p.json").write_text("{not json")
    assert read_record(store, "p") is None
    assert read_record(store, "nobody") is None
    key = task_key(
        "h",
        mesh=[("dp", 2)],
        steps=3,
        backend="numpy",
        outputs=[("result0", "f")],
        inputs={"x": "a", "y": "b"},
    )
    assert key == task_key(
        "h",
        mesh=[("dp", 2)],
        steps=3,
        backend="numpy",
        outputs=[("result0", "f")],
        inputs={"y": "b", "x": "a"},
    )
    assert key != task_key(
        "h",
        mesh=[("dp", 2)],
        steps=4,
        backend="numpy",
        outputs=[("result0", "f")],
        inputs={"x": "a", "y": "b"},
    )


def test_staleness_flows_down_the_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _graph_store(tmp_path)
    assert stale_tensors(_latest(store), read_records(store)) == {}
    put_tensor(store, comm(), "raw", np.zeros(8))
    stale = stale_tensors(_latest(store), read_records(store))
    assert stale == {
        "f": "its input 'raw' changed since task 'p' computed it",
        "g": "its input 'f' is stale",
    }
    assert main(["store", "ls", str(store)]) == 0
    out = capsys.readouterr().out
    assert "g is stale: its input 'f' is stale" in out
    assert any(line.split()[:3] == ["f", "primary", "stale"] for line in out.splitlines())
    assert main(["store", "get", str(store), "g", "-o", str(tmp_path / "g.npy")]) == 0
    assert "warning: tensor 'g' is stale" in capsys.readouterr().err
    put_tensor(store, comm(), "f", np.ones(8))  # f written anew (not by p's record)
    assert stale_tensors(_latest(store), read_records(store)) == {
        "g": "its input 'f' changed since task 'q' computed it"
    }


def test_deprecate_moves_along_the_lifecycle_and_refuses_other_moves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _graph_store(tmp_path)
    assert main(["store", "deprecate", str(store), "raw"]) == 0
    m = _latest(store)
    assert (
        m.artifact("raw").state is Lifecycle.DEPRECATED
        and m.artifact("f").state is Lifecycle.ACTIVE
    )
    put_tensor(store, comm(), "g", np.ones(2))  # a later put carries the state
    assert _latest(store).artifact("raw").state is Lifecycle.DEPRECATED
    assert main(["store", "get", str(store), "raw", "-o", str(tmp_path / "r.npy")]) == 0
    assert "warning: tensor 'raw' is deprecated" in capsys.readouterr().err
    with pytest.raises(
        LifecycleError, match=r"tensor 'raw': lifecycle DEPRECATED -> DEPRECATED is not allowed"
    ):
        main(["store", "deprecate", str(store), "raw"])
    with pytest.raises(Exception, match=r"no tensor 'nope' to move"):
        main(["store", "deprecate", str(store), "nope"])
    put_tensor(store, comm(), "raw", np.zeros(8))  # a new value is a new version: active
    assert _latest(store).artifact("raw").state is Lifecycle.ACTIVE


def test_a_rebuilding_task_makes_its_outputs_recovering_until_its_commit(tmp_path: Path) -> None:
    from dtm_mpi.io.task_records import clear_running, mark_running, recovering_tensors

    store = _graph_store(tmp_path)
    assert recovering_tensors(store, _latest(store), read_records(store)) == {}
    mark_running(store, "q", "2" * 64)
    got = recovering_tensors(store, _latest(store), read_records(store))
    assert list(got) == ["g"] and "task 'q' is rebuilding it" in got["g"]
    clear_running(store, "q")
    clear_running(store, "q")  # (gone already: nothing to do)
    assert recovering_tensors(store, _latest(store), read_records(store)) == {}
