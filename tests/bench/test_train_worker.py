"""The benchmark worker's timed communicator (:class:`~dtm_mpi.bench.train_worker.TimedComm`):
its started collectives are timed and let go of their results as soon as nobody holds them."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np

from dtm_mpi.bench.train_worker import TimedComm
from dtm_mpi.comm.interface import Completed


class _Inner:
    def __getattr__(self, name: str) -> Any:  # the blocking calls: not used here
        return lambda *args: None

    def start_allreduce(self, x: np.ndarray, *rest: Any) -> Completed:
        return Completed(x * 2)

    def start_allgather(self, x: np.ndarray, *rest: Any) -> Completed:
        return Completed(np.concatenate([x, x]))


def test_a_started_collectives_result_is_freed_without_the_cyclic_collector() -> None:
    """(A handle class defined per call lived in a reference cycle and kept every overlapped
    result until the cyclic collector ran: hundreds of MiB in a training run.)"""
    comm = TimedComm(_Inner())
    gc.disable()
    try:
        for start, want in ((comm.start_allreduce, [2.0, 2.0]), (comm.start_allgather, [1.0] * 4)):
            handle = start(np.ones(2))
            out = handle.wait()
            assert handle.test() and out.tolist() == want
            gone = weakref.finalize(out, lambda: None)
            del handle, out
            assert not gone.alive
        assert comm.seconds >= 0
    finally:
        gc.enable()
