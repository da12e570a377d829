"""An MPI session: the job's communicators, bounded waits, failure notices and poisoning.

Created collectively from a duplicate of ``MPI.COMM_WORLD`` (never the world itself, so user
code and libraries keep their own traffic): a Cartesian communicator with the bound mesh's
shape (``reorder=False``: rank ``r`` keeps the row-major coordinates of spec §6), one
communicator per group of axes the plan uses (split in a fixed order on every rank, so
creation can never interleave differently), a node-local communicator (for GPU binding) and a
control communicator that carries only failure notices.

**Bounded completion.** Every wait polls a non-blocking request against a deadline
(``DTM_TIMEOUT``). While waiting it also watches the control communicator: a rank that fails
sends a notice to every other rank, so its peers stop at once with a
:class:`~dtm_mpi.errors.RemoteFailureError` naming the failed rank and its phase instead of
waiting out the deadline. On expiry the waiting rank asks every peer whether it is alive (a
second bounded round on the control communicator) and names the ranks that did not answer.
Either way the session is **poisoned**: every later operation fails fast with the original
cause (:class:`~dtm_mpi.errors.PoisonedError`), and since a request may still be pending, the
job must end with :meth:`MpiSession.end_job`, never with ``MPI_Finalize``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from typing import Any

from dtm_mpi.comm.abort import write_line
from dtm_mpi.errors import (
    CommError,
    CommTimeoutError,
    DtmError,
    LauncherTerminatedError,
    PoisonedError,
    RankFailure,
    RemoteFailureError,
    UsageError,
)
from dtm_mpi.sharding.mesh import MeshShape

__all__ = ["MpiSession"]

_TAG_FAIL = 71
_TAG_PING = 72
_TAG_PONG = 73


class MpiSession:
    """Collective: construct on all ranks (same ``mesh`` and ``groups`` everywhere)."""

    def __init__(
        self,
        mesh: MeshShape,
        groups: Iterable[tuple[str, ...]] = (),
        *,
        timeout_s: float = 300.0,
        world: Any = None,
        join: bool = True,
    ) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.timeout_s = timeout_s
        base = world if world is not None else MPI.COMM_WORLD
        self.rank = int(base.Get_rank())
        self.size = int(base.Get_size())
        if self.size != mesh.size:
            raise UsageError(
                f"the job has {self.size} ranks but mesh {mesh} has {mesh.size}; bind sizes "
                "with --mesh so that their product is the number of ranks"
            )
        self.mesh = mesh
        self.poisoned: BaseException | None = None
        self.phase = "session"
        self.comm = base.Dup()
        self.ctrl = base.Dup()
        self._pending_sends: list[Any] = []
        self.node = base.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = int(self.node.Get_rank())
        self.cart: Any = None
        self._groups: dict[tuple[str, ...], Any] = {}
        if join:
            self.join_mesh(groups)

    def join_mesh(self, groups: Iterable[tuple[str, ...]] = ()) -> None:
        """Create the Cartesian communicator of the mesh and the group communicators. Call it
        after the handshake: ranks that disagree on the mesh must not get here.

        Collective: call on all ranks."""
        self.check()
        sizes = list(self.mesh.sizes)
        if self.mesh.axes:
            self.cart = self.comm.Create_cart(sizes, periods=[False] * len(sizes), reorder=False)
        else:
            self.cart = self.comm.Dup()
        assert int(self.cart.Get_rank()) == self.rank
        for axes in groups:
            self.group(axes)

    # -- communicators -----------------------------------------------------------------------
    def group(self, axes: tuple[str, ...]) -> Any:
        """The communicator of this rank's group along ``axes`` (members in
        :meth:`MeshShape.group_of` order). Created on first use: callers must ask for the same
        groups in the same order on every rank (pass them all to the constructor).

        Collective: call on all ranks (on first use of ``axes``)."""
        got = self._groups.get(axes)
        if got is None:
            self.check()
            others = tuple(a for a in self.mesh.axis_names if a not in axes)
            color = self.mesh.index_along(self.rank, others) if others else 0
            key = self.mesh.index_along(self.rank, axes) if axes else 0
            got = self.cart.Split(color, key)
            self._groups[axes] = got
        return got

    # -- bounded waits -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the poisoning failure, if any."""
        if self.poisoned is not None:
            raise PoisonedError(self.poisoned)

    def wait(self, request: Any, op: str, axes: tuple[str, ...] = (), status: Any = None) -> None:
        """Wait for ``request`` within the deadline, watching for failure notices; ``status``
        (an ``MPI.Status``) receives the completed request's status."""
        if request.Test(status):
            return
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        probe = self.MPI.Status()
        while not request.Test(status):
            if self.ctrl.Iprobe(self.MPI.ANY_SOURCE, _TAG_FAIL, probe):
                self._poison(self._remote_failure(probe))
            self._answer_pings(probe)
            if time.monotonic() > deadline:
                silent = self._who_is_alive()
                who = (
                    f"; rank(s) {', '.join(map(str, silent))} did not answer (hung or dead)"
                    if silent
                    else ""
                )
                err = self._timeout(op, axes, who)
                err.silent = tuple(silent)
                self._poison(err)
            time.sleep(pause)
            pause = min(0.001, pause + 0.00002)

    def _timeout(self, op: str, axes: tuple[str, ...], who: str) -> CommTimeoutError:
        return CommTimeoutError(
            f"{op} on axes {','.join(axes) or '-'} did not complete within "
            f"{self.timeout_s:g} s on rank {self.rank} in phase {self.phase!r}{who}",
            op=op,
            axis=",".join(axes) or None,
            rank=self.rank,
            phase=self.phase,
        )

    def _remote_failure(self, status: Any) -> RemoteFailureError:
        failures: dict[int, RankFailure] = {}
        grace = time.monotonic() + 0.2  # collect simultaneous failures too
        while True:
            while self.ctrl.Iprobe(self.MPI.ANY_SOURCE, _TAG_FAIL, status):
                source = status.Get_source()
                rank, phase, message = self.ctrl.recv(source=source, tag=_TAG_FAIL)
                failures[int(rank)] = RankFailure(int(rank), str(phase), str(message))
            if time.monotonic() > grace:
                break
            time.sleep(0.01)
        ordered = tuple(failures[r] for r in sorted(failures))
        return RemoteFailureError(ordered[0].phase, ordered)

    def _answer_pings(self, status: Any) -> None:
        while self.ctrl.Iprobe(self.MPI.ANY_SOURCE, _TAG_PING, status):
            source = status.Get_source()
            self.ctrl.recv(source=source, tag=_TAG_PING)
            self._pending_sends.append(self.ctrl.isend(self.rank, dest=source, tag=_TAG_PONG))

    def _who_is_alive(self, bound: float | None = None) -> list[int]:
        """Peers that do not answer a ping within a short bound (a rank that is waiting in
        any bounded wait answers at once; a hung or dead one never does)."""
        if bound is None:
            bound = min(2.0, max(0.5, self.timeout_s / 4))
        peers = [r for r in range(self.size) if r != self.rank]
        for r in peers:
            self._pending_sends.append(self.ctrl.isend(self.rank, dest=r, tag=_TAG_PING))
        heard: set[int] = set()
        status = self.MPI.Status()
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and len(heard) < len(peers):
            self._answer_pings(status)
            while self.ctrl.Iprobe(self.MPI.ANY_SOURCE, _TAG_PONG, status):
                heard.add(int(self.ctrl.recv(source=status.Get_source(), tag=_TAG_PONG)))
            time.sleep(0.005)
        return [r for r in peers if r not in heard]

    def _poison(self, cause: BaseException) -> None:
        if self.poisoned is None:
            self.poisoned = cause
        raise cause

    def agree(self, phase: str, error: BaseException | None) -> None:
        """End ``phase``: every rank says whether it succeeded; if any failed, every rank
        raises the same :class:`RemoteFailureError` listing each failed rank and its message.

        Collective: call on all ranks."""
        from dtm_mpi.comm.agreement import agree_outcome

        self.check()
        message = "" if error is None else (str(error) or type(error).__name__)
        failures = agree_outcome(
            self.comm, ok=error is None, message=message, phase=phase, timeout_s=self.timeout_s
        )
        if failures:
            raise RemoteFailureError(phase, failures)

    # -- failures ------------------------------------------------------------------------------
    def notify_failure(self, phase: str, message: str) -> None:
        """Tell every other rank that this rank failed in ``phase`` (does not wait)."""
        for r in range(self.size):
            if r != self.rank:
                self._pending_sends.append(
                    self.ctrl.isend((self.rank, phase, message), dest=r, tag=_TAG_FAIL)
                )

    def fail(self, exc: BaseException) -> DtmError:
        """This rank failed with ``exc``: notify the peers and return the error every rank
        will report: a :class:`RemoteFailureError` naming the failed rank(s) and the phase
        (for a timeout, the peers that did not answer; else this rank)."""
        if isinstance(exc, RemoteFailureError):
            return exc
        if isinstance(exc, DtmError) and exc.agreed:  # raised alike on every rank
            if self.poisoned is None:
                self.poisoned = exc
            return exc
        phase = getattr(exc, "phase", None) or self.phase
        message = str(exc) or type(exc).__name__
        if not isinstance(exc, DtmError):
            message = f"{type(exc).__name__}: {message}"
        if isinstance(exc, CommTimeoutError) and exc.silent:
            what = f"{exc.op} on axes {exc.axis or '-'}"
            failures = tuple(
                RankFailure(r, phase, f"did not answer (hung or dead) while rank {self.rank} "
                            f"waited {self.timeout_s:g} s in {what}")
                for r in exc.silent
            )  # fmt: skip
            err = RemoteFailureError(phase, failures)
        else:
            self.notify_failure(phase, message)
            err = RemoteFailureError(phase, (RankFailure(self.rank, phase, message),))
        if self.poisoned is None:
            self.poisoned = err
        return err

    def on_launcher_terminate(self) -> None:
        """Turn the launcher's SIGTERM (sent when a peer process died) into
        :class:`LauncherTerminatedError`, raised in the main thread at the next Python
        instruction (never inside an MPI call)."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: object) -> None:
            raise LauncherTerminatedError(
                f"the launcher is ending the job (signal {signum}) in phase {self.phase!r}",
                rank=self.rank,
                phase=self.phase,
            )

        signal.signal(signal.SIGTERM, handler)

    def report_terminated(self, exc: LauncherTerminatedError) -> None:
        """Print one error naming the peers that are gone, then exit at once (the launcher
        kills this process shortly anyway)."""
        try:
            silent = self._who_is_alive(bound=0.3)
        except Exception:  # the MPI library may already be torn down
            silent = []
        peers = self.size - 1
        who = (
            f"rank(s) {', '.join(map(str, silent))} exited or hung; "
            if silent and len(silent) < peers
            else ""
        )
        write_line(f"[rank {self.rank}] dtm run: {self.phase} failed: {who}{exc}")
        os._exit(1)

    def end_job(self, code: int, message: str) -> None:
        """Print ``message`` (rank-prefixed), give the peers a moment to print theirs, then
        abort the job: a poisoned session may hold pending requests, which ``MPI_Finalize``
        would wait for forever."""
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # killed quietly: the error is printed
        text = "\n".join(f"[rank {self.rank}] {line}" for line in message.splitlines())
        write_line(text)
        sys.stdout.flush()
        time.sleep(min(1.0, max(0.2, self.timeout_s / 10)))
        self.comm.Abort(code)
        os._exit(code)  # pragma: no cover  (Abort does not return)

    def close(self) -> None:
        """Free the communicators (only when not poisoned).

        Collective: call on all ranks."""
        if self.poisoned is not None:
            return
        for c in self._groups.values():
            c.Free()
        self._groups.clear()
        for c in (self.node, self.cart, self.ctrl, self.comm):
            if c is not None:
                c.Free()


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, CommError | DtmError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
