"""``dtm run``: the run request and the steps both launchers share.

A :class:`RunRequest` is decided from the command line alone, so its checks give the same
answer on every rank (its errors are *agreed*; under MPI :func:`agree_arguments` also ends the
phase on every rank together, so no rank exits -- and has the launcher kill the others --
before every rank printed its line). :func:`dtm_mpi.runtime.runner.run_request` runs it: with
``sim`` on N simulated ranks in this process, else on the ranks of ``mpirun``/``srun``
(:mod:`dtm_mpi.runtime.mpirun`). Both paths use the same steps from this module:

* :func:`load_run` -- the output and store paths, the module (:func:`load_module`, the one
  loader of IR files), the capabilities it requires, the keys of the output file;
* :func:`plan_run` -- the plan for the bound mesh and the memory limit;
* :func:`store_params` / :func:`read_store_globals` -- ``init store`` parameters filled from the
  latest checkpoint of ``--store`` (by name, written on any mesh);
* :func:`write_outputs` -- the summary lines and the ``-o`` file.

Nothing here runs MPI at import time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtm_mpi.console import say
from dtm_mpi.errors import (
    BackendError,
    DtmError,
    InvalidModuleError,
    RemoteFailureError,
    UsageError,
    agreed,
    agreed_usage,
)
from dtm_mpi.runtime.policies import (
    CheckpointPolicy,
    DevicePolicy,
    PipelinePolicy,
    ProgressPolicy,
    ResizePolicy,
    check_run_size,
)
from dtm_mpi.runtime.step_loop import RunHooks

if TYPE_CHECKING:
    import numpy as np

    from dtm_mpi.ir.nodes import Module, Param
    from dtm_mpi.ir.types import TensorType
    from dtm_mpi.plan.pipeline import PipelinePlan
    from dtm_mpi.plan.program import ExecPlan
    from dtm_mpi.sharding.mesh import MeshShape

__all__ = [
    "RunHooks",
    "RunRequest",
    "agree_arguments",
    "deliver_outputs",
    "given_inputs",
    "capabilities",
    "check_capabilities",
    "load_module",
    "load_run",
    "plan_pipeline_run",
    "plan_run",
    "print_diagnostic",
    "read_globals",
    "read_store_globals",
    "store_params",
    "write_outputs",
]


@dataclass(frozen=True, slots=True)
class RunRequest:
    """What ``dtm run`` was asked to do; constructing it checks the arguments (agreed
    :class:`~dtm_mpi.errors.UsageError`: the command line is the same on every rank)."""

    file: str
    binding: dict[str, int] | None = None  # --mesh sizes
    inputs: tuple[str, ...] = ()  # -i files
    output: str | None = None  # -o OUT.npz
    steps: int = 1
    sim: int | None = None  # --sim N: simulated ranks in this process; None: under MPI
    module: Module | None = None  # a module built in Python (``file`` then only names it)
    hooks: RunHooks | None = None  # a run started from Python: fed inputs, metrics, outputs
    device: DevicePolicy = field(
        default_factory=DevicePolicy
    )  # --backend, --gpu-aware-mpi, --max-bytes-per-rank
    checkpoint: CheckpointPolicy | None = None  # --store and its options
    resize: ResizePolicy | None = None  # --resize-at, --resize-file: live resizes under MPI
    progress: ProgressPolicy | None = None  # --log-every
    pipeline: PipelinePolicy | None = None  # the step's pipeline stages (a Python run)
    label: str = "dtm run"  # how this run's error lines start (a task of a graph: its name)

    @property
    def store(self) -> str | None:
        """The checkpoint store directory (``--store``), if any."""
        return self.checkpoint.store if self.checkpoint is not None else None

    @property
    def resume(self) -> bool:
        """Whether the run starts from the store's newest checkpoint that verifies."""
        return self.checkpoint is not None and self.checkpoint.resume

    @property
    def fed(self) -> tuple[str, ...]:
        """The entry parameters a Python run's loader feeds each step (none from the CLI)."""
        return self.hooks.fed if self.hooks is not None else ()

    @property
    def backend(self) -> str:
        """The array backend's name (``--backend``)."""
        return self.device.backend

    def __post_init__(self) -> None:
        check_run_size(self.steps, self.sim)
        if self.resize is not None:
            self.resize.check(self.steps, self.binding)
        if self.resume and self.inputs:
            raise agreed_usage(
                "--resume takes the state from the checkpoint; do not give -i inputs"
            )
        if self.sim is None:
            return
        self.device.check_simulated()
        if self.resize is not None:
            raise agreed_usage(
                "--resize-at and --resize-file need the MPI runtime (run under mpirun/srun, without --sim)"
            )


def parse_resize(text: str) -> tuple[int, dict[str, int]]:
    """``STEP:MESH`` (``--resize-at``): after step STEP, the mesh bound as MESH (``dp=1,tp=3``)."""
    from dtm_mpi.sharding.mesh import parse_mesh_binding

    step, colon, mesh = text.partition(":")
    if not colon or not step.strip().isdigit():
        raise agreed_usage(f"--resize-at {text!r}: expected STEP:MESH, e.g. 4:dp=1,tp=3")
    return int(step), parse_mesh_binding(mesh)


def agree_arguments(error: DtmError | None) -> None:
    """Under MPI (``dtm run`` without ``--sim``): end phase ``arguments`` on every rank of the
    job together, so that no rank exits -- and has the launcher kill the others -- before
    every rank has decided. Raises ``error`` (this rank's own), else the agreed failure of
    the others; returns when every rank's command line was accepted.

    Collective: call on all ranks."""
    from dtm_mpi.comm.agreement import agree_or_raise
    from dtm_mpi.comm.world import world_comm
    from dtm_mpi.config import get_config

    try:
        agree_or_raise(
            world_comm(), phase="arguments", error=error, timeout_s=get_config().timeout_s
        )
    except RemoteFailureError:
        if error is not None:
            raise agreed(error) from None
        raise


# --- the module --------------------------------------------------------------------------------


def print_diagnostic(text: str) -> None:
    """Write one (multi-line) diagnostic to stderr."""
    sys.stderr.write(text.rstrip("\n") + "\n")


def load_module(path: str, show: Callable[[str], None] | None = print_diagnostic) -> Module:
    """The verified module in ``path``: the one loader of IR files. Diagnostics are passed to
    ``show`` (full, with the source line and caret), then one agreed
    :class:`~dtm_mpi.errors.InvalidModuleError` ends the command (every rank reads the same
    text); with ``show=None`` the error itself names the first diagnostics on one line."""
    from dtm_mpi.ir import check_text
    from dtm_mpi.ir.source_files import read_source

    module, errors = check_text(read_source(path), path)
    if errors:
        if show is not None:
            for err in errors:
                show(str(err))
            raise InvalidModuleError(f"{path}: {len(errors)} error(s), see above")
        heads = [f"{e.span}: {e.kind}: {e.message}" for e in errors[:3]]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise InvalidModuleError("; ".join(heads) + more)
    assert module is not None
    return module


def required_capabilities(module: Module) -> set[str]:
    """Every capability a function of ``module`` declares in ``requires``."""
    return {cap for f in module.functions for cap in f.requires}


def capabilities(backend: str) -> tuple[str, ...]:
    """What this runtime provides with kernel backend ``backend`` (sorted): int8 quantisation
    and the tensor store always, ``CAP_CUDA``/``CAP_HIP`` with that backend, ``CAP_HDF5_MPI``
    when the store's HDF5 backend writes in parallel (h5py built with MPI)."""
    from dtm_mpi.io.backend import HDF5

    caps = {"CAP_QUANT", "CAP_STORE"}
    if backend == "cuda":
        caps.add("CAP_CUDA")
    elif backend == "hip":
        caps.add("CAP_HIP")
    if HDF5.parallel:
        caps.add("CAP_HDF5_MPI")
    return tuple(sorted(caps))


def check_capabilities(module: Module, backend: str) -> None:
    """Refuse ``module`` before anything runs if it requires a capability this runtime does
    not provide with ``backend``."""
    missing = sorted(required_capabilities(module) - set(capabilities(backend)))
    if missing:
        where = next(
            (
                f"{span.file}:{span.line}:{span.col}: "
                for f in module.functions
                for cap, span in zip(f.requires, f.requires_spans, strict=False)
                if cap == missing[0] and span.line > 0
            ),
            "",
        )
        raise BackendError(
            f"{where}module {module.name} requires {', '.join(missing)}, which this runtime "
            f"(backend {backend}) does not provide"
        )


def _check_paths(request: RunRequest) -> None:
    """The ``-o`` file and the ``--store`` directory, refused before any work (file-system
    state: under MPI each rank decides, and the phase's agreement makes it one error)."""
    from dtm_mpi.io.arrays import check_output_path

    if request.output:
        check_output_path(request.output)
    if request.store:
        store = Path(request.store)
        if store.exists() and not store.is_dir():
            raise UsageError(f"--store {request.store} is not a directory")
        if not store.exists() and request.resume:  # (a new store takes the checkpoints)
            raise UsageError(f"--store {request.store}: no such checkpoint store")


def load_run(request: RunRequest, show: Callable[[str], None] | None = print_diagnostic) -> Module:
    """Phase ``load``: the paths, the module, the capabilities it requires and the keys of the
    output file -- everything decided before a plan is made."""
    from dtm_mpi.plan.outputs import check_output_keys

    _check_paths(request)
    module = request.module if request.module is not None else load_module(request.file, show)
    check_capabilities(module, request.backend)
    entry = module.entry
    if entry is None:
        raise UsageError(f"module {module.name} has no entry function")
    check_output_keys(entry)
    return module


def plan_run(module: Module, request: RunRequest, nranks: int) -> ExecPlan:
    """Phase ``plan``: the plan on the mesh bound for ``nranks`` ranks; refused when its peak
    memory on some rank is above ``--max-bytes-per-rank``."""
    from dtm_mpi.plan.explain import check_memory
    from dtm_mpi.plan.program import compile_plan, mesh_for

    plan = compile_plan(module, mesh_for(module, nranks, request.binding))
    if request.device.max_bytes_per_rank is not None:
        check_memory(plan, request.device.max_bytes_per_rank)
    return plan


def plan_pipeline_run(request: RunRequest, plan: ExecPlan) -> PipelinePlan | None:
    """Phase ``plan`` of a pipelined run (``request.pipeline``): its stages on ``plan``'s mesh
    (:func:`~dtm_mpi.runtime.pipeline_step.plan_pipelined_run`); None for other runs."""
    if request.pipeline is None:
        return None
    from dtm_mpi.runtime.pipeline_step import plan_pipelined_run

    return plan_pipelined_run(request.pipeline, plan, fed=request.fed, backend=request.backend)


# --- init store ------------------------------------------------------------------------------


def store_params(module: Module, given: Mapping[str, object]) -> list[Param]:
    """The entry parameters declared ``init store`` that no input supplies."""
    from dtm_mpi.ir.nodes import InitKind

    entry = module.entry
    assert entry is not None
    return [
        p
        for p in entry.params
        if p.init is not None and p.init.kind is InitKind.STORE and p.name.lstrip("%") not in given
    ]


def read_store_globals(
    store: str, module: Module, params: Sequence[Param]
) -> dict[str, np.ndarray]:
    """The global values of ``params`` (by name without ``%``) from the latest checkpoint of
    ``store``, read in this process alone (one rank: every tensor whole, whatever mesh wrote
    it). For the simulator; under MPI the ranks restore their blocks together."""
    from dtm_mpi.plan.program import mesh_for

    targets = [(p.name.lstrip("%"), p.type) for p in params]
    return read_globals(store, mesh_for(module, 1, None), targets)


def read_globals(
    store: str | Path,
    mesh: MeshShape,
    targets: Sequence[tuple[str, TensorType]],
    step: int | None = None,
) -> dict[str, np.ndarray]:
    """The global values of the stored tensors ``targets`` (name, type on the one-rank
    ``mesh``) from checkpoint ``step`` of ``store`` (default: latest), read in this process
    alone."""
    from dtm_mpi.comm.handles import self_comm
    from dtm_mpi.config import get_config
    from dtm_mpi.io.checkpoint import CheckpointStore

    ckpt = CheckpointStore(store, self_comm(), timeout_s=get_config().timeout_s)
    try:
        got = ckpt.restore(mesh, targets, step=step)
    finally:
        ckpt.close()
    return dict(got.values)


# --- inputs and outputs ----------------------------------------------------------------------


def given_inputs(request: RunRequest, module: Module) -> dict[str, np.ndarray]:
    """Phase ``inputs``: the arrays of the ``-i`` files and the values a Python run gives,
    checked against the entry parameters (those a loader feeds need none)."""
    from dtm_mpi.io.arrays import load_arrays
    from dtm_mpi.runtime.values import check_inputs

    arrays: dict[str, Any] = dict(load_arrays(list(request.inputs)))  # and BlockSources
    if request.hooks is not None and request.hooks.values:
        arrays.update(request.hooks.values)
    return check_inputs(module, arrays, store=bool(request.store), fed=request.fed)


def deliver_outputs(request: RunRequest, outputs: dict[str, np.ndarray]) -> None:
    """Rank 0, phase ``output``: to a Python run's ``on_outputs``, else printed and written
    to the ``-o`` file."""
    if request.hooks is not None and request.hooks.on_outputs is not None:
        request.hooks.on_outputs(outputs)
    else:
        write_outputs(outputs, request.output)


def write_outputs(outputs: Mapping[str, np.ndarray], output: str | None) -> None:
    """Print one summary line per output, then write the ``-o`` file (if any)."""
    from dtm_mpi.io.arrays import save_npz
    from dtm_mpi.runtime.simulate import summary_lines

    for line in summary_lines(outputs):
        say(line)
    if output:
        save_npz(output, outputs)
        say(f"wrote {output}")
