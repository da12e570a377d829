"""Failure injection for tests: ``DTM_FAULT=RANK:WHERE:KIND`` makes rank RANK fail at WHERE
(an op name such as ``allreduce``, or a phase: ``arguments``, ``load``, ``backend``,
``handshake``, ``plan``, ``inputs``, ``step``, ``output``, or a checkpoint point:
``ckpt_write`` before each tensor a save writes, ``ckpt_commit`` on rank 0 just before the
rename) with KIND ``raise`` (an error),
``hang`` (sleeps until killed) or ``exit`` (``os._exit(3)``: the process dies without a word, as in a crash),
or ``corrupt``: one bit of what the rank sends there flipped in flight, at a position seeded by
the rank and the place (``handshake``: its HELLO frame; ``send``: every point-to-point
payload, after its integrity checksum is computed); ``state`` with KIND ``flip``: one bit of
one of the rank's state tensors flipped in memory after the first step the rank runs (the
tensor and the bit seeded by the rank), what the replica audit is for."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtm_mpi.config import FaultKind, get_config
from dtm_mpi.errors import DtmError
from dtm_mpi.log import log_info

__all__ = ["InjectedFaultError", "corrupt_in_place", "corrupted", "flip_state", "maybe_fail"]


class InjectedFaultError(DtmError, RuntimeError):
    """The failure ``DTM_FAULT`` asked for."""


def maybe_fail(rank: int, where: str) -> None:
    """Fail here if ``DTM_FAULT`` names this rank and ``where``."""
    fault = get_config().fault_at(rank, where)
    if fault is None or fault.kind in (FaultKind.CORRUPT, FaultKind.FLIP):
        return
    log_info(rank, f"DTM_FAULT={fault}: injecting {fault.kind.value} at {where}")
    if fault.kind is FaultKind.RAISE:
        raise InjectedFaultError(f"injected failure (DTM_FAULT={fault}) on rank {rank} at {where}")
    if fault.kind is FaultKind.HANG:
        while True:  # until the job is aborted
            time.sleep(3600)
    os._exit(3)


def _flip_at(rank: int, where: str, nbytes: int) -> tuple[int, int] | None:
    """With ``DTM_FAULT=RANK:WHERE:corrupt`` for this rank and place: the (byte, bit) to flip
    among ``nbytes``, seeded by the rank and the place (the same run flips the same bit)."""
    fault = get_config().fault_at(rank, where)
    if fault is None or fault.kind is not FaultKind.CORRUPT or nbytes == 0:
        return None
    rng = random.Random(f"{rank}:{where}")
    at, bit = rng.randrange(nbytes), rng.randrange(8)
    log_info(rank, f"DTM_FAULT={fault}: flipping bit {bit} of byte {at} of {nbytes} at {where}")
    return at, bit


def corrupt_in_place(rank: int, where: str, buf: np.ndarray) -> bool:
    """With ``DTM_FAULT=RANK:WHERE:corrupt``: flip one bit of ``buf`` (a contiguous array this
    rank is about to send at ``where``, its own copy); True if it did."""
    hit = _flip_at(rank, where, buf.nbytes)
    if hit is not None:
        buf.reshape(-1).view(np.uint8)[hit[0]] ^= np.uint8(1 << hit[1])
    return hit is not None


def corrupted(rank: int, where: str, data: np.ndarray) -> np.ndarray:
    """``data`` as this rank sends or receives it at ``where``: with
    ``DTM_FAULT=RANK:WHERE:corrupt`` a copy with one bit flipped, else ``data`` itself."""
    if get_config().fault_at(rank, where) is None:
        return data
    out = np.array(data, order="C")
    corrupt_in_place(rank, where, out)
    return out


def flip_state(rank: int, blocks: list[Any], state: Sequence[tuple[int, str]]) -> str | None:
    """With ``DTM_FAULT=RANK:state:flip`` for this rank: flip one bit of one of its blocks of
    the state tensors ``state`` ((position in ``blocks``, name) pairs; host arrays), chosen
    by a generator seeded by the rank, in a copy put in its place; returns what it flipped."""
    fault = get_config().fault_at(rank, "state")
    if fault is None or fault.kind is not FaultKind.FLIP:
        return None
    held = [(i, name) for i, name in state if blocks[i] is not None and blocks[i].nbytes > 0]
    if not held:
        return None
    if not all(isinstance(blocks[i], np.ndarray) for i, _ in held):
        raise InjectedFaultError(
            f"DTM_FAULT={fault}: flipping a state bit needs host (numpy) blocks; rank {rank} holds device arrays"
        )
    rng = random.Random(f"{rank}:state")
    i, name = held[rng.randrange(len(held))]
    block = np.array(blocks[i], order="C")
    at, bit = rng.randrange(block.nbytes), rng.randrange(8)
    block.reshape(-1).view(np.uint8)[at] ^= np.uint8(1 << bit)
    blocks[i] = block
    what = f"bit {bit} of byte {at} of rank {rank}'s block of {name}"
    log_info(rank, f"DTM_FAULT={fault}: flipped {what}")
    return what
