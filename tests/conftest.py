"""Shared test harness.

Single-process runs (``pytest -m "not mpi"``) never touch MPI. MPI runs
(``mpirun -n N python -m mpi4py -m pytest --with-mpi -m mpi``) get:

* an agreement after every test phase (setup, call, teardown): every rank learns which ranks
  failed, so a failure on one rank fails the test on every rank, and rank 0's summary names the
  failing ranks. A rank whose test failed waits at most ``DTM_TEST_AGREE_TIMEOUT`` seconds
  (default 10) for its peers; if they do not arrive (stuck in a collective the failed rank will
  never enter) it prints its failure and aborts the whole job;
* quiet ranks: only rank 0 prints progress and the summary; other ranks print only their own
  failures, each line prefixed with ``[rank N]``;
* fixtures ``comm`` (a private duplicate of the world communicator) and ``mpi_tmp_path``
  (one temporary directory shared by all ranks, removed after the test).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.depth import register_profiles

register_profiles()


@pytest.fixture(autouse=True)
def _fresh_config() -> Iterator[None]:
    """Each test reads the configuration its environment gives: a setting one test made
    (``set_setting``, restored in ``os.environ`` by monkeypatch) is not left cached for the next
    (this fixture's teardown runs after monkeypatch's)."""
    yield
    from dtm_mpi.config import get_config

    get_config.cache_clear()


_HARNESS_KEY = pytest.StashKey["_MpiHarness"]()


class _MpiHarness:
    def __init__(self, config: pytest.Config) -> None:
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.fail_wait_s = float(os.environ.get("DTM_TEST_AGREE_TIMEOUT", "10"))
        self.ok_wait_s = float(config.getini("timeout") or 120) + 60.0

    def prefix(self, text: str) -> str:
        return "\n".join(f"[rank {self.rank}] {line}" for line in text.splitlines())


def _with_mpi(config: pytest.Config) -> bool:
    return bool(config.getoption("with_mpi", default=False))


def _limit_worker_blas() -> None:
    """Under pytest-xdist a worker's BLAS gets its share of the CPUs, as a rank's does (two
    workers a core, each with a BLAS thread a core, would spin-wait for each other)."""
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if os.environ.get("PYTEST_XDIST_WORKER") and count.isdigit():
        import numpy  # noqa: F401  (the BLAS must be loaded to be limited)

        from dtm_mpi.kernels.devices import limit_blas_to_share

        limit_blas_to_share(int(count))


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    _limit_worker_blas()
    if not _with_mpi(config):
        return
    harness = _MpiHarness(config)
    config.stash[_HARNESS_KEY] = harness
    if harness.rank != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            from _pytest._io import TerminalWriter

            devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the session
            reporter._tw = TerminalWriter(devnull)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Hold every rank until rank 0 has printed the summary: ``python -m mpi4py`` aborts the
    job as soon as one rank exits non-zero, which would cut rank 0's summary short."""
    harness = _harness(config)
    if harness is None:
        return
    from dtm_mpi.comm.agreement import wait_bounded

    request = harness.comm.Ibarrier()
    wait_bounded(request, timeout_s=60.0, op="barrier", phase="session end", rank=harness.rank)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``--with-mpi``, a test file that marks no test ``mpi`` is not imported at all:
    ``-m mpi`` would deselect every test in it, and each rank importing the whole suite (about
    5 s of CPU a rank) only to deselect it costs the MPI suite more than its tests."""
    name = collection_path.name
    if _with_mpi(config) and name.startswith("test_") and name.endswith(".py"):
        return b"mark.mpi" not in collection_path.read_bytes()
    return None


def _start_order(item: pytest.Item) -> int:
    if item.get_closest_marker("xdist_group") is not None:
        return 0  # a module that runs on one worker, one test after another: the longest chains
    return 1 if item.get_closest_marker("slow") is not None else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest work first, else in collection order (the sort is stable): the grouped
    modules, then the other ``slow`` tests, then the rest. Under pytest-xdist the workers start
    on the long jobs and the short tests fill in at the end, instead of one long test running
    alone while the other workers have nothing left."""
    items.sort(key=_start_order)


#: Test time by test file (setup, call and teardown), and the tests seen in it: the suite's
#: growth, printed after each run (under pytest-xdist the controller receives every report).
_FILE_SECONDS: dict[str, float] = {}
_FILE_TESTS: dict[str, set[str]] = {}
_COSTLIEST_FILES = 25


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    _FILE_TESTS.setdefault(path, set()).add(report.nodeid)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    rows = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:_COSTLIEST_FILES]
    terminalreporter.write_sep(
        "=", f"test time by file, the {len(rows)} costliest (setup, call, teardown)"
    )
    for path, seconds in rows:
        terminalreporter.write_line(f"{seconds:8.1f} s {len(_FILE_TESTS[path]):6d} tests  {path}")
    tests = sum(len(v) for v in _FILE_TESTS.values())
    terminalreporter.write_line(f"{total:8.1f} s {tests:6d} tests  in {len(_FILE_SECONDS)} files")


def _harness(config: pytest.Config) -> _MpiHarness | None:
    return config.stash.get(_HARNESS_KEY, None)


def _short(report: pytest.TestReport) -> str:
    text = report.longreprtext.strip()
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-3:]
    return " | ".join(ln[2:].strip() if ln.startswith("E ") else ln.strip() for ln in lines)[:500]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    harness = _harness(item.config)
    if harness is None:
        return
    report: pytest.TestReport = outcome.get_result()
    from dtm_mpi.comm.agreement import agree_outcome
    from dtm_mpi.errors import CommTimeoutError

    ok = not report.failed
    try:
        failures = agree_outcome(
            harness.comm,
            ok=ok,
            message=_short(report) if not ok else "",
            phase=f"{report.when}",
            timeout_s=harness.ok_wait_s if ok else harness.fail_wait_s,
        )
    except CommTimeoutError as err:
        text = f"{item.nodeid} [{report.when}] FAILED on this rank:\n{report.longreprtext}"
        text += f"\n{err}\naborting the whole job (peers are stuck and cannot agree)"
        print(harness.prefix(text), file=sys.stderr, flush=True)
        harness.comm.Abort(1)
        return
    if not failures:
        return
    if not ok:
        print(
            harness.prefix(f"{item.nodeid} [{report.when}] FAILED:\n{report.longreprtext}"),
            file=sys.stderr,
            flush=True,
        )
    others = "; ".join(f"rank {f.rank}: {f.message}" for f in failures)
    ranks = ",".join(str(f.rank) for f in failures)
    summary = f"failed on rank(s) {ranks} of {harness.size}: {others}"
    if ok:
        report.outcome = "failed"
        report.longrepr = summary
    elif harness.rank == 0:
        report.longrepr = f"{report.longreprtext}\n\n{summary}"


@pytest.fixture
def comm(request: pytest.FixtureRequest) -> Any:
    """A private duplicate of MPI_COMM_WORLD for one test (MPI runs only)."""
    harness = _harness(request.config)
    if harness is None:
        pytest.skip("needs MPI: run under mpirun with --with-mpi")
    dup = harness.comm.Dup()
    yield dup
    dup.Free()


@pytest.fixture
def mpi_tmp_path(comm: Any) -> Iterator[Path]:
    """One temporary directory, the same path on every rank, removed after the test."""
    path = tempfile.mkdtemp(prefix="dtm-test-") if comm.Get_rank() == 0 else None
    path = comm.bcast(path, root=0)
    yield Path(path)
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def all_ranks(comm: Any) -> Any:
    """``all_ranks(cond, message)``: an assertion every rank passes or fails together.

    Use it where a test goes on to call collectives after the check: a plain ``assert`` failing
    on one rank would leave its peers waiting in the next collective.
    """
    from dtm_mpi.comm.agreement import agree_outcome

    def check(cond: object, message: str = "assertion failed") -> None:
        failures = agree_outcome(
            comm, ok=bool(cond), message=message, phase="assert", timeout_s=120.0
        )
        if failures:
            pytest.fail("; ".join(str(f) for f in failures), pytrace=False)

    return check


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every test of this session sees, whichever pytest-xdist worker runs it (the
    parent of the workers' temporary roots; pytest keeps and prunes it like the others):
    :func:`tests.shared_runs.shared_run` keeps its reference runs there."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
