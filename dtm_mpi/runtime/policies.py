"""A run's options as policy objects: each option's default and check in one place, built the
same way by ``dtm run`` (:mod:`dtm_mpi.cli_exec`) and by :func:`~dtm_mpi.frontend.fit.fit`,
and read by the step loop (:mod:`dtm_mpi.runtime.step_loop`) in every run mode.

Constructing a policy checks it; its errors are *agreed* (decided from the options alone, the
same on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtm_mpi.errors import agreed_usage

__all__ = [
    "CheckpointPolicy",
    "ResizePolicy",
    "check_run_size",
    "checkpoint_policy",
    "resize_policy",
]


def check_run_size(steps: int, sim: int | None = None) -> None:
    """A run's steps (``--steps``, at least one) and simulated ranks (``--sim``, at least one
    when given): agreed errors."""
    if steps < 1:
        raise agreed_usage(f"--steps must be >= 1; got {steps}")
    if sim is not None and sim < 1:
        raise agreed_usage(f"--sim needs at least 1 rank; got {sim}")


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """The run's state in a checkpoint store (``--store DIR``): saved after every ``every``
    steps (``--checkpoint-every``; None: only when the run stops on a signal), the last step
    too with ``save_final``; written in the background (``--checkpoint-async``); the store
    keeping its ``keep_last`` newest checkpoints (``--keep-last``) within ``quota`` bytes
    (``--quota``); the run starting from the newest checkpoint that verifies (``--resume``)."""

    store: str
    every: int | None = None
    resume: bool = False
    background: bool = False
    keep_last: int | None = None
    quota: int | None = None
    save_final: bool = False

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise agreed_usage(f"--checkpoint-every must be >= 1; got {self.every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise agreed_usage(f"--keep-last must be >= 1; got {self.keep_last}")
        if self.quota is not None and self.quota < 1:
            raise agreed_usage(f"--quota must be >= 1 byte; got {self.quota}")

    @property
    def saves(self) -> bool:
        """Whether the run saves its state every N steps (a stop on a signal saves anyway)."""
        return self.every is not None

    def due(self, done: int, steps: int) -> bool:
        """Whether the state after step ``done`` (of ``steps``) is saved: every ``every``
        steps, and after the last with ``save_final``."""
        every = self.every
        return every is not None and (done % every == 0 or (done == steps and self.save_final))


def checkpoint_policy(
    store: str | None,
    *,
    every: int | None = None,
    resume: bool = False,
    background: bool = False,
    keep_last: int | None = None,
    quota: int | None = None,
    save_final: bool = False,
) -> CheckpointPolicy | None:
    """The checkpoint policy of these options (None without a store; an agreed error for an
    option that needs one)."""
    if store:
        return CheckpointPolicy(store, every, resume, background, keep_last, quota, save_final)
    if every is not None or resume:
        raise agreed_usage("--checkpoint-every and --resume need --store DIR")
    if background or keep_last is not None or quota is not None:
        raise agreed_usage("--checkpoint-async, --keep-last and --quota need --store DIR")
    return None


@dataclass(frozen=True, slots=True)
class ResizePolicy:
    """Live resizes of a run under MPI: planned after given steps (``at``: ``--resize-at
    STEP:MESH``, in increasing step order) and asked for while the job runs (``file``:
    ``--resize-file FILE``; the mesh written into it is read at a step's commit). A run that
    grows past the ranks it was launched with spawns ranks running ``relaunch`` (after
    ``python -m mpi4py``: the same command line, ``-m dtm_mpi run ...`` or the script calling
    :func:`~dtm_mpi.frontend.fit.fit`); None where the program cannot be started again (it
    then only shrinks and grows back)."""

    at: tuple[tuple[int, dict[str, int]], ...] = ()
    file: str | None = None
    relaunch: tuple[str, ...] | None = None

    def check(self, steps: int, binding: dict[str, int] | None) -> None:
        """The schedule against the run's steps and mesh binding (agreed errors)."""
        last = 0
        for step, sizes in self.at:
            if step <= last or step >= steps:
                raise agreed_usage(
                    f"--resize-at {step}: resizes come after steps 1 .. {steps - 1} (--steps {steps}), in increasing order"
                )
            _same_axes(f"--resize-at {step}", binding, sizes)
            last = step
        if self.file is not None:
            _same_axes("--resize-file", binding, binding or {})


def _same_axes(what: str, binding: dict[str, int] | None, sizes: dict[str, int]) -> None:
    if binding is None or set(sizes) != set(binding):
        raise agreed_usage(
            f"{what}: give --mesh, and bind the same axes at every resize ({', '.join(sorted(binding or {})) or 'none'} in --mesh, {', '.join(sorted(sizes)) or 'none'} here)"
        )


def resize_policy(
    at: tuple[tuple[int, dict[str, int]], ...] = (),
    file: str | None = None,
    relaunch: tuple[str, ...] | None = None,
) -> ResizePolicy | None:
    """The resize policy of these options (None when no resize is planned or asked for)."""
    return ResizePolicy(tuple(at), file, relaunch) if at or file else None
