"""Options read from environment variables, once, into a frozen value.

=====================  =========  ==========================================================
variable               default    meaning
=====================  =========  ==========================================================
``DTM_TIMEOUT``        ``300``    seconds any single wait may take before the session is
                                  poisoned and the job ends (bounded completion)
``DTM_FAULT``          unset      failure injection ``RANK:WHERE:KIND`` (KIND ``raise``,
                                  ``hang`` or ``exit``; WHERE an op or phase name); several
                                  separated by ``,``
``DTM_DETERMINISTIC``  ``0``      ``1``: reductions combine contributions in a fixed order
``DTM_MAX_MSG_ELEMS``  ``2**31-1`` largest element count of one MPI message; bigger ones are
                                  split into chunks (tests set it tiny)
``DTM_GPU_AWARE_MPI``  ``auto``   ``auto``, ``yes``/``1`` or ``no``/``0``: whether MPI takes device
                                  buffers (``auto``: the MPI vendor's query, then a probe)
``DTM_LOG``            ``warning`` log level of the ``dtm_mpi`` logger
``DTM_CKPT_VERIFY``    ``manifest`` what a checkpoint save verifies before it commits:
                                  ``manifest`` or ``full`` (re-read and re-hash every chunk)
``DTM_CKPT_RANKS_PER_FILE`` ``1`` ranks that share one data file of a checkpoint (``all``:
                                  one file for the job); 1 measured fastest on local disks
=====================  =========  ==========================================================

:func:`get_config` reads the process environment on first use and caches the result;
:func:`load_config` is the pure parser (a mapping in, a :class:`Config` out) used by tests.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from dtm_mpi.errors import ConfigError

__all__ = ["Config", "FaultKind", "FaultSpec", "GpuAwareMode", "get_config", "load_config"]

MAX_MSG_ELEMS_DEFAULT = 2**31 - 1


class FaultKind(enum.Enum):
    RAISE = "raise"
    HANG = "hang"
    EXIT = "exit"


class GpuAwareMode(enum.Enum):
    AUTO = "auto"
    YES = "yes"
    NO = "no"


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One injected failure: ``rank`` fails at ``where`` (an op or phase name) with ``kind``."""

    rank: int
    where: str
    kind: FaultKind

    def __str__(self) -> str:
        return f"{self.rank}:{self.where}:{self.kind.value}"


@dataclass(frozen=True, slots=True)
class Config:
    timeout_s: float = 300.0
    faults: tuple[FaultSpec, ...] = ()
    deterministic: bool = False
    max_msg_elems: int = MAX_MSG_ELEMS_DEFAULT
    gpu_aware_mpi: GpuAwareMode = GpuAwareMode.AUTO
    log_level: str = "warning"
    ckpt_verify_full: bool = False
    ckpt_ranks_per_file: int = 1  # 0: all ranks share one data file

    def fault_at(self, rank: int, where: str) -> FaultSpec | None:
        """The fault injected for ``rank`` at ``where``, if any."""
        for fault in self.faults:
            if fault.rank == rank and fault.where == where:
                return fault
        return None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: expected one of 0/1/true/false/yes/no/on/off, got {raw!r}")


def _parse_positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected a number of seconds, got {raw!r}") from None
    if not (0 < value < float("inf")):  # also rejects nan
        raise ConfigError(f"{name}: must be a finite number > 0, got {raw!r}")
    return value


def _parse_positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw, 0)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if value < 1:
        raise ConfigError(f"{name}: must be >= 1, got {raw!r}")
    return value


def parse_fault_specs(name: str, raw: str) -> tuple[FaultSpec, ...]:
    """Parse ``RANK:WHERE:KIND[,RANK:WHERE:KIND...]``; raises :class:`ConfigError`."""
    specs: list[FaultSpec] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        fields = item.split(":")
        if len(fields) != 3:
            raise ConfigError(f"{name}: expected RANK:WHERE:KIND, got {item!r}")
        rank_s, where, kind_s = fields
        try:
            rank = int(rank_s)
        except ValueError:
            raise ConfigError(
                f"{name}: RANK must be an integer, got {rank_s!r} in {item!r}"
            ) from None
        if rank < 0:
            raise ConfigError(f"{name}: RANK must be >= 0, got {rank} in {item!r}")
        if not where:
            raise ConfigError(f"{name}: WHERE is empty in {item!r}")
        try:
            kind = FaultKind(kind_s)
        except ValueError:
            kinds = ", ".join(k.value for k in FaultKind)
            raise ConfigError(f"{name}: KIND must be one of {kinds}, got {kind_s!r}") from None
        specs.append(FaultSpec(rank, where, kind))
    return tuple(specs)


def load_config(environ: Mapping[str, str]) -> Config:
    """Build a :class:`Config` from an environment mapping; raises :class:`ConfigError`."""
    defaults = Config()
    timeout_s = defaults.timeout_s
    if (raw := environ.get("DTM_TIMEOUT")) is not None:
        timeout_s = _parse_positive_float("DTM_TIMEOUT", raw)
    faults: tuple[FaultSpec, ...] = ()
    if (raw := environ.get("DTM_FAULT")) is not None:
        faults = parse_fault_specs("DTM_FAULT", raw)
    deterministic = defaults.deterministic
    if (raw := environ.get("DTM_DETERMINISTIC")) is not None:
        deterministic = _parse_bool("DTM_DETERMINISTIC", raw)
    max_msg_elems = defaults.max_msg_elems
    if (raw := environ.get("DTM_MAX_MSG_ELEMS")) is not None:
        max_msg_elems = _parse_positive_int("DTM_MAX_MSG_ELEMS", raw)
    gpu_aware = defaults.gpu_aware_mpi
    if (raw := environ.get("DTM_GPU_AWARE_MPI")) is not None:
        try:
            word = raw.strip().lower()
            word = {"1": "yes", "true": "yes", "on": "yes", "0": "no", "false": "no", "off": "no"}.get(word, word)  # fmt: skip
            gpu_aware = GpuAwareMode(word)
        except ValueError:
            raise ConfigError(
                f"DTM_GPU_AWARE_MPI: expected auto, yes (1) or no (0), got {raw!r}"
            ) from None
    log_level = defaults.log_level
    if (raw := environ.get("DTM_LOG")) is not None:
        log_level = raw.strip().lower()
        if log_level not in _LOG_LEVELS:
            raise ConfigError(f"DTM_LOG: expected one of {', '.join(_LOG_LEVELS)}, got {raw!r}")
    verify_full = defaults.ckpt_verify_full
    if (raw := environ.get("DTM_CKPT_VERIFY")) is not None:
        mode = raw.strip().lower()
        if mode not in ("manifest", "full"):
            raise ConfigError(f"DTM_CKPT_VERIFY: expected manifest or full, got {raw!r}")
        verify_full = mode == "full"
    per_file = defaults.ckpt_ranks_per_file
    if (raw := environ.get("DTM_CKPT_RANKS_PER_FILE")) is not None:
        word = raw.strip().lower()
        if word == "all":
            per_file = 0
        elif word.isascii() and word.isdigit() and int(word) >= 1:
            per_file = int(word)
        else:
            raise ConfigError(f"DTM_CKPT_RANKS_PER_FILE: expected an integer >= 1 or all, got {raw!r}")  # fmt: skip
    return Config(
        timeout_s, faults, deterministic, max_msg_elems, gpu_aware, log_level, verify_full,
        per_file,
    )  # fmt: skip


@cache
def get_config() -> Config:
    """The process-wide configuration, read from ``os.environ`` on first call."""
    return load_config(os.environ)
