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
import threading
import time
from collections.abc import Iterable
from typing import Any

from dtm_mpi.comm.abort import write_line
from dtm_mpi.comm.control import Control
from dtm_mpi.comm.watchdog import Watchdog
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

SPIN_S = 0.05
"""Seconds a wait polls without sleeping before it backs off."""


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
        self.label = "dtm run"  # how this rank's error line starts
        self.poisoned: BaseException | None = None
        self._phase = "session"
        from dtm_mpi.comm.buffers import tune_allocator

        tune_allocator()
        self.comm = base.Dup()
        self.ctrl = base.Dup()
        self.control = Control(MPI, self.ctrl, self.rank, self.size, self._doing)
        self.current: tuple[str, tuple[str, ...], float] | None = None  # op, axes, deadline
        self._ending = threading.Lock()
        self._abandoned: list[Any] = []  # pending requests of a poisoned session
        self._joined = False
        self.watchdog: Watchdog | None = None
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self.watchdog = Watchdog(self)
            self.watchdog.start()
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
        self._joined = True

    # -- communicators -----------------------------------------------------------------------
    def group(self, axes: tuple[str, ...]) -> Any:
        """The communicator of this rank's group along ``axes`` (members in
        :meth:`MeshShape.group_of` order). Created on first use: callers must ask for the same
        groups in the same order on every rank (pass them all to :meth:`join_mesh`).

        Collective: call on all ranks (on first use of ``axes``)."""
        got = self._groups.get(axes)
        if got is None:
            self.check()
            if self._joined:
                raise CommError(
                    f"rank {self.rank}: no communicator for axes {','.join(axes) or '-'}; every "
                    "group must be created in join_mesh (creation is a blocking collective)"
                )
            others = tuple(a for a in self.mesh.axis_names if a not in axes)
            color = self.mesh.index_along(self.rank, others) if others else 0
            key = self.mesh.index_along(self.rank, axes) if axes else 0
            got = self.cart.Split(color, key)
            self._groups[axes] = got
        return got

    def _doing(self) -> str:
        """What this rank is communicating now, for liveness answers ("" = nothing)."""
        current = self.current
        return "" if current is None else f"{current[0]} on {','.join(current[1]) or '-'}"

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self.control.phase = value

    # -- bounded waits -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the poisoning failure, if any."""
        if self.poisoned is not None:
            raise PoisonedError(self.poisoned)

    def guarded(self, call: Any, what: str, axes: tuple[str, ...], *args: Any, **kwargs: Any) -> None:  # fmt: skip
        """``call(*args, **kwargs)`` (a blocking MPI call) with the main thread marked as
        inside ``what`` on ``axes``: the watchdog ends the job if it is still there at the
        deadline. Only for sessions with a watchdog."""
        if self.poisoned is not None:
            self.check()
        self.current = (what, axes, time.monotonic() + self.timeout_s)
        try:
            call(*args, **kwargs)
        finally:
            self.current = None

    def bind(
        self, call: Any, what: str, axes: tuple[str, ...], send_meta: tuple[Any, ...] | None,
        recv_meta: tuple[Any, ...] | None, extra: tuple[Any, ...], new_out: Any,
        tally: list[int],
    ) -> Any:  # fmt: skip
        """:meth:`guarded` bound once for an operation that repeats every step: returns
        ``fn(x)`` that runs ``call([x, *send_meta], [out, *recv_meta], *extra)`` on a new
        ``out = new_out()`` and returns ``out``; without ``recv_meta`` it runs ``call([x,
        *send_meta], *extra)`` in place and returns ``x``; without ``send_meta``, ``call([out,
        *recv_meta], *extra)`` (a receiving broadcast member). Each call counts in
        ``tally[0]``. Everything but the call is decided here, so a small collective costs
        little more than MPI's own call. Only for sessions with a watchdog."""
        assert self.watchdog is not None
        mono = time.monotonic
        timeout = self.timeout_s

        def both(x: Any) -> Any:
            if self.poisoned is not None:
                self.check()
            out = new_out()
            self.current = (what, axes, mono() + timeout)
            try:
                call([x, *send_meta], [out, *recv_meta], *extra)  # type: ignore[misc]
            finally:
                self.current = None
            tally[0] += 1
            return out

        def in_place(x: Any) -> Any:
            if self.poisoned is not None:
                self.check()
            self.current = (what, axes, mono() + timeout)
            try:
                call([x, *send_meta], *extra)  # type: ignore[misc]
            finally:
                self.current = None
            tally[0] += 1
            return x

        def receive(x: Any) -> Any:
            if self.poisoned is not None:
                self.check()
            out = new_out()
            self.current = (what, axes, mono() + timeout)
            try:
                call([out, *recv_meta], *extra)  # type: ignore[misc]
            finally:
                self.current = None
            tally[0] += 1
            return out

        if send_meta is None:
            return receive
        return in_place if recv_meta is None else both

    def wait(self, request: Any, op: str, axes: tuple[str, ...] = (), status: Any = None) -> None:
        """Wait for ``request`` within the deadline, watching for failure notices; ``status``
        (an ``MPI.Status``) receives the completed request's status.

        With the watchdog running this is MPI's own blocking wait under :meth:`guarded`.
        Without it, this thread polls: without sleeping for the first ``SPIN_S`` seconds
        (MPI progresses non-blocking operations only while it is called), then backing off to
        at most 1 ms, checking the control channel every 64 polls, then at every poll."""
        self.check()
        if self.watchdog is not None:
            self.guarded(request.Wait, op, axes, status)
            return
        test = request.Test
        if test(status):
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        spin_until = start + SPIN_S
        polls = 0
        pause = 0.0
        self.current = (op, axes, deadline)
        try:
            while not test(status):
                polls += 1
                if polls & 63:
                    continue
                now = time.monotonic()
                remote = self.control.poll()
                if remote is not None:
                    self._poison(remote, request)
                if now > deadline:
                    self._poison(self.expired(op, axes), request)
                if now > spin_until:
                    time.sleep(pause)
                    pause = min(0.001, pause + 0.00005)
                    polls = 63  # back off: check the control channel at every poll
        finally:
            self.current = None

    def expired(self, op: str, axes: tuple[str, ...]) -> CommTimeoutError | RemoteFailureError:
        """The error of a wait for ``op`` that reached its deadline, naming the peers that do
        not answer or are in no communication. A failure notice that arrives meanwhile (a
        peer whose deadline came first and already named the culprit) wins: every rank then
        reports the same cause."""
        live = self.control.liveness(min(2.0, max(0.5, self.timeout_s / 4)))
        remote = self.control.poll()
        if remote is not None:
            return remote
        who = f"; {live.describe()}" if live.suspects else ""
        err = CommTimeoutError(
            f"{op} on axes {','.join(axes) or '-'} did not complete within "
            f"{self.timeout_s:g} s on rank {self.rank} in phase {self.phase!r}{who}",
            op=op,
            axis=",".join(axes) or None,
            rank=self.rank,
            phase=self.phase,
        )
        err.silent = live.suspects
        err.liveness = live  # type: ignore[attr-defined]
        return err

    def _poison(self, cause: BaseException, request: Any = None) -> None:
        if self.poisoned is None:
            self.poisoned = cause
        if request is not None:  # MPI may still write into its buffers: keep them alive
            self._abandoned.append(request)
        raise cause

    def agree(self, phase: str, error: BaseException | None) -> None:
        """End ``phase``: every rank says whether it succeeded; if any failed, every rank
        raises the same :class:`RemoteFailureError` listing each failed rank and its message.

        Collective: call on all ranks."""
        from dtm_mpi.comm.agreement import agree_or_raise

        self.check()
        agree_or_raise(
            self.comm, phase=phase, error=error, timeout_s=self.timeout_s, wait=self.wait
        )

    # -- failures ------------------------------------------------------------------------------
    def notify_failure(self, phase: str, message: str) -> None:
        """Tell every other rank that this rank failed in ``phase`` (does not wait)."""
        self.control.notify((RankFailure(self.rank, phase, message),))

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
            live = getattr(exc, "liveness", None)
            idle = dict(live.idle) if live is not None else {}
            failures = tuple(
                RankFailure(
                    r, phase,
                    (f"in no communication (hung or still computing in phase {idle[r]!r})"
                     if r in idle else "did not answer (dead?)")
                    + f" while rank {self.rank} waited {self.timeout_s:g} s in {what}",
                )
                for r in exc.silent
            )  # fmt: skip
            err = RemoteFailureError(phase, failures)
            self.control.notify(failures)  # ranks waiting elsewhere learn it too
        else:
            self.notify_failure(phase, message)
            err = RemoteFailureError(phase, (RankFailure(self.rank, phase, message),))
        if self.poisoned is None:
            self.poisoned = err
        return err

    def on_launcher_terminate(self) -> None:
        """Report the launcher's SIGTERM (sent when a peer process died) as this rank's one
        error line: raised as :class:`LauncherTerminatedError` in the main thread at its next
        Python instruction, and — since the main thread may sit inside a blocking MPI call —
        also seen by the watchdog through the signal wakeup descriptor, which the interpreter
        writes at once from C."""
        import signal

        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: object) -> None:
            raise self.terminated_error(signum)

        signal.signal(signal.SIGTERM, handler)
        if self.watchdog is not None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self.watchdog.signal_fd = r

    def terminated_error(self, signum: int) -> LauncherTerminatedError:
        return LauncherTerminatedError(
            f"the launcher is ending the job (signal {signum}) in phase {self.phase!r}",
            rank=self.rank,
            phase=self.phase,
        )

    def report_terminated(self, exc: LauncherTerminatedError) -> None:
        """Print one error naming the peers that are gone, then exit at once (the launcher
        kills this process shortly anyway)."""
        if not self._ending.acquire(blocking=False):  # already reporting (other thread)
            while True:
                time.sleep(3600)
        try:
            silent = list(self.control.liveness(0.05).silent)
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

        if not self._ending.acquire(blocking=False):  # the watchdog is ending the job
            while True:
                time.sleep(3600)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # killed quietly: the error is printed
        text = "\n".join(f"[rank {self.rank}] {line}" for line in message.splitlines())
        write_line(text)
        sys.stdout.flush()
        # give the peers time to print theirs, answering their liveness pings meanwhile
        until = time.monotonic() + min(2.0, max(0.6, self.timeout_s / 10))
        while time.monotonic() < until:
            try:
                self.control.poll()
            except Exception:  # pragma: no cover  (MPI going down under us)
                break
            time.sleep(0.01)
        self.comm.Abort(code)
        os._exit(code)  # pragma: no cover  (Abort does not return)

    def end_from_watchdog(self, err: BaseException) -> None:
        """The watchdog's way out: one error line for this rank, then the job ends."""
        if self.poisoned is None:
            self.poisoned = err
        self.end_job(1, f"{self.label}: {err}")

    def close(self) -> None:
        """Free the communicators (only when not poisoned).

        Collective: call on all ranks."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.poisoned is not None:
            return
        for c in self._groups.values():
            c.Free()
        self._groups.clear()
        for c in (self.node, self.cart, self.ctrl, self.comm):
            if c is not None:
                c.Free()
