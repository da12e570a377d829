"""The control channel's bookkeeping of failures (pure parts, no MPI): whatever order the
reports of the same failures arrive in, every rank keeps the same list and messages."""

from __future__ import annotations

import itertools
from typing import Any

from dtm_mpi.comm.control import Control


class _FakeMPI:
    @staticmethod
    def Status() -> Any:
        return None


def _control(rank: int) -> Control:
    return Control(_FakeMPI, None, rank, 4, lambda: "")


REPORTS = [
    (1, [(1, "step 0", "injected failure on rank 1")]),  # rank 1's own report
    (0, [(2, "step 0", "in no communication while rank 0 waited")]),
    (3, [(2, "step 0", "in no communication while rank 3 waited"), (1, "step 0", "seen by 3")]),
]


def test_the_same_reports_in_any_order_give_the_same_error() -> None:
    texts = set()
    for order in itertools.permutations(REPORTS):
        c = _control(0)
        for reporter, failures in order:
            c._merge(reporter, failures)
        err = c.error()
        assert err is not None
        texts.add(str(err))
    assert len(texts) == 1
    (text,) = texts
    assert text.startswith("step 0 failed on rank(s) 1, 2: ")
    assert "injected failure on rank 1" in text  # a rank's own report wins
    assert "while rank 0 waited" in text and "rank 3 waited" not in text  # then the lowest


def test_no_failure_is_no_error_and_phases_are_counted() -> None:
    c = _control(2)
    assert c.error() is None
    start = c.seq
    c.phase = "load"
    c.phase = "plan"
    assert (c.phase, c.seq - start) == ("plan", 2)


class _Status:
    source = -1
    tag = -1
    count = 0

    def Get_source(self) -> int:
        return self.source

    def Get_tag(self) -> int:
        return self.tag

    def Get_count(self, datatype: object) -> int:
        return self.count


class _StatusMPI:
    ANY_SOURCE = -1
    BYTE = "byte"

    @staticmethod
    def Status() -> Any:
        return _Status()


class _Ends:
    """A control communicator on which the given peers have announced their end (END
    frames, io/WIRE.md; ``damage``: flip a bit of each)."""

    def __init__(self, ends: dict[int, str], damage: bool = False) -> None:
        from dtm_mpi.comm.frames import MessageType, encode_frame

        self.frames = {}
        for r, error in ends.items():
            frame = bytearray(encode_frame(MessageType.END, {"error": error}))
            if damage:
                frame[14] ^= 1
            self.frames[r] = bytes(frame)

    def Iprobe(self, source: int, tag: int, status: _Status) -> bool:
        from dtm_mpi.comm.control import TAG_END

        if tag == TAG_END and self.frames:
            status.source, status.tag = min(self.frames), tag
            status.count = len(self.frames[status.source])
            return True
        return False

    def Recv(self, buf: list[Any], source: int, tag: int) -> None:
        data = self.frames.pop(source)
        buf[0][:] = data


def test_a_rank_that_printed_its_last_line_stops_lingering_once_every_peer_has_too() -> None:
    """Lingering answers the peers that still ask who is alive; once every peer announced its
    end none will ask, and the job can end now (not seconds later)."""
    everyone = Control(_StatusMPI, _Ends({1: "e", 2: "e", 3: "e"}), 0, 4, lambda: "")
    everyone.linger(3600.0)  # returns at once
    assert everyone.all_ended() and everyone.ended() == "e"
    one_missing = Control(_StatusMPI, _Ends({1: "e", 3: "e"}), 0, 4, lambda: "")
    one_missing.linger(0.05)  # the whole time: rank 2 may still ask
    assert not one_missing.all_ended()


def test_a_damaged_end_frame_is_named_not_read() -> None:
    c = Control(_StatusMPI, _Ends({1: "e", 2: "e", 3: "e"}, damage=True), 0, 4, lambda: "")
    assert c.ended() == "rank 1 ended the job (its last line arrived corrupt: wrong crc)"
