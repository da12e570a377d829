"""The elastic launcher's decisions (pure): the mesh rule, the host file, the relaunch loop's
commands and its bounds, with the launches and the host probes replaced by scripted ones. The
real thing under mpirun is in tests/test_mpi_long_runs.py and tests/test_multihost.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dtm_mpi.errors import EXIT_REQUEUE, UsageError
from dtm_mpi.runtime.elastic import launch_elastic, parse_hostfile, shrink_mesh


def test_the_first_axis_shrinks_and_the_others_stay() -> None:
    assert shrink_mesh({"dp": 2, "tp": 2}, 4) == {"dp": 2, "tp": 2}
    assert shrink_mesh({"dp": 2, "tp": 2}, 3) == {"dp": 1, "tp": 2}
    assert shrink_mesh({"dp": 4, "pp": 2, "tp": 2}, 13) == {"dp": 3, "pp": 2, "tp": 2}
    assert shrink_mesh({"dp": 2, "tp": 2}, 9) == {"dp": 2, "tp": 2}  # never grows
    assert shrink_mesh(None, 5) is None
    with pytest.raises(
        UsageError,
        match=r"1 slot\(s\) left cannot hold one replica of the mesh \(tp=2 needs 2 ranks\)",
    ):
        shrink_mesh({"dp": 2, "tp": 2}, 1)


def test_host_files() -> None:
    assert parse_hostfile("a slots=2\n# c\n\nb  slots=3 max_slots=4\nc\n") == (
        ("a", 2),
        ("b", 3),
        ("c", 1),
    )
    with pytest.raises(UsageError, match=r"hosts:2: 'slots=x' is not slots=N"):
        parse_hostfile("a\nb slots=x\n", "hosts")
    with pytest.raises(UsageError, match="no hosts"):
        parse_hostfile("# nothing\n")


def _store(tmp_path: Path) -> str:
    """A store holding a committed checkpoint (a directory so named is one, for listing)."""
    (tmp_path / "s" / "ckpt-00000005").mkdir(parents=True)
    return str(tmp_path / "s")


def _script(codes: list[int]) -> tuple[list[list[str]], Callable[[list[str]], tuple[int, str]]]:
    seen: list[list[str]] = []

    def start(cmd: list[str]) -> tuple[int, str]:
        seen.append(cmd)
        return codes[len(seen) - 1], f"line of attempt {len(seen)}"

    return seen, start


def test_a_failed_run_is_relaunched_with_resume_until_it_succeeds(tmp_path: Path) -> None:
    seen, start = _script([1, 0])
    said: list[str] = []
    code = launch_elastic(
        ["m.dtm", "--mesh", "dp=2,tp=2", "--store", _store(tmp_path), "--steps", "9"],
        ranks=None,
        hostfile=None,
        max_restarts=3,
        probe="true",
        python="py",
        say=said.append,
        start=start,
    )
    assert code == 0 and len(seen) == 2
    assert seen[0][:3] == ["mpirun", "-n", "4"] and "--resume" not in seen[0]
    assert seen[1][-1] == "--resume" and seen[1][seen[1].index("--mesh") + 1] == "dp=2,tp=2"
    assert "relaunching on 4 rank(s)" in said[1]


def test_a_lost_host_shrinks_the_mesh_to_the_slots_left(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("alive slots=2\ngone slots=2\n")
    seen, start = _script([137, 0])
    said: list[str] = []
    code = launch_elastic(
        ["m.dtm", "--mesh", "dp=2,tp=2", "--store", _store(tmp_path)],
        ranks=None,
        hostfile=str(hostfile),
        max_restarts=2,
        probe="test {host} = alive",
        python="py",
        say=said.append,
        start=start,
    )
    assert code == 0
    assert seen[0][seen[0].index("--host") + 1] == "alive:2,gone:2"
    second = seen[1]
    assert second[second.index("-n") + 1] == "2" and second[second.index("--host") + 1] == "alive:2"
    assert second[second.index("--mesh") + 1] == "dp=1,tp=2" and second[-1] == "--resume"
    assert "lost host(s) gone" in said[1]


def test_the_restarts_are_bounded_and_a_saved_stop_is_passed_on(tmp_path: Path) -> None:
    seen, start = _script([1, 1, 1])
    said: list[str] = []
    assert (
        launch_elastic(
            ["m.dtm", "--store", str(tmp_path / "none-yet")],
            ranks=2,
            hostfile=None,
            max_restarts=2,
            probe="true",
            say=said.append,
            start=start,
        )
        == 1
    )
    assert "--resume" not in seen[1]  # no checkpoint yet: the relaunch starts from the beginning
    assert len(seen) == 3 and said[-1].startswith(
        "dtm launch: gave up after 3 attempt(s) (2 restart(s)); the last ended with exit code 1: line of attempt 3"
    )
    seen, start = _script([EXIT_REQUEUE])
    assert (
        launch_elastic(
            ["m.dtm", "--store", str(tmp_path / "none-yet")],
            ranks=2,
            hostfile=None,
            max_restarts=2,
            probe="true",
            say=said.append,
            start=start,
        )
        == EXIT_REQUEUE
    )
    assert len(seen) == 1


def test_no_replica_left_gives_up_saying_why(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=1\n")
    _, start = _script([1])
    said: list[str] = []
    code = launch_elastic(
        ["m.dtm", "--mesh", "dp=1,tp=2", "--store", _store(tmp_path)],
        ranks=None,
        hostfile=str(hostfile),
        max_restarts=3,
        probe="test {host} = a",
        say=said.append,
        start=start,
    )
    assert (
        code == 1
        and said[-1]
        == "dtm launch: gave up: hosts b lost; 1 slot(s) left cannot hold one replica of the mesh (tp=2 needs 2 ranks)"
    )
