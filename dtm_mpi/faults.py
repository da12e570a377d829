"""Failure injection for tests: ``DTM_FAULT=RANK:WHERE:KIND`` makes rank RANK fail at WHERE
(an op name such as ``allreduce``, or a phase: ``arguments``, ``load``, ``backend``,
``handshake``, ``plan``, ``inputs``, ``step``, ``output``, or a checkpoint point:
``ckpt_write`` before each tensor a save writes, ``ckpt_commit`` on rank 0 just before the
rename) with KIND ``raise`` (an error),
``hang`` (sleeps until killed) or ``exit`` (``os._exit(3)``: the process dies without a word, as in a crash),
or ``corrupt``: one bit of what the rank sends there flipped in flight, at a position seeded by
the rank and the place (where a place sends a frame: ``handshake``, its HELLO frame)."""

from __future__ import annotations

import os
import random
import time

from dtm_mpi.config import FaultKind, get_config
from dtm_mpi.errors import DtmError
from dtm_mpi.log import log_info

__all__ = ["InjectedFaultError", "corrupted", "maybe_fail"]


class InjectedFaultError(DtmError, RuntimeError):
    """The failure ``DTM_FAULT`` asked for."""


def maybe_fail(rank: int, where: str) -> None:
    """Fail here if ``DTM_FAULT`` names this rank and ``where``."""
    fault = get_config().fault_at(rank, where)
    if fault is None or fault.kind is FaultKind.CORRUPT:
        return
    log_info(rank, f"DTM_FAULT={fault}: injecting {fault.kind.value} at {where}")
    if fault.kind is FaultKind.RAISE:
        raise InjectedFaultError(f"injected failure (DTM_FAULT={fault}) on rank {rank} at {where}")
    if fault.kind is FaultKind.HANG:
        while True:  # until the job is aborted
            time.sleep(3600)
    os._exit(3)


def corrupted(rank: int, where: str, data: bytes) -> bytes:
    """``data`` as this rank sends it at ``where``: with ``DTM_FAULT=RANK:WHERE:corrupt``, one
    bit flipped at a position seeded by the rank and the place (the same run flips the same
    bit), else unchanged."""
    fault = get_config().fault_at(rank, where)
    if fault is None or fault.kind is not FaultKind.CORRUPT or not data:
        return data
    rng = random.Random(f"{rank}:{where}")
    at, bit = rng.randrange(len(data)), rng.randrange(8)
    log_info(rank, f"DTM_FAULT={fault}: flipping bit {bit} of byte {at} of {len(data)} at {where}")
    out = bytearray(data)
    out[at] ^= 1 << bit
    return bytes(out)
