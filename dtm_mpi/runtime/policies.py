"""A run's options as policy objects: each option's default and check in one place, built the
same way by ``dtm run`` (:mod:`dtm_mpi.cli_exec`) and by :func:`~dtm_mpi.frontend.fit.fit`,
and read by the step loop (:mod:`dtm_mpi.runtime.step_loop`) in every run mode.

Constructing a policy checks it; its errors are *agreed* (decided from the options alone, the
same on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtm_mpi.errors import agreed_usage

__all__ = ["CheckpointPolicy", "checkpoint_policy"]


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
    store: str | None, *, every: int | None = None, resume: bool = False,
    background: bool = False, keep_last: int | None = None, quota: int | None = None,
    save_final: bool = False,
) -> CheckpointPolicy | None:  # fmt: skip
    """The checkpoint policy of these options (None without a store; an agreed error for an
    option that needs one)."""
    if store:
        return CheckpointPolicy(store, every, resume, background, keep_last, quota, save_final)
    if every is not None or resume:
        raise agreed_usage("--checkpoint-every and --resume need --store DIR")
    if background or keep_last is not None or quota is not None:
        raise agreed_usage("--checkpoint-async, --keep-last and --quota need --store DIR")
    return None
