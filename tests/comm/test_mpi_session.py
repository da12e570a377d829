"""How an expired wait of :class:`MpiSession` decides what it reports (no MPI: the session's
control channel is the real :class:`Control` over a fake communicator that delivers the peers'
notices it is given). Two threads of a rank watch the same channel (the main thread's wait and
the watchdog): a peer's notice that one of them took must still win over this rank's own view,
or the rank reports the culprit a second time, after the peers have printed the first report."""

from __future__ import annotations

from typing import Any

import pytest

from dtm_mpi.comm.control import Control, Liveness
from dtm_mpi.comm.mpi_session import MpiSession
from dtm_mpi.errors import CommTimeoutError, RemoteFailureError

PEER_REPORT = "in no communication (hung or still computing in phase 'checkpoint 1') while rank 1 waited 5 s in commit"


class _FakeMPI:
    ANY_SOURCE = -1
    BYTE = "byte"

    @staticmethod
    def Status() -> Any:
        return None


class _Ctrl:
    """Records what this rank sends; has nothing to receive."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, int, int]] = []

    def Isend(self, buf: Any, dest: int, tag: int) -> Any:  # a frame (io/WIRE.md)
        self.sent.append((bytes(buf[0]), dest, tag))
        return None

    def Iprobe(self, *args: Any) -> bool:
        return False


class _Control(Control):
    """Rank 0 hangs: every liveness round finds it idle."""

    def liveness(self, bound: float) -> Liveness:
        return Liveness((), ((0, "checkpoint 1"),))


def _session(rank: int) -> tuple[MpiSession, _Control, _Ctrl]:
    ctrl = _Ctrl()
    control = _Control(_FakeMPI, ctrl, rank, 4, lambda: "")
    control.phase = "checkpoint 1"
    session = object.__new__(MpiSession)
    session.control, session.rank, session.size = control, rank, 4  # type: ignore[misc]
    session.timeout_s, session.poisoned = 5.0, None
    session._phase, session._checking = "checkpoint 1", ""
    return session, control, ctrl


@pytest.mark.parametrize("taken", [False, True], ids=["none-known", "taken-by-another-thread"])
def test_an_expired_wait_reports_the_peer_s_report_if_one_is_known(taken: bool) -> None:
    session, control, ctrl = _session(2)
    if taken:  # the watchdog's poll merged rank 1's notice before the main thread looked
        control._merge(1, [(0, "checkpoint 1", PEER_REPORT)])
    err = session.fail(session.expired("commit", ()))
    assert isinstance(err, RemoteFailureError) and [f.rank for f in err.failures] == [0]
    if taken:
        assert PEER_REPORT in str(err) and ctrl.sent == []  # adopted, not reported again
    else:
        assert "while rank 2 waited 5 s in commit" in str(err)
        assert sorted(dest for _, dest, _ in ctrl.sent) == [0, 1, 3]  # told every peer


def test_a_wait_outside_the_session_adopts_a_known_report_after_naming_the_silent() -> None:
    session, control, ctrl = _session(3)
    control._merge(1, [(0, "checkpoint 1", PEER_REPORT)])
    err = session.fail(CommTimeoutError("store exchange timed out", op="allgather", rank=3))
    assert isinstance(err, RemoteFailureError) and PEER_REPORT in str(err)
    assert [payload for payload, _, _ in ctrl.sent if isinstance(payload, tuple)] == []
