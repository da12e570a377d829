"""``dtm explain`` and ``dtm run``: argument handling; planning and running live below."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from dtm_mpi.errors import UsageError

if TYPE_CHECKING:
    from dtm_mpi.ir.nodes import Module
    from dtm_mpi.plan.program import ExecPlan

__all__ = ["add_exec_commands"]


def _mesh_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mesh", metavar="AXIS=N,...",
        help="bind mesh axis sizes (e.g. dp=2,tp=2); default: every rank on the first axis",
    )  # fmt: skip


def byte_count(text: str) -> int:
    """``512``, ``64K``, ``1.5G``, ``2GiB``: a non-negative, finite number of bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in units else t
    try:
        value = float(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 512M, 2G)") from None
    if not 0 <= value < 2**63:  # also refuses inf and nan
        raise argparse.ArgumentTypeError(f"byte count must be a finite number >= 0; got {text!r}")
    return int(value)


def add_exec_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ex = sub.add_parser("explain", help="per-op local shapes, communication, bytes, memory")
    ex.add_argument("file", metavar="FILE")
    ex.add_argument("-n", "--ranks", type=int, default=None,
                    help="number of ranks (default: the product of --mesh, else the declared mesh)")  # fmt: skip
    _mesh_arg(ex)
    ex.add_argument("--max-bytes-per-rank", type=byte_count, default=None, metavar="BYTES",
                    help="refuse a plan whose peak memory on any rank is above BYTES")  # fmt: skip
    ex.add_argument("--backend", default="numpy", choices=["numpy", "cuda", "hip"],
                    help="also show where each op runs on this GPU backend (needs no GPU)")  # fmt: skip
    ex.set_defaults(func=_cmd_explain)

    rn = sub.add_parser("run", help="run the entry function (--sim N: N simulated ranks)")
    rn.add_argument("file", metavar="FILE")
    rn.add_argument("--sim", type=int, metavar="N", default=None,
                    help="run N simulated ranks in this process (debugging); without --sim, "
                    "run on the ranks of mpirun/srun")  # fmt: skip
    _mesh_arg(rn)
    rn.add_argument(
        "--steps", type=int, default=1, help="steps of the entry function (state carried)"
    )
    rn.add_argument("-i", "--input", action="append", default=[], metavar="FILE",
                    help="inputs (.npy named by file stem, .npz, .h5); repeatable")  # fmt: skip
    rn.add_argument("-o", "--output", metavar="OUT.npz", help="write final state and results")
    rn.add_argument("--backend", default="numpy", choices=["numpy", "cuda", "hip"],
                    help="kernel backend: numpy (CPU), cuda or hip (CuPy on the rank's GPU, "
                    "chosen by node-local rank); a GPU backend without a GPU is an error")  # fmt: skip
    rn.add_argument("--gpu-aware-mpi", default=None, choices=["auto", "yes", "no"],
                    help="whether MPI takes device buffers (default: DTM_GPU_AWARE_MPI, else "
                    "auto: the MPI vendor's query, then a probe)")  # fmt: skip
    rn.add_argument("--require-gpu-aware-mpi", action="store_true",
                    help="refuse to stage device buffers through host memory")  # fmt: skip
    rn.add_argument("--max-bytes-per-rank", type=byte_count, default=None, metavar="BYTES",
                    help="refuse to run a plan above BYTES of peak memory on any rank")  # fmt: skip
    rn.add_argument("--store", metavar="DIR", default=None,
                    help="checkpoint store for the run's state (parallel HDF5; under mpirun)")  # fmt: skip
    rn.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                    help="save the state to --store after every N steps")  # fmt: skip
    rn.add_argument("--resume", action="store_true",
                    help="start from the latest checkpoint in --store and run up to --steps")  # fmt: skip
    rn.set_defaults(func=_cmd_run)


def _binding(args: argparse.Namespace) -> dict[str, int] | None:
    from dtm_mpi.sharding.mesh import parse_mesh_binding

    return parse_mesh_binding(args.mesh) if args.mesh else None


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
    from dtm_mpi.cli import load_checked
    from dtm_mpi.plan.explain import check_memory, explain_text

    plan = _plan(load_checked(args.file), args.ranks, _binding(args))
    sys.stdout.write(explain_text(plan))
    if args.backend != "numpy":
        from dtm_mpi.runtime.placement import placement_text

        sys.stdout.write("\n" + placement_text(plan, args.backend))
    if args.max_bytes_per_rank is not None:
        check_memory(plan, args.max_bytes_per_rank)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from dtm_mpi.cli import load_checked
    from dtm_mpi.config import get_config
    from dtm_mpi.io.arrays import check_output_path, load_arrays, save_npz
    from dtm_mpi.plan.explain import check_memory
    from dtm_mpi.runtime.session import run_simulated, summary_lines

    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1; got {args.steps}")
    if (args.checkpoint_every is not None or args.resume) and not args.store:
        raise UsageError("--checkpoint-every and --resume need --store DIR")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every must be >= 1; got {args.checkpoint_every}")
    if args.resume and args.input:
        raise UsageError("--resume takes the state from the checkpoint; do not give -i inputs")
    if args.backend == "numpy" and (args.require_gpu_aware_mpi or args.gpu_aware_mpi):
        raise UsageError("--gpu-aware-mpi and --require-gpu-aware-mpi need --backend cuda or hip")  # fmt: skip
    if args.sim is None:
        from dtm_mpi.runtime.mpirun import MpiRunArgs, run_under_mpi

        if args.output:
            check_output_path(args.output)  # the same answer on every rank, before any work

        return run_under_mpi(
            MpiRunArgs(
                args.file,
                _binding(args),
                tuple(args.input),
                args.output,
                args.steps,
                args.backend,
                args.max_bytes_per_rank,
                args.store,
                args.checkpoint_every,
                args.resume,
                args.gpu_aware_mpi,
                args.require_gpu_aware_mpi,
            )
        )
    if args.backend != "numpy":
        raise UsageError(
            f"the simulator (--sim) runs the numpy backend only; run --backend {args.backend} "
            "under mpirun/srun (one rank per GPU)"
        )
    if args.store:
        raise UsageError("--store needs the MPI runtime (run under mpirun/srun, without --sim)")
    if args.output:
        check_output_path(args.output)  # refused before any work
    module = load_checked(args.file)
    binding = _binding(args)
    inputs = load_arrays(args.input)
    if args.max_bytes_per_rank is not None:
        check_memory(_plan(module, args.sim, binding), args.max_bytes_per_rank)
    result = run_simulated(
        module, args.sim, binding=binding, inputs=inputs, steps=args.steps,
        backend=args.backend, timeout_s=get_config().timeout_s,
    )  # fmt: skip
    outputs = result.outputs()
    for line in summary_lines(outputs):
        print(line)
    if args.output:
        save_npz(args.output, outputs)
        print(f"wrote {args.output}")
    return 0
