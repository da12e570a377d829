"""``dtm explain`` and ``dtm run``: argument handling; planning and running live below."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dtm_mpi.errors import DtmError, UsageError, agreed
from dtm_mpi.kernels.backends import BACKEND_NAMES

if TYPE_CHECKING:
    from dtm_mpi.frontend.trace import TracedStep
    from dtm_mpi.ir.nodes import Module
    from dtm_mpi.plan.program import ExecPlan

__all__ = ["add_exec_commands", "byte_count", "runs_under_mpi"]


def _mesh_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mesh",
        metavar="AXIS=N,...",
        help="bind mesh axis sizes (e.g. dp=2,tp=2); default: every rank on the first axis",
    )


def byte_count(text: str) -> int:
    """An argparse ``type``: :func:`dtm_mpi.units.parse_bytes`, its error kept as the message."""
    from dtm_mpi.units import parse_bytes

    try:
        return parse_bytes(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_exec_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``dtm explain``, ``dtm run`` and ``dtm launch``."""
    _add_explain(sub)
    rn = _add_run(sub)
    _add_run_policies(rn)
    _add_launch(sub)


def _add_explain(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ex = sub.add_parser(
        "explain",
        help="per-op local shapes, communication, bytes, memory (of an IR file, or of the first fit() of a Python script: dtm explain SCRIPT.py -- ARGS)",
    )
    ex.add_argument("file", metavar="FILE")
    ex.add_argument(
        "script_args",
        nargs="*",
        metavar="ARGS",
        help="a Python script's own arguments (after --)",
    )
    ex.add_argument(
        "-n",
        "--ranks",
        type=int,
        default=None,
        help="number of ranks (default: the product of --mesh, else the declared mesh)",
    )
    _mesh_arg(ex)
    ex.add_argument(
        "--max-bytes-per-rank",
        type=byte_count,
        default=None,
        metavar="BYTES",
        help="refuse a plan whose peak memory on any rank is above BYTES",
    )
    ex.add_argument(
        "--backend",
        default="numpy",
        choices=BACKEND_NAMES,
        help="also show where each op runs on this GPU backend (needs no GPU)",
    )
    _add_training(ex)
    ex.set_defaults(func=_cmd_explain)


def _add_run(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """``dtm run``: what runs where (the run's policies: :func:`_add_run_policies`)."""
    rn: argparse.ArgumentParser = sub.add_parser(
        "run", help="run the entry function (--sim N: N simulated ranks)"
    )
    rn.add_argument("file", metavar="FILE")
    rn.add_argument(
        "--sim",
        type=int,
        metavar="N",
        default=None,
        help="run N simulated ranks in this process (debugging); without --sim, "
        "run on the ranks of mpirun/srun",
    )
    _mesh_arg(rn)
    rn.add_argument(
        "--steps", type=int, default=1, help="steps of the entry function (state carried)"
    )
    rn.add_argument(
        "-i",
        "--input",
        action="append",
        default=[],
        metavar="FILE",
        help="inputs (.npy named by file stem, .npz, .h5); repeatable",
    )
    rn.add_argument("-o", "--output", metavar="OUT.npz", help="write final state and results")
    rn.add_argument(
        "--backend",
        default="numpy",
        choices=BACKEND_NAMES,
        help="kernel backend: numpy (CPU), cuda or hip (CuPy on the rank's GPU, "
        "chosen by node-local rank); a GPU backend without a GPU is an error",
    )
    rn.add_argument(
        "--gpu-aware-mpi",
        default=None,
        choices=["auto", "yes", "no"],
        help="whether MPI takes device buffers (default: DTM_GPU_AWARE_MPI, else "
        "auto: the MPI vendor's query, then a probe)",
    )
    rn.add_argument(
        "--require-gpu-aware-mpi",
        action="store_true",
        help="refuse to stage device buffers through host memory",
    )
    rn.add_argument(
        "--integrity",
        action="store_true",
        help="payload integrity mode (as DTM_INTEGRITY=1): point-to-point payloads carry their "
        "sender's CRC32C, checked on receipt (io/WIRE.md)",
    )
    rn.add_argument(
        "--audit-every",
        type=int,
        default=None,
        metavar="N",
        help="replica audit (as DTM_AUDIT_EVERY=N): after every N-th step, before every "
        "checkpoint and resize and after the last step, each replicated state tensor's CRC32C is compared across its replicas",
    )
    rn.add_argument(
        "--quantize-allreduce",
        type=int,
        default=None,
        metavar="B",
        help="sum allreduces of 1,024 or more floats as int8 blocks of B with float32 scales "
        "and error feedback (as DTM_QUANT_ALLREDUCE=B; io/WIRE.md: bound); not in deterministic mode",
    )
    rn.add_argument(
        "--max-bytes-per-rank",
        type=byte_count,
        default=None,
        metavar="BYTES",
        help="refuse to run a plan above BYTES of peak memory on any rank",
    )
    _add_training(rn)
    return rn


def _add_training(p: argparse.ArgumentParser) -> None:
    """``--train`` and its pipeline options (``dtm run``, ``dtm explain``):
    :mod:`dtm_mpi.frontend.ir_step`."""
    g = p.add_argument_group(
        "training an IR forward (its parameters the weights, its first result the loss)"
    )
    g.add_argument(
        "--train",
        metavar="OPT",
        default=None,
        help="train the entry function: the reverse pass and OPT's update each step "
        "(sgd:lr=0.05,momentum=0.9 | adam:lr=1e-3 | adamw:lr=1e-3,weight_decay=0.01); "
        "a pp axis in the mesh runs it as pipeline stages",
    )
    g.add_argument(
        "--clip-norm",
        type=float,
        default=None,
        metavar="X",
        help="clip the gradients to global norm X",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=1,
        metavar="M",
        help="microbatches per step (each a call of the forward; needs a pp axis, pp=1: gradient accumulation)",
    )
    g.add_argument(
        "--schedule",
        default="1f1b",
        metavar="NAME",
        help="pipeline schedule: gpipe, 1f1b, interleaved, zb-h1 (default 1f1b)",
    )
    g.add_argument(
        "--chunks", type=int, default=1, metavar="V", help="stages per pipeline rank (interleaved)"
    )
    g.add_argument(
        "--split",
        action="append",
        default=None,
        metavar="VALUE",
        help="start a pipeline stage at the op making VALUE (e.g. %%h2); repeatable; "
        "default: cut evenly by parameter elements",
    )


def _training(args: argparse.Namespace, module: Callable[[], Module]) -> TracedStep | None:
    """The training step ``--train`` asks for, of the IR forward ``module()`` gives (None
    without ``--train``; its pipeline options alone are an error). Its errors depend on the
    command line and the file alone: the same on every rank (agreed)."""
    try:
        return _training_step(args, module)
    except DtmError as exc:
        raise agreed(exc) from None


def _training_step(args: argparse.Namespace, module: Callable[[], Module]) -> TracedStep | None:
    given = [
        name
        for name, on in (
            ("--microbatches", args.microbatches != 1),
            ("--split", bool(args.split)),
            ("--clip-norm", args.clip_norm is not None),
            ("--schedule", args.schedule != "1f1b"),
            ("--chunks", args.chunks != 1),
        )
        if on
    ]
    if args.train is None:
        if given:
            raise UsageError(
                f"{', '.join(given)}: these train the entry function; give --train OPT"
            )
        return None
    from dtm_mpi.frontend.ir_step import IrTraining, ir_train_step, parse_optimizer

    for name, value in (("--microbatches", args.microbatches), ("--chunks", args.chunks)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1; got {value}")
    training = IrTraining(
        parse_optimizer(args.train),
        clip_norm=args.clip_norm,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=args.chunks,
        splits=tuple(args.split) if args.split else None,
    )
    return ir_train_step(module(), training)


def _add_run_policies(rn: argparse.ArgumentParser) -> None:
    """``dtm run``'s checkpoint, progress and resize options (:mod:`dtm_mpi.runtime.policies`)."""
    rn.add_argument(
        "--store",
        metavar="DIR",
        default=None,
        help="checkpoint store: its latest checkpoint fills 'init store' parameters, and it "
        "takes the run's state (--checkpoint-every, --resume; with --sim written by the one process)",
    )
    rn.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="N",
        help="save the state to --store after every N steps",
    )
    rn.add_argument(
        "--resume",
        action="store_true",
        help="start from the newest checkpoint in --store that verifies (saying which "
        "newer ones it skipped and why) and run up to --steps",
    )
    rn.add_argument(
        "--checkpoint-async",
        action="store_true",
        help="write each checkpoint while the next steps run (its hashes taken when the step ends)",
    )
    rn.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="K",
        help="keep only the K newest checkpoints in --store (kept in store.json)",
    )
    rn.add_argument(
        "--quota",
        type=byte_count,
        default=None,
        metavar="BYTES",
        help="refuse a checkpoint that would take --store above BYTES",
    )
    rn.add_argument(
        "--log-every",
        type=int,
        default=None,
        metavar="N",
        help="print the step time and throughput on rank 0 every N steps",
    )
    rn.add_argument(
        "--resize-at",
        action="append",
        default=[],
        metavar="STEP:MESH",
        help="live resize: after step STEP, continue on the mesh bound as MESH (fewer "
        "ranks leave, more are spawned; the state moves in memory); repeatable",
    )
    rn.add_argument(
        "--resize-file",
        default=None,
        metavar="PATH",
        help="live resize on request: when PATH appears, holding a mesh binding (e.g. "
        "dp=1,tp=3), the run resizes to it after the current step and consumes the file",
    )
    rn.set_defaults(func=_cmd_run)


def _add_launch(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # fmt: off
    la = sub.add_parser(
        "launch",
        help="run a 'dtm run' job under mpirun; relaunch it on the slots left when ranks or hosts are lost",
        description="dtm launch [options] -- FILE [dtm run options]: start the job under mpirun; "
        "if it fails, probe the hosts, shrink the first --mesh axis to the slots left, relaunch "
        "with --resume (the newest checkpoint that verifies), at most --max-restarts times. "
        "Exit 75 (stopped on a signal after saving) is passed on for the scheduler to requeue.",
    )
    # fmt: on
    la.add_argument(
        "-n",
        "--ranks",
        type=int,
        default=None,
        help="ranks of the first launch (default: the host file's slots, else the --mesh product)",
    )
    la.add_argument(
        "--hostfile",
        default=None,
        metavar="FILE",
        help="hosts and slots (Open MPI's format); a host that stops answering --probe is dropped",
    )
    la.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="K",
        help="relaunches after failures before giving up (default 3)",
    )
    la.add_argument(
        "--probe",
        default=None,
        metavar="CMD",
        help="command checking that a host is alive, {host} replaced (default: ssh HOST true)",
    )
    la.add_argument(
        "--mpirun",
        default="mpirun",
        metavar="CMD",
        help="the launcher command, as one shell-quoted string (default: mpirun)",
    )
    la.add_argument(
        "--mpirun-args",
        default="",
        metavar="ARGS",
        help="extra mpirun arguments, as one shell-quoted string",
    )
    la.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- FILE [run options]")
    la.set_defaults(func=_cmd_launch)


def _resizes(args: argparse.Namespace) -> tuple[tuple[int, dict[str, int]], ...]:
    from dtm_mpi.runtime.request import parse_resize

    try:
        return tuple(parse_resize(text) for text in args.resize_at)
    except UsageError as exc:  # decided from the command line: the same on every rank
        raise agreed(exc) from None


def _binding(args: argparse.Namespace) -> dict[str, int] | None:
    from dtm_mpi.sharding.mesh import parse_mesh_binding

    try:
        return parse_mesh_binding(args.mesh) if args.mesh else None
    except UsageError as exc:  # decided from the command line: the same on every rank
        raise agreed(exc) from None


def _plan(module: Module, nranks: int | None, binding: dict[str, int] | None) -> ExecPlan:
    from dtm_mpi.ir.verify import function_mesh
    from dtm_mpi.plan.program import compile_plan, mesh_for

    if nranks is None:
        entry = module.entry
        mesh = function_mesh(module, entry) if entry is not None else None
        sizes = dict(mesh.axes) if mesh is not None else {}
        sizes.update(binding or {})
        nranks = 1
        for s in sizes.values():
            nranks *= s
        binding = sizes if mesh is not None else None
    if nranks < 1:
        raise UsageError(f"the number of ranks must be >= 1; got {nranks}")
    return compile_plan(module, mesh_for(module, nranks, binding))


def _cmd_explain(args: argparse.Namespace) -> int:
    from dtm_mpi.plan.explain import check_memory, explain_text
    from dtm_mpi.runtime.request import load_module

    if args.file.endswith(".py"):
        return _explain_script(args.file, args.script_args)
    if args.script_args:
        raise UsageError(
            f"unexpected arguments {' '.join(args.script_args)} (FILE is not a .py script)"
        )
    module = load_module(args.file)
    step = _training(args, lambda: module)
    if step is not None and step.pipeline is not None:
        from dtm_mpi.frontend.fit import explain_fit

        sys.stdout.write(explain_fit(step, _binding(args), args.ranks))
        return 0
    plan = _plan(step.module if step is not None else module, args.ranks, _binding(args))
    sys.stdout.write(explain_text(plan))
    if args.backend != "numpy":
        from dtm_mpi.runtime.placement import placement_text

        sys.stdout.write("\n" + placement_text(plan, args.backend))
    if args.max_bytes_per_rank is not None:
        check_memory(plan, args.max_bytes_per_rank)
    return 0


def _explain_script(path: str, argv: Sequence[str]) -> int:
    """``dtm explain SCRIPT.py -- ARGS``: run the script with ``DTM_EXPLAIN=1``, so that its
    first :func:`~dtm_mpi.frontend.fit.fit` prints the plan of its run and ends it."""
    import os
    import runpy

    from dtm_mpi.config import switch_on

    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such script")
    switch_on("explain")
    saved = sys.argv
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    finally:
        sys.argv = saved
    raise UsageError(f"{path} ended without calling fit(): nothing to explain")


def runs_under_mpi(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for ``dtm run`` (or ``dtm generate``) on the ranks of
    mpirun/srun (not ``--sim``)."""
    words = [a for a in argv if not a.startswith("-")]
    return (
        bool(words)
        and words[0] in ("run", "generate")
        and not any(a.startswith("--sim") for a in argv)
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from dtm_mpi.runtime.policies import (
        DevicePolicy,
        checkpoint_policy,
        progress_policy,
        resize_policy,
        run_settings,
    )
    from dtm_mpi.runtime.request import RunRequest
    from dtm_mpi.runtime.runner import run_request

    run_settings(
        integrity=args.integrity,
        audit_every=args.audit_every,
        quantize_allreduce=args.quantize_allreduce,
        cli=True,
    )

    def request() -> RunRequest:
        from dtm_mpi.runtime.request import load_module

        step = _training(args, lambda: load_module(args.file))
        checkpoint = checkpoint_policy(
            args.store,
            every=args.checkpoint_every,
            resume=args.resume,
            background=args.checkpoint_async,
            keep_last=args.keep_last,
            quota=args.quota,
        )
        device = DevicePolicy(
            args.backend,
            args.gpu_aware_mpi,
            args.require_gpu_aware_mpi,
            args.max_bytes_per_rank,
        )
        return RunRequest(
            args.file,
            binding=_binding(args),
            inputs=tuple(args.input),
            output=args.output,
            steps=args.steps,
            sim=args.sim,
            device=device,
            checkpoint=checkpoint,
            resize=resize_policy(
                _resizes(args), args.resize_file, relaunch=("-m", "dtm_mpi", *sys.argv[1:])
            ),
            progress=progress_policy(args.log_every),
            module=step.module if step is not None else None,
            pipeline=step.pipeline if step is not None else None,
        )

    return run_request(request, args.sim)


def _cmd_launch(args: argparse.Namespace) -> int:
    import shlex

    from dtm_mpi.runtime.elastic import DEFAULT_PROBE, launch_elastic

    run_args = list(args.run_args)
    if run_args[:1] == ["--"]:
        run_args = run_args[1:]
    if not run_args:
        raise UsageError(
            "dtm launch needs the run's arguments after --: dtm launch [options] -- FILE [run options]"
        )
    return launch_elastic(
        run_args,
        ranks=args.ranks,
        hostfile=args.hostfile,
        max_restarts=args.max_restarts,
        probe=args.probe or DEFAULT_PROBE,
        mpirun=shlex.split(args.mpirun),
        mpirun_args=shlex.split(args.mpirun_args),
    )
