"""The one exception hierarchy of dtm_mpi.

Every error the project raises on purpose derives from :class:`DtmError`. Messages say what
went wrong, where (file:line:col for IR; tensor, shard and file for storage; rank and phase for
distributed failures), the rule, and what was found. Builtin bases are mixed in where they fit
so callers may catch ``ValueError`` / ``RuntimeError`` / ``OSError`` as usual.

Exit codes used by the CLI: a :class:`UsageError` (bad command line, unreadable file) exits 2;
every other :class:`DtmError` exits 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "BackendError",
    "CancelledError",
    "CommError",
    "CommTimeoutError",
    "LauncherTerminatedError",
    "ConfigError",
    "DiagnosticError",
    "DtmError",
    "GpuAwareMpiError",
    "HandshakeError",
    "ProtocolError",
    "IntegrityError",
    "InvalidModuleError",
    "KernelError",
    "LayoutError",
    "LifecycleError",
    "ManifestError",
    "ParseError",
    "PayloadIntegrityError",
    "ReplicaDivergenceError",
    "PlanError",
    "PoisonedError",
    "QuotaError",
    "RankFailure",
    "RemoteFailureError",
    "RunStopped",
    "EXIT_REQUEUE",
    "SourceSpan",
    "StorageError",
    "TaskGraphError",
    "TaskPlacementError",
    "UnrecoverableError",
    "UsageError",
    "VerifyError",
    "VersionError",
    "agreed",
    "agreed_usage",
]


class DtmError(Exception):
    """Root of every error dtm_mpi raises on purpose.

    ``agreed`` is true when the error is known to be raised identically on every rank (it was
    decided from data all ranks share, or agreed through communication); a launcher may then
    exit cleanly on every rank instead of aborting the whole MPI job.
    """

    agreed: bool = False


class PropagationWarning(UserWarning):
    """Sharding propagation gave up on a split value at the user's line: the op ran on
    replicated values (every rank gathered the whole value)."""


class UsageError(DtmError, ValueError):
    """Bad command line, missing or unreadable input file (CLI exit code 2)."""


class ConfigError(DtmError, ValueError):
    """A configuration value (environment variable or option) is malformed."""


# --- IR diagnostics ---------------------------------------------------------------------------


class SourceSpan(NamedTuple):
    """A location in a source text: 1-based line and column, ``length`` characters long.

    (An immutable named tuple rather than a dataclass: the parser makes one per token, and
    tuple construction keeps a 100,000-op module fast to parse.)
    """

    file: str
    line: int
    col: int
    length: int = 1

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class DiagnosticError(DtmError, ValueError):
    """An error at a place in an IR source text (agreed: every rank reads the same text).

    ``str(err)`` is the full diagnostic: ``file:line:col: error: message``, then the source line
    and a caret under the offending text (when the source line is known).
    """

    kind = "error"
    agreed = True

    def __init__(self, message: str, span: SourceSpan, source_line: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.span = span
        self.source_line = source_line

    def __str__(self) -> str:
        head = f"{self.span}: {self.kind}: {self.message}"
        if self.source_line is None:
            return head
        line = self.source_line.rstrip("\n").expandtabs(1)
        caret = " " * (self.span.col - 1) + "^" + "~" * max(0, min(self.span.length, 200) - 1)
        return f"{head}\n  {line}\n  {caret}"

    def with_source(self, source_line: str) -> DiagnosticError:
        """Attach the text of the source line (done once, by whoever holds the source)."""
        self.source_line = source_line
        return self


class ParseError(DiagnosticError):
    """Lexical or syntactic error in an IR text."""

    kind = "parse error"


class VersionError(ParseError):
    """The module's ``dtm MAJOR.MINOR`` header names a version this reader cannot read."""

    kind = "version error"


class VerifyError(DiagnosticError):
    """A well-formed module breaks a rule of the IR (SSA, types, shapes, layouts, ...)."""

    kind = "verify error"


class GradientError(DiagnosticError):
    """A gradient that cannot be formed: it would flow through an op without a gradient
    rule, or the differentiated value is not a float scalar. Located at the op (in an IR file,
    or the user's Python line for traced code)."""

    kind = "error"


class TraceError(DiagnosticError):
    """An error in traced Python code (shapes, layouts, dtypes), located at the user's file
    and line, with that line's text."""

    kind = "error"


class InvalidModuleError(DtmError, ValueError):
    """A module file has diagnostics (printed before, or named in the message); agreed:
    every rank reads the same text."""

    agreed = True


# --- sharding and planning --------------------------------------------------------------------


class TaskGraphError(DtmError, ValueError):
    """A task graph file (``io/TASKS.md``) that cannot be run: a missing or malformed field, an
    unknown name, a cycle, types that differ between a producer and a consumer, a task that
    fits nowhere. The message starts with ``FILE:LINE:COL`` of the task or field (agreed:
    every rank reads the same file)."""


class LayoutError(DtmError, ValueError):
    """An invalid mesh, layout or sharding request (pure, decidable on every rank)."""

    agreed = True


class PlanError(DtmError, ValueError):
    """An execution plan cannot be built or is refused (e.g. above a memory limit)."""

    agreed = True


class TaskPlacementError(PlanError):
    """A task of a task plan fits nowhere (ranks, memory per rank, accelerator) or needs an
    unknown task; ``task`` names it (a graph file locates it)."""

    def __init__(self, message: str, *, task: str) -> None:
        super().__init__(message)
        self.task = task


# --- execution and backends -------------------------------------------------------------------


class KernelError(DtmError, RuntimeError):
    """A kernel failed (bad operands at run time, numerical error in strict mode, ...)."""


class BackendError(DtmError, RuntimeError):
    """A requested backend (cuda, hip, ...) cannot be used; names what is missing."""


# --- communication ----------------------------------------------------------------------------


class CommError(DtmError, RuntimeError):
    """Base of communication errors; ``rank`` and ``phase`` say where, when known."""

    def __init__(self, message: str, *, rank: int | None = None, phase: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.phase = phase


class CommTimeoutError(CommError):
    """A bounded wait expired: names the operation, the mesh axis and the phase."""

    def __init__(
        self,
        message: str,
        *,
        op: str,
        axis: str | None = None,
        rank: int | None = None,
        phase: str | None = None,
    ) -> None:
        super().__init__(message, rank=rank, phase=phase)
        self.op = op
        self.axis = axis
        self.silent: tuple[int, ...] = ()  # peers that did not answer a liveness check


class LauncherTerminatedError(CommError):
    """The launcher (mpirun/srun) is ending the job, e.g. because a peer process died."""


EXIT_REQUEUE = 75
"""The exit code of a run that stopped on a signal (SIGUSR1, or a scheduler's SIGTERM) after
saving its state: "saved, requeue me" (``EX_TEMPFAIL``); ``--resume`` continues it."""


class RunStopped(SystemExit):
    """A run stopped at a step boundary on a signal, every rank together, after saving its
    state (not an error: a ``SystemExit`` whose code is :data:`EXIT_REQUEUE` when a checkpoint
    was saved, else 1). ``step``: the steps done; ``checkpoint``: the saved one, or None."""

    def __init__(self, step: int, signal_name: str, checkpoint: str | None) -> None:
        super().__init__(EXIT_REQUEUE if checkpoint is not None else 1)
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint

    def __str__(self) -> str:
        if self.checkpoint is None:
            return (
                f"stopped by {self.signal_name} after step {self.step}; nothing saved (no --store)"
            )
        return (
            f"stopped by {self.signal_name} after step {self.step}: checkpoint {self.checkpoint} "
            f"saved; continue with --resume (exit code {EXIT_REQUEUE}: requeue)"
        )


class PoisonedError(CommError):
    """The session was poisoned by an earlier failure; ``cause`` is that original failure."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"communication session is poisoned by an earlier failure: {cause}")
        self.cause = cause


class ProtocolError(CommError):
    """A wire frame (``io/WIRE.md``) that is not what the protocol allows: ``field`` names the
    part that is wrong (``magic``, ``major``, ``type``, ``length``, ``crc``, ``body`` or a
    field of the message)."""

    def __init__(
        self,
        message: str,
        *,
        field: str,
        rank: int | None = None,
        phase: str | None = None,
    ) -> None:
        super().__init__(message, rank=rank, phase=phase)
        self.field = field


class PayloadIntegrityError(CommError):
    """A payload arrived with other bytes than its sender checksummed (integrity mode,
    ``DTM_INTEGRITY=1``): the message names the route (the step kind, the ranks, the tag)."""


class ReplicaDivergenceError(DtmError, RuntimeError):
    """The replica audit (``DTM_AUDIT_EVERY``) found ranks holding other bits than their
    replicas of the same block of a state tensor: the message names the tensor, the step and
    the odd rank(s) by majority (corruption in compute or memory, not only in transit)."""


class HandshakeError(CommError):
    """Ranks disagree on what they run (protocol, version, module hash, mesh, backend, ...)."""

    agreed = True


class GpuAwareMpiError(CommError):
    """GPU-aware MPI was required (``--require-gpu-aware-mpi``) but the decision is "not
    aware"; the message names the layer that decided (setting, vendor query, probe, default)
    and why. Raised on every rank when the decision was agreed (``agree_gpu_aware``)."""


@dataclass(frozen=True, slots=True)
class RankFailure:
    """One rank's local failure as agreed across ranks."""

    rank: int
    phase: str
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.phase}): {self.message}"


class RemoteFailureError(CommError):
    """One or more ranks failed; raised identically on every rank, listing every failure."""

    agreed = True

    def __init__(self, phase: str, failures: tuple[RankFailure, ...]) -> None:
        ranks = ", ".join(str(f.rank) for f in failures)
        groups: dict[tuple[str, str], list[int]] = {}  # ranks failing alike are named once
        for f in failures:
            groups.setdefault((f.phase, f.message), []).append(f.rank)
        details = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} ({ph}): {msg}"
            for (ph, msg), rs in groups.items()
        )
        super().__init__(f"{phase} failed on rank(s) {ranks}: {details}", phase=phase)
        self.failures = failures


# --- storage ----------------------------------------------------------------------------------


class StorageError(DtmError, OSError):
    """Base of tensor-store and checkpoint errors."""


class ManifestError(StorageError):
    """A manifest is malformed or incomplete; validation fails closed."""


class IntegrityError(StorageError):
    """Stored bytes do not match their recorded content hash."""

    def __init__(self, message: str, *, tensor: str, shard: str, file: str) -> None:
        super().__init__(f"{file}: tensor {tensor!r} shard {shard!r}: {message}")
        self.tensor = tensor
        self.shard = shard
        self.file = file


class LifecycleError(ManifestError):
    """An artifact lifecycle transition that the lifecycle does not allow."""


class QuotaError(StorageError):
    """A save would exceed the store's byte quota; refused before writing a byte."""


class CancelledError(StorageError):
    """A save was cancelled; its partial file was removed and the previous checkpoint stands."""


class UnrecoverableError(StorageError):
    """An artifact cannot be restored: a primary artifact with no healthy copy."""


def agreed(exc: DtmError) -> DtmError:
    """``exc`` marked as raised identically on every rank (decided from shared data or
    agreed through communication); returns it, for ``raise agreed(...)``."""
    exc.agreed = True
    return exc


def agreed_usage(message: str) -> UsageError:
    """A :class:`UsageError` decided from the command line (or the options) alone: the same on
    every rank, so :func:`agreed`."""
    err = UsageError(message)
    err.agreed = True
    return err
