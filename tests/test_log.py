"""``DTM_LOG``: the ``dtm_mpi`` logger's level; ``info`` shows each rank's phases (once per
change, though a rank's session and presence both enter each phase) and the faults
``DTM_FAULT`` injects, ``debug`` the agreements a rank waits in; the default shows nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dtm_mpi import log
from dtm_mpi.comm.control import Control
from dtm_mpi.config import get_config
from dtm_mpi.errors import DtmError
from dtm_mpi.faults import maybe_fail


class _FakeMPI:
    @staticmethod
    def Status() -> Any:
        return None


@pytest.fixture
def dtm_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def level(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("DTM_LOG", raising=False)
        else:
            monkeypatch.setenv("DTM_LOG", value)
        get_config.cache_clear()
        log.reset()

    yield level
    monkeypatch.undo()
    get_config.cache_clear()
    log.reset()
    log.logger()  # back to the environment's level, without a handler of its own


def test_info_shows_each_phase_once_per_change(
    dtm_log: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    dtm_log("info")
    session, presence = (Control(_FakeMPI, None, 3, 4, lambda: "") for _ in range(2))
    for phase in ("load", "plan", "step 0"):
        session.phase = phase
        presence.phase = phase  # the same phase, entered again by the rank's presence
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "[rank 3] dtm: phase load",
        "[rank 3] dtm: phase plan",
        "[rank 3] dtm: phase step 0",
    ]


def test_info_shows_an_injected_fault_before_it_acts(
    dtm_log: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DTM_FAULT", "2:load:raise")
    dtm_log("info")
    maybe_fail(1, "load")  # another rank: nothing
    with pytest.raises(DtmError, match="injected failure"):
        maybe_fail(2, "load")
    assert (
        capsys.readouterr().err == "[rank 2] dtm: DTM_FAULT=2:load:raise: injecting raise at load\n"
    )


@pytest.mark.parametrize(
    ("level", "shown"),
    [(None, []), ("warning", []), ("info", ["info"]), ("debug", ["info", "debug"])],
)
def test_the_level_decides_what_is_shown(
    level: str | None, shown: list[str], dtm_log: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    dtm_log(level)
    log.log_info(0, "info")
    log.log_debug(0, "debug")
    assert capsys.readouterr().err.splitlines() == [f"[rank 0] dtm: {s}" for s in shown]
    # at the default level the application's logging decides (no handler of dtm's own)
    assert log.logger().propagate is (level in (None, "warning"))
