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
import queue
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from dtm_mpi.comm.abort import claim_ending, end_on_term
from dtm_mpi.comm.control import Control
from dtm_mpi.comm.watchdog import Watchdog
from dtm_mpi.console import write_line
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

SETTLE_BOUND_S = 3.0
"""Before a rank prints a failure, it waits (at most this long, and at most the deadline)
until every peer has either reported a failure of its own or said that it is ending: ranks
failing in the same step then all print the same list."""


class _SideThread:
    """One thread per rank running overlapped collectives, in the order submitted, with MPI's
    blocking calls on duplicated group communicators (MPI's fast paths; a non-blocking
    collective moves only while its rank calls MPI, which a rank in a long kernel does not).
    Each call's ``done`` event is set when it returned; its error goes to ``owner.error``."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[Any, Any, Any, tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._run, name="dtm-overlap", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            done, owner, fn, args = item
            try:
                fn(*args)
            except BaseException as exc:  # handed to the waiting thread
                owner.error = exc
            done.set()


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
        from dtm_mpi.comm.objects import io_deadline

        # blocking collectives: bounded like every wait (a peer stopped here ends the job)
        with io_deadline("creating the session's communicators", "session", self.rank, timeout_s):
            self.comm = base.Dup()
            self.ctrl = base.Dup()
        self.control = Control(MPI, self.ctrl, self.rank, self.size, self._doing)
        self.current: tuple[str, tuple[str, ...], float] | None = None  # op, axes, deadline
        self._abandoned: list[Any] = []  # pending requests of a poisoned session
        self._checking = ""  # set while this rank asks its peers who is alive
        self._joined = False
        self.watchdog: Watchdog | None = None
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self.watchdog = Watchdog(self)
            self.watchdog.start()
        self.node = self._create(
            lambda: base.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank), "node communicator"
        )
        self.local_rank = int(self.node.Get_rank())
        self.cart: Any = None
        self._groups: dict[tuple[str, ...], Any] = {}
        self._side: dict[tuple[str, ...], Any] = {}
        self._side_thread: _SideThread | None = None
        if join:
            self.join_mesh(groups)

    def join_mesh(self, groups: Iterable[tuple[str, ...]] = ()) -> None:
        """Create the Cartesian communicator of the mesh and the group communicators. Call it
        after the handshake: ranks that disagree on the mesh must not get here.

        Collective: call on all ranks."""
        self.check()
        sizes = list(self.mesh.sizes)
        if self.mesh.axes:
            self.cart = self._create(
                lambda: self.comm.Create_cart(sizes, periods=[False] * len(sizes), reorder=False),
                "mesh communicator",
            )
        else:
            self.cart = self._create(self.comm.Dup, "mesh communicator")
        assert int(self.cart.Get_rank()) == self.rank
        for axes in groups:
            self.group(axes)
        self._joined = True

    # -- communicators -----------------------------------------------------------------------
    def _create(self, make: Any, what: str) -> Any:
        """``make()`` (a blocking collective that creates a communicator) within the
        deadline: under the watchdog's guard (a peer that does not come is named), else under
        a deadline thread that ends the job."""
        out: list[Any] = []
        if self.watchdog is not None:
            self.guarded(lambda: out.append(make()), f"creating the {what}", ())
            return out[0]
        from dtm_mpi.comm.objects import io_deadline

        with io_deadline(f"creating the {what}", self.phase, self.rank, self.timeout_s):
            return make()

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
            got = self._create(lambda: self.cart.Split(color, key), "group communicators")
            self._groups[axes] = got
        return got

    def _doing(self) -> str:
        """What this rank is communicating now, for liveness answers ("" = nothing)."""
        current = self.current
        if current is not None:
            return f"{current[0]} on {','.join(current[1]) or '-'}"
        if self.poisoned is not None:  # it has failed or seen a failure: not hung
            return "ending the job after a failure"
        from dtm_mpi.comm.agreement import active_wait

        return self._checking or active_wait()  # a liveness check, or a store's exchange

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self.control.phase = value
        from dtm_mpi.comm.presence import current

        presence = current()
        if presence is not None:  # it reports the launcher's SIGTERM, naming this phase
            presence.phase = value

    # -- bounded waits -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the poisoning failure, if any."""
        if self.poisoned is not None:
            raise PoisonedError(self.poisoned)

    def guarded(
        self, call: Any, what: str, axes: tuple[str, ...], *args: Any, **kwargs: Any
    ) -> None:
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
        self,
        call: Any,
        what: str,
        axes: tuple[str, ...],
        send_meta: tuple[Any, ...] | None,
        recv_meta: tuple[Any, ...] | None,
        extra: tuple[Any, ...],
        new_out: Any,
        tally: list[int],
    ) -> Any:
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
        remote = self._named_meanwhile()
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

    def _named_meanwhile(self) -> RemoteFailureError | None:
        """The failures a peer reported while this rank's wait expired: a notice that arrives
        now, or one another thread of this rank (the watchdog, a waiting side thread) has
        already taken. Reporting its own view instead would send a second report of the same
        culprit after the peers had settled on the first and printed it."""
        return self.control.poll() or self.control.error()

    def _poison(self, cause: BaseException, request: Any = None) -> None:
        if self.poisoned is None:
            self.poisoned = cause
        if request is not None:  # MPI may still write into its buffers: keep them alive
            self._abandoned.append(request)
        raise cause

    def agree(self, phase: str, error: BaseException | None, *, flag: int = 0) -> int:
        """End ``phase``: every rank says whether it succeeded; if any failed, every rank
        raises the same :class:`RemoteFailureError` listing each failed rank and its message.
        Returns the flag bits any rank raised (e.g. a stop request), OR-ed: the same on every
        rank.

        Collective: call on all ranks."""
        from dtm_mpi.comm.agreement import agree_or_raise

        self.check()
        return agree_or_raise(
            self.comm, phase=phase, error=error, timeout_s=self.timeout_s, wait=self.wait, flag=flag
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
        if isinstance(exc, PoisonedError):  # not a failure of this rank: the earlier one is
            return self.fail(exc.cause)
        if isinstance(exc, DtmError) and exc.agreed:  # raised alike on every rank
            if self.poisoned is None:
                self.poisoned = exc
            return exc
        phase = getattr(exc, "phase", None) or self.phase
        if self.phase.startswith(phase):  # "checkpoint" raised in phase "checkpoint 2"
            phase = self.phase
        message = str(exc) or type(exc).__name__
        if not isinstance(exc, DtmError):
            message = f"{type(exc).__name__}: {message}"
        if isinstance(exc, CommTimeoutError):
            if not exc.silent and self.size > 1:
                exc = self._name_silent(exc)
            known = self._named_meanwhile()
            if known is not None:  # a peer named the culprit first (or while this rank asked)
                if self.poisoned is None:
                    self.poisoned = known
                return known
        if isinstance(exc, CommTimeoutError) and exc.silent:
            what = exc.op if exc.axis is None else f"{exc.op} on axes {exc.axis}"
            live = getattr(exc, "liveness", None)
            idle = dict(live.idle) if live is not None else {}
            failures = tuple(
                RankFailure(
                    r,
                    phase,
                    (
                        f"in no communication (hung or still computing in phase {idle[r]!r})"
                        if r in idle
                        else "did not answer (dead?)"
                    )
                    + f" while rank {self.rank} waited {self.timeout_s:g} s in {what}",
                )
                for r in exc.silent
            )
            err = RemoteFailureError(phase, failures)
            self.control.notify(failures)  # ranks waiting elsewhere learn it too
        else:
            self.notify_failure(phase, message)
            err = RemoteFailureError(phase, (RankFailure(self.rank, phase, message),))
        if self.poisoned is None:
            self.poisoned = err
        return err

    def _name_silent(self, exc: CommTimeoutError) -> CommTimeoutError:
        """A wait outside the session's own (a store's exchange) timed out on this rank: ask
        every peer whether it is alive and what it does, and name those that do not answer
        or are in no communication, as an expired session wait does."""
        self._checking = f"liveness check after {exc.op}"  # kept: this rank is ending
        live = self.control.liveness(min(2.0, max(0.5, self.timeout_s / 4)))
        if not live.suspects:
            return exc
        err = CommTimeoutError(
            f"{exc}; {live.describe()}",
            op=exc.op,
            axis=exc.axis,
            rank=self.rank,
            phase=exc.phase,
        )
        err.silent = live.suspects
        err.liveness = live  # type: ignore[attr-defined]
        return err

    def on_launcher_terminate(self) -> None:
        """Report the launcher's SIGTERM (sent when a peer process died) as this rank's one
        error line (:meth:`report_terminated`). With a watchdog, the watchdog reports it: it
        sees the signal wakeup descriptor, which the interpreter writes at once from C (the
        main thread may sit inside a blocking MPI call, and an exception raised from the
        handler could land anywhere); without one, the main thread raises
        :class:`LauncherTerminatedError` at its next Python instruction. Nothing to do when
        a :class:`~dtm_mpi.comm.presence.Presence` runs: it reports it."""
        import signal

        from dtm_mpi.comm.presence import current

        if threading.current_thread() is not threading.main_thread() or current() is not None:
            return  # a presence (started with the command) already reports it

        def handler(signum: int, frame: object) -> None:
            if self.watchdog is None:  # else the watchdog reports it (from the wakeup byte):
                raise self.terminated_error(signum)  # raising here could land anywhere

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
        """Print one error naming the peers that are gone (those that do not answer a ping
        within ``SURVEY_S``) and the phase, keep answering pings so that the other survivors
        name the same ranks, then exit (the launcher kills this process shortly anyway)."""
        from dtm_mpi.comm.presence import LINGER_S, terminated_line

        claim_ending()  # else another thread of this rank is ending the job
        write_line(f"[rank {self.rank}] {terminated_line(self.label, self.control, 15)}")
        self.control.linger(LINGER_S)
        os._exit(1)

    def end_job(self, code: int, message: str) -> None:
        """Print ``message`` (rank-prefixed), give the peers a moment to print theirs, then
        abort the job: a poisoned session may hold pending requests, which ``MPI_Finalize``
        would wait for forever."""
        self._end(code, lambda: message)

    def end_with(self, err: BaseException, code: int = 1) -> None:
        """End the job with ``err`` as this rank's one line. For failures of ranks (this
        rank's own or peers'), first hear from every peer (:meth:`Control.settle`, bounded)
        and report them all: ranks that fail in the same step print the same list."""

        def text() -> str:
            final = err
            if isinstance(err, RemoteFailureError):
                settled = self.control.settle(min(SETTLE_BOUND_S, self.timeout_s))
                final = settled if settled is not None else err
            return f"{self.label}: {final}"

        self._end(code, text)

    def _end(self, code: int, message: Any) -> None:
        import signal

        claim_ending()  # else another thread of this rank is ending the job
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the error is printed: no second line
        from dtm_mpi.comm.presence import current

        error = message()
        write_line("\n".join(f"[rank {self.rank}] {line}" for line in error.splitlines()))
        sys.stdout.flush()
        presence = current()
        for control in (self.control, *([presence.control] if presence is not None else [])):
            control.announce_end(error)  # a peer killed by this end prints the same
        end_on_term()  # printed: another rank's abort may end this one at once
        # give the peers time to print theirs, answering their liveness pings meanwhile; no
        # longer than until every peer has said it printed its own
        until = time.monotonic() + min(2.0, max(0.6, self.timeout_s / 10))
        while time.monotonic() < until:
            try:
                self.control.poll()
                if self.control.all_ended():
                    break
            except Exception:  # pragma: no cover  (MPI going down under us)
                break
            time.sleep(0.01)
        self.comm.Abort(code)
        os._exit(code)  # pragma: no cover  (Abort does not return)

    def end_from_watchdog(self, err: BaseException) -> None:
        """The watchdog's way out: one error line for this rank, then the job ends."""
        if self.poisoned is None:
            self.poisoned = err
        self.end_with(err)

    def side_group(self, axes: tuple[str, ...]) -> Any:
        """A duplicate of :meth:`group` ``(axes)`` for collectives another thread of this rank
        runs while this one runs its own on the group (overlapped allreduces); created on
        first use within the deadline (the watchdog's guard: only with a watchdog).

        Collective: call on all ranks of the group (on first use of ``axes``)."""
        got = self._side.get(axes)
        if got is None:
            assert self.watchdog is not None
            made: list[Any] = []
            group = self.group(axes)
            self.guarded(lambda: made.append(group.Dup()), "overlap communicator", axes)
            got = self._side[axes] = made[0]
        return got

    def side_submit(self, done: Any, owner: Any, fn: Any, args: tuple[Any, ...]) -> None:
        """Run ``fn(*args)`` (a blocking MPI call on a :meth:`side_group`) on this rank's side
        thread after the calls submitted before; ``done`` (a ``threading.Event``) is set when
        it returns, and an exception it raised is stored in ``owner.error``."""
        if self._side_thread is None:
            self._side_thread = _SideThread()
        self._side_thread.queue.put((done, owner, fn, args))

    def wait_event(self, done: Any, op: str, axes: tuple[str, ...]) -> None:
        """Wait for ``done`` (a ``threading.Event`` another thread sets when its MPI call
        returns) within the deadline, watching for failure notices as :meth:`wait` does."""
        self.check()
        deadline = time.monotonic() + self.timeout_s
        if done.is_set():
            return
        self.current = (op, axes, deadline)  # what this rank waits in (liveness answers)
        try:
            while not done.wait(0.002):
                remote = self.control.poll()
                if remote is not None:
                    self._poison(remote)
                if time.monotonic() > deadline:
                    self._poison(self.expired(op, axes))
        finally:
            self.current = None

    def close(self) -> None:
        """Free the communicators (only when not poisoned).

        Collective: call on all ranks."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.poisoned is not None:
            return
        if self._side_thread is not None:  # idle once the steps waited for their calls
            self._side_thread.queue.put(None)
            self._side_thread.thread.join(timeout=self.timeout_s)
            self._side_thread = None
        for c in self._side.values():
            c.Free()
        self._side.clear()
        for c in self._groups.values():
            c.Free()
        self._groups.clear()
        for c in (self.node, self.cart, self.ctrl, self.comm):
            if c is not None:
                c.Free()
