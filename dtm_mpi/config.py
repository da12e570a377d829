"""Options read from environment variables, once, into a frozen value.

Every ``DTM_*`` variable the package reads is read here and nowhere else (a test scans the
package for other reads): :data:`ENV_VARS` lists each one with the :class:`Config` field it
sets, its parser and its default as ``README.md``'s "Configuration" table writes it (a test
checks that table against :data:`ENV_VARS`, row for row, default for default). Yes/no
variables share one parser: ``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off``
(any case), empty for the default; anything else is a :class:`ConfigError` naming the
variable and the accepted words.

:func:`get_config` reads the process environment on first use and caches the result;
:func:`load_config` is the pure parser (a mapping in, a :class:`Config` out) used by tests.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from dtm_mpi.errors import ConfigError, UsageError

__all__ = [
    "ENV_VARS",
    "Config",
    "EnvVar",
    "FaultKind",
    "FaultSpec",
    "GpuAwareMode",
    "get_config",
    "launcher_node_ranks",
    "load_config",
    "set_setting",
    "switch_on",
]

MAX_MSG_ELEMS_DEFAULT = 2**31 - 1


class FaultKind(enum.Enum):
    RAISE = "raise"
    HANG = "hang"
    EXIT = "exit"
    CORRUPT = "corrupt"  # one bit of the rank's outgoing message flipped in flight
    FLIP = "flip"  # one bit of a state tensor flipped in the rank's memory (WHERE: state)


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
    deterministic_matmul: str = "full"  # what its matmul keeps: full or fast (kernels.exact)
    gemm: str = "auto"  # the CPU path's GEMM: auto (measured), numpy, mkl or blis (kernels.gemm)
    integrity: bool = False  # every point-to-point payload carries its CRC32C, checked on receipt
    audit_every: int = 0  # compare the replicas' state checksums after every N-th step (0: never)
    quant_allreduce: int = 0  # large float sum allreduces as int8 blocks of this size (0: exact)
    explain: bool = False  # fit() prints its plan and exits (dtm explain SCRIPT.py)
    max_msg_elems: int = MAX_MSG_ELEMS_DEFAULT
    gpu_aware_mpi: GpuAwareMode = GpuAwareMode.AUTO
    log_level: str = "warning"
    ckpt_verify_full: bool = False
    ckpt_ranks_per_file: int = 1  # 0: all ranks share one data file
    ckpt_hash_thread: bool | None = None  # None: where the rank has a spare core
    fuse: bool = True  # GPU backends run planned elementwise chains as one kernel
    kernel_dir: str | None = None  # where the .cu sources are (None: look in the usual places)
    mallopt: bool = True  # under MPI, keep collective-sized freed blocks in the heap
    overlap: bool = False  # allreduce buckets and prefetched gathers on a side thread
    bucket_bytes: int = 25 * 2**20  # the largest bucket of overlapped allreduces

    def fault_at(self, rank: int, where: str) -> FaultSpec | None:
        """The fault injected for ``rank`` at ``where``, if any."""
        for fault in self.faults:
            if fault.rank == rank and fault.where == where:
                return fault
        return None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _bool_word(raw: str) -> bool | None:
    """True/False for a yes/no word (any case, blanks ignored), None for any other text."""
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    return None


def _parse_bool(name: str, raw: str, default: bool) -> bool:
    """The one parser of yes/no variables: a word of ``_TRUE`` or ``_FALSE``, or empty (the
    default); anything else is an error naming the variable and the accepted words."""
    if not raw.strip():
        return default
    value = _bool_word(raw)
    if value is None:
        raise ConfigError(
            f"{name}: expected one of {'/'.join(_TRUE)} (on) or {'/'.join(_FALSE)} (off), "
            f"got {raw!r}"
        )
    return value


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


def _parse_count(name: str, raw: str) -> int:
    try:
        value = int(raw.strip() or "0", 0)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{name}: must be >= 0, got {raw!r}")
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
        if (kind is FaultKind.FLIP) != (where == "state"):
            raise ConfigError(
                f"{name}: {item!r}: KIND flip goes with WHERE state (RANK:state:flip: a bit of a state tensor flipped in memory)"
            )
        specs.append(FaultSpec(rank, where, kind))
    return tuple(specs)


def _gpu_aware(name: str, raw: str) -> GpuAwareMode:
    if raw.strip().lower() == "auto":
        return GpuAwareMode.AUTO
    value = _bool_word(raw)
    if value is None:
        raise ConfigError(f"{name}: expected auto, yes (1) or no (0), got {raw!r}")
    return GpuAwareMode.YES if value else GpuAwareMode.NO


def _log_level(name: str, raw: str) -> str:
    level = raw.strip().lower()
    if level not in _LOG_LEVELS:
        raise ConfigError(f"{name}: expected one of {', '.join(_LOG_LEVELS)}, got {raw!r}")
    return level


def _one_of(words: Callable[[], Sequence[str]]) -> Callable[[str, str], str]:
    """The parser of a variable taking one of ``words()`` (any case; empty: the first),
    read when a value is parsed (the words' home may import what config must not)."""

    def parse(name: str, raw: str) -> str:
        known = list(words())
        mode = raw.strip().lower() or known[0]
        if mode not in known:
            listed = ", ".join(known[:-1]) + f" or {known[-1]}"
            raise ConfigError(f"{name}: expected {listed}, got {raw!r}")
        return mode

    return parse


def _precisions() -> list[str]:
    from dtm_mpi.kernels.exact import Precision

    return [p.value for p in Precision]


def _gemm_settings() -> list[str]:
    from dtm_mpi.kernels.gemm import Provider

    return ["auto", *(p.value for p in Provider)]


def _ckpt_verify_full(name: str, raw: str) -> bool:
    mode = raw.strip().lower()
    if mode not in ("manifest", "full"):
        raise ConfigError(f"{name}: expected manifest or full, got {raw!r}")
    return mode == "full"


def _auto_yes_no(name: str, raw: str) -> bool | None:
    """``auto`` (or empty): None, the caller decides; else a yes/no word."""
    if raw.strip().lower() in ("", "auto"):
        return None
    if (value := _bool_word(raw)) is None:
        raise ConfigError(
            f"{name}: expected auto, {'/'.join(_TRUE)} or {'/'.join(_FALSE)}, got {raw!r}"
        )
    return value


def _ranks_per_file(name: str, raw: str) -> int:
    from dtm_mpi.units import parse_ranks_per_file

    try:
        return parse_ranks_per_file(raw)
    except UsageError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _directory(name: str, raw: str) -> str | None:
    return raw.strip() or None  # empty: as if unset


def _yes_no(default: bool) -> Callable[[str, str], bool]:
    def parse(name: str, raw: str) -> bool:
        return _parse_bool(name, raw, default)

    return parse


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One ``DTM_*`` variable: the :class:`Config` field it sets, its parser (variable name
    and raw text in, field value out; raises :class:`ConfigError`) and its default as the
    README's table writes it (``—``: unset)."""

    name: str
    field: str
    parse: Callable[[str, str], object]
    default: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("DTM_TIMEOUT", "timeout_s", _parse_positive_float, "300"),
    EnvVar("DTM_FAULT", "faults", parse_fault_specs, "—"),
    EnvVar("DTM_DETERMINISTIC", "deterministic", _yes_no(False), "0"),
    EnvVar("DTM_DETERMINISTIC_MATMUL", "deterministic_matmul", _one_of(_precisions), "full"),
    EnvVar("DTM_INTEGRITY", "integrity", _yes_no(False), "0"),
    EnvVar("DTM_AUDIT_EVERY", "audit_every", _parse_count, "0"),
    EnvVar("DTM_QUANT_ALLREDUCE", "quant_allreduce", _parse_count, "0"),
    EnvVar("DTM_MAX_MSG_ELEMS", "max_msg_elems", _parse_positive_int, str(MAX_MSG_ELEMS_DEFAULT)),
    EnvVar("DTM_GPU_AWARE_MPI", "gpu_aware_mpi", _gpu_aware, "auto"),
    EnvVar("DTM_FUSE", "fuse", _yes_no(True), "1"),
    EnvVar("DTM_GEMM", "gemm", _one_of(_gemm_settings), "auto"),
    EnvVar("DTM_KERNEL_DIR", "kernel_dir", _directory, "—"),
    EnvVar("DTM_LOG", "log_level", _log_level, "warning"),
    EnvVar("DTM_CKPT_RANKS_PER_FILE", "ckpt_ranks_per_file", _ranks_per_file, "1"),
    EnvVar("DTM_CKPT_VERIFY", "ckpt_verify_full", _ckpt_verify_full, "manifest"),
    EnvVar("DTM_CKPT_HASH_THREAD", "ckpt_hash_thread", _auto_yes_no, "auto"),
    EnvVar("DTM_MALLOPT", "mallopt", _yes_no(True), "1"),
    EnvVar("DTM_OVERLAP", "overlap", _yes_no(False), "0"),
    EnvVar("DTM_BUCKET_BYTES", "bucket_bytes", _parse_positive_int, str(25 * 2**20)),
    EnvVar("DTM_EXPLAIN", "explain", _yes_no(False), "0"),
)
"""Every environment variable the package reads, in the README table's order."""


def load_config(environ: Mapping[str, str]) -> Config:
    """Build a :class:`Config` from an environment mapping; raises :class:`ConfigError`."""
    values: dict[str, Any] = {}
    for var in ENV_VARS:
        raw = environ.get(var.name)
        if raw is not None:
            values[var.field] = var.parse(var.name, raw)
    return Config(**values)


@cache
def get_config() -> Config:
    """The process-wide configuration, read from ``os.environ`` on first call (a test that
    changes the environment calls ``get_config.cache_clear()``)."""
    return load_config(os.environ)


def set_setting(field: str, value: int) -> None:
    """Set the numeric setting ``field`` (a :class:`Config` field) for this process and the
    processes it starts, as :func:`switch_on` does (``dtm run --audit-every N``)."""
    var = next(v for v in ENV_VARS if v.field == field)
    os.environ[var.name] = str(value)
    get_config.cache_clear()


def switch_on(field: str) -> None:
    """Turn on the yes/no setting ``field`` (a :class:`Config` field) for this process and
    the processes it starts: its variable set to ``1`` in ``os.environ``, the configuration
    read again (``dtm explain SCRIPT.py`` so switches on ``explain``)."""
    set_setting(field, 1)


LAUNCHER_NODE_RANKS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
"""Where Open MPI, MPICH/Hydra and Slurm tell a process how many ranks share its node."""


def allowed_cpus() -> int:
    """How many CPUs this process may run on (its affinity; the node's CPUs where the
    platform has none)."""
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def spare_cpu() -> bool:
    """Whether this rank may run on at least twice as many CPUs as its share of the node
    (its affinity, and the CPUs divided among the ranks its launcher put on the node): a
    second thread of the rank then has a core of its own."""
    cpus = allowed_cpus()
    share = (os.cpu_count() or 1) // (launcher_node_ranks() or 1)
    return min(cpus, share) >= 2


BLAS_THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
"""Where a user sets how many threads the BLAS library uses (then dtm leaves it alone)."""


def blas_threads_share(
    local_size: int, environ: Mapping[str, str] | None = None, cpus: int | None = None
) -> int | None:
    """The BLAS threads a rank that shares its node with ``local_size - 1`` others should use:
    its share of the CPUs it may run on (its affinity, divided among the node's ranks where
    the affinity is the whole node), at least 1. None where a BLAS thread count is set in the
    environment (:data:`BLAS_THREAD_VARIABLES`) or the rank is alone on its node: the library
    then decides. Otherwise each rank's BLAS starts a thread per CPU of the node, and the
    ranks' threads outnumber the cores (OpenBLAS's spin-waiting threads took twice the time of
    a 3-rank run on 2 cores)."""
    env = os.environ if environ is None else environ
    if local_size <= 1 or any(env.get(v, "").strip() for v in BLAS_THREAD_VARIABLES):
        return None
    node = os.cpu_count() or 1
    if cpus is None:
        cpus = allowed_cpus()
    if cpus >= node:  # not bound: the node's CPUs are shared by its ranks
        cpus = node // local_size
    return max(1, cpus)


def launcher_node_ranks(environ: Mapping[str, str] | None = None) -> int | None:
    """How many ranks the launcher put on this node (the first of :data:`LAUNCHER_NODE_RANKS`
    that holds a positive integer; Slurm's ``2(x3)`` form counts its first number), or None."""
    env = os.environ if environ is None else environ
    for name in LAUNCHER_NODE_RANKS:
        head = env.get(name, "").split("(")[0].split(",")[0].strip()
        if head.isdigit() and int(head) > 0:
            return int(head)
    return None
