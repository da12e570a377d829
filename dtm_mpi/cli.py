"""The ``dtm`` command line: argument parsing only; the work is done by the layers below.

Exit codes: 0 success, 1 a dtm error (diagnostics, failed checks, runtime failures), 2 bad
usage or an unreadable input file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtm_mpi._version import __version__
from dtm_mpi.cli_data import add_data_commands
from dtm_mpi.cli_exec import add_exec_commands, runs_under_mpi
from dtm_mpi.cli_generate import add_generate_command
from dtm_mpi.cli_hf import add_hf_commands
from dtm_mpi.cli_plot import add_plot_commands
from dtm_mpi.cli_store import add_store_commands
from dtm_mpi.cli_task import add_task_commands
from dtm_mpi.comm.abort import run_or_abort
from dtm_mpi.errors import DiagnosticError, UsageError, agreed
from dtm_mpi.kernels.backends import BACKEND_NAMES

if TYPE_CHECKING:
    from dtm_mpi.ir.nodes import Module

__all__ = ["build_parser", "main", "run"]


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --si is not --sim: options are spelled out
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        # decided from the command line alone: the same on every rank (no rank aborts the job)
        where = "" if self.prog == "dtm" else f"{self.prog}: "  # the line starts "dtm: error:"
        raise agreed(UsageError(f"{where}{message}"))


def build_parser() -> argparse.ArgumentParser:
    """The ``dtm`` parser: each group of subcommands is added by its module's
    ``add_*_commands(sub)`` (the one way to register a subcommand: ``set_defaults(func=...)``
    names the function that runs it)."""
    parser = _Parser(prog="dtm", description="Distributed Tensor Machine on MPI (dtm_mpi).")
    parser.add_argument("--version", action="version", version=f"dtm_mpi {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add_commands in COMMANDS:
        add_commands(sub)
    return parser


def add_ir_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    check = sub.add_parser("check", help="parse and verify IR files; diagnostics as file:line:col")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(func=_cmd_check)
    fmt = sub.add_parser("fmt", help="print the canonical form of an IR file")
    fmt.add_argument("file", metavar="FILE")
    fmt.add_argument("--check", action="store_true", help="exit 1 if FILE is not canonical")
    fmt.add_argument("-w", "--write", action="store_true", help="rewrite FILE in place")
    fmt.set_defaults(func=_cmd_fmt)
    hsh = sub.add_parser("hash", help="print the module hash of an IR file")
    hsh.add_argument("file", metavar="FILE")
    hsh.set_defaults(func=_cmd_hash)
    grad = sub.add_parser(
        "grad", help="add the reverse-mode gradient of a function; print the module"
    )
    grad.add_argument("file", metavar="FILE")
    grad.add_argument(
        "--wrt",
        required=True,
        metavar="P[,P...]",
        help="the parameters to differentiate with respect to",
    )
    grad.add_argument(
        "--function", metavar="NAME", help="the function (default: the entry function)"
    )
    grad.add_argument(
        "--loss",
        type=int,
        default=0,
        metavar="N",
        help="which result is the loss (a float scalar; default 0)",
    )
    grad.add_argument(
        "-o", "--output", metavar="OUT", help="write the module to OUT instead of stdout"
    )
    grad.set_defaults(func=_cmd_grad)


def add_bench_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="suite", metavar="SUITE", parser_class=_Parser)
    bsub.required = True
    bir = bsub.add_parser("ir", help="parse+verify+hash time of a generated large module")
    bir.add_argument("--ops", type=int, default=100_000, help="ops in the generated module")
    bir.add_argument("--repeat", type=int, default=3, help="runs; the best is reported")
    bir.set_defaults(func=_cmd_bench_ir)
    btk = bsub.add_parser(
        "tasks", help="task graph planner time on random graphs (per 1,000 tasks)"
    )
    btk.add_argument("--tasks", default="1000,10000", help="comma-separated graph sizes")
    btk.add_argument("--repeat", type=int, default=5, help="plans per size; the best is reported")
    btk.set_defaults(func=_cmd_bench_tasks)
    bfe = bsub.add_parser(
        "frontend", help="frontend: GPT trace+autodiff time; generated MLP step vs numpy"
    )
    bfe.add_argument("--layers", type=int, default=12, help="transformer blocks of the traced GPT")
    bfe.add_argument("--repeat", type=int, default=3, help="traces; the best is reported")
    bfe.add_argument("--steps", type=int, default=5, help="timed training steps of each side")
    bfe.set_defaults(func=_cmd_bench_frontend)
    bcomm = bsub.add_parser(
        "comm", help="collectives: dtm_mpi vs raw mpi4py on the same buffers (under mpirun)"
    )
    bcomm.add_argument(
        "--ops",
        default="allreduce,allgather,reduce_scatter,broadcast,all_to_all",
        help="comma-separated ops",
    )
    bcomm.add_argument(
        "--sizes", default=None, help="comma-separated sizes (8,64K,1M); default 8 B..64 MiB"
    )
    bcomm.add_argument(
        "--repeat", type=int, default=30, help="alternating rounds; the best block is reported"
    )
    bcomm.add_argument("--csv", default=None, metavar="FILE", help="write one row per (op, bytes)")
    bcomm.add_argument(
        "--backend",
        default="numpy",
        choices=BACKEND_NAMES,
        help="buffers: host (numpy) or device arrays on each rank's GPU",
    )
    bcomm.add_argument(
        "--integrity",
        action="store_true",
        help="also time dtm's path in payload integrity mode (DTM_INTEGRITY) and its cost",
    )
    bcomm.add_argument(
        "--quantize",
        type=int,
        default=0,
        metavar="B",
        help="also time allreduce and allgather quantized in int8 blocks of B "
        "(DTM_QUANT_ALLREDUCE) and their effective bandwidth against float32's",
    )
    bcomm.set_defaults(func=_cmd_bench_comm)
    bpp = bsub.add_parser(
        "pipeline",
        help="pipelined GPT training per schedule: step time, measured vs predicted bubble, activation memory (under mpirun)",
    )
    bpp.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb-h1", help="comma-separated")
    bpp.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    bpp.add_argument("--steps", type=int, default=5, help="timed steps per schedule")
    bpp.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    bpp.add_argument("--layers", type=int, default=8, help="transformer blocks (split evenly)")
    bpp.add_argument("--dim", type=int, default=128, help="model width")
    bpp.add_argument("--batch", type=int, default=32, help="sequences per step")
    bpp.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    bpp.add_argument("--csv", default=None, metavar="FILE", help="write one row per schedule")
    bpp.add_argument(
        "--no-torch", action="store_true", help="without torch.distributed.pipelining beside"
    )
    bpp.set_defaults(func=_cmd_bench_pipeline)
    _add_bench_suites(bsub)


def _add_bench_suites(bsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The checkpoint, training, op and kernel benchmarks of ``dtm bench``."""
    bck = bsub.add_parser(
        "ckpt", help="checkpoint save/restore vs plain file writes and reads (under mpirun)"
    )
    bck.add_argument("--bytes", default="1G", help="state size in all (e.g. 256M, 1G)")
    bck.add_argument("--tensors", type=int, default=4, help="tensors the state is split into")
    bck.add_argument("--dir", default=None, help="directory on the file system to measure")
    bck.add_argument(
        "--repeat", type=int, default=4, help="rounds (write order alternates); best reported"
    )
    bck.add_argument("--csv", default=None, metavar="FILE", help="rows metric,value,baseline,ratio")
    bck.add_argument(
        "--ranks-per-file",
        default=None,
        metavar="G",
        help="ranks sharing a data file: an integer >= 1 or 'all' (default: DTM_CKPT_RANKS_PER_FILE, else 1)",
    )
    bck.add_argument(
        "--cold",
        action="store_true",
        help="also time restores from storage: drop the page cache before each read (root)",
    )
    bck.set_defaults(func=_cmd_bench_ckpt)
    bca = bsub.add_parser(
        "ckpt-async",
        help="the training loop without, with synchronous and with async checkpoints (under mpirun)",
    )
    bca.add_argument("--batch", type=int, default=256, help="rows of each step's batch")
    bca.add_argument("--width", type=int, default=1024, help="the MLP's input and output width")
    bca.add_argument(
        "--hidden", type=int, default=4096, help="the MLP's hidden width (split over the ranks)"
    )
    bca.add_argument("--steps", type=int, default=9, help="steps of each loop")
    bca.add_argument("--every", type=int, default=2, help="a checkpoint every N steps")
    bca.add_argument("--dir", default=None, help="directory on the file system to measure")
    bca.add_argument(
        "--repeat", type=int, default=3, help="loops per mode (alternating); best reported"
    )
    bca.set_defaults(func=_cmd_bench_ckpt_async)
    btr = bsub.add_parser(
        "train",
        help="whole training steps: dtm at 1, 2 (4) ranks vs the numpy floor and PyTorch (starts mpirun)",
    )
    btr.add_argument("--models", default="digits,gpt,mlp", help="comma-separated: digits, gpt, mlp")
    btr.add_argument("--ranks", default="1,2", help="comma-separated rank counts (1 is always run)")
    btr.add_argument("--steps", type=int, default=8, help="timed steps per run")
    btr.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    btr.add_argument(
        "--rounds", type=int, default=2, help="runs of every configuration; best median reported"
    )
    btr.add_argument("--csv", default=None, metavar="FILE", help="one row per configuration")
    btr.add_argument("--plot", default=None, metavar="PNG", help="bar chart of the step times")
    btr.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    btr.add_argument(
        "--deterministic",
        action="store_true",
        help="also dtm at 1 rank in deterministic mode, full and fast matmul",
    )
    btr.add_argument(
        "--overlap",
        action="store_true",
        help="also every dtm configuration with dp > 1 under DTM_OVERLAP=1 (side by side)",
    )
    btr.add_argument("--mpirun", default="mpirun", help="the launcher command (split on spaces)")
    btr.set_defaults(func=_cmd_bench_train)
    bops = bsub.add_parser(
        "ops", help="executor overhead per op: a chain of tiny elementwise ops vs numpy"
    )
    bops.add_argument("--ops", type=int, default=1000, help="ops in the chain")
    bops.add_argument("--sizes", default="8,1024,65536", help="comma-separated element counts")
    bops.add_argument("--repeat", type=int, default=30, help="runs of each; the best is reported")
    bops.set_defaults(func=_cmd_bench_ops)
    bgen = bsub.add_parser(
        "generate", help="greedy decoding: dtm at 1 and 2 ranks vs transformers' generate (CPU)"
    )
    bgen.add_argument("--layers", type=int, default=4, help="decoder layers of the random Llama")
    bgen.add_argument("--hidden", type=int, default=256, help="hidden size (heads: hidden / 64)")
    bgen.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    bgen.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    bgen.add_argument("--new", type=int, default=64, help="new tokens per run")
    bgen.add_argument("--repeat", type=int, default=3, help="runs of each side; best reported")
    bgen.add_argument("--ranks", default="1,2", help="dtm rank counts (tp) and torch threads")
    bgen.add_argument("--no-torch", action="store_true", help="without transformers beside")
    bgen.add_argument("--mpirun", default="mpirun", help="the launcher command (split on spaces)")
    bgen.set_defaults(func=_cmd_bench_generate)
    brc = bsub.add_parser(
        "recipe",
        help="the LLM recipe's switches on one rank (bf16, recomputation) vs PyTorch on the same Llama",
    )
    brc.add_argument("--layers", type=int, default=4, help="decoder layers of the random Llama")
    brc.add_argument("--hidden", type=int, default=128, help="hidden size (heads: hidden / 32)")
    brc.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    brc.add_argument("--batch", type=int, default=8, help="sequences per step")
    brc.add_argument("--context", type=int, default=128, help="tokens per sequence")
    brc.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    brc.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    brc.add_argument("--no-torch", action="store_true", help="without PyTorch beside")
    brc.add_argument(
        "--curve",
        type=int,
        default=None,
        metavar="STEPS",
        help="instead: the whole recipe trained STEPS steps by dtm and by PyTorch from the same "
        "weights on the same tokens; both validation losses and wall times",
    )
    brc.set_defaults(func=_cmd_bench_recipe)
    bk = bsub.add_parser("kernels", help="GPU RawKernels vs a device copy and vs composed CuPy")
    bk.add_argument("--backend", default="cuda", choices=["cuda", "hip"], help="GPU backend")
    bk.add_argument("--rows", type=int, default=16384, help="rows of each [rows, cols] case")
    bk.add_argument("--cols", type=int, default=4096, help="columns (the normalised dim)")
    bk.add_argument("--dtypes", default="f32,f16", help="comma-separated: f16, f32, f64")
    bk.add_argument("--repeat", type=int, default=5, help="timed blocks; the best is reported")
    bk.add_argument("--csv", default=None, metavar="FILE", help="rows metric,value,baseline,ratio")
    bk.set_defaults(func=_cmd_bench_kernels)


def add_conformance_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    conf = sub.add_parser(
        "conformance",
        help="run the conformance cases (io/vectors and the runtime); print the claim matrix",
    )
    conf.add_argument(
        "--level", default="L0,L1,L2,L3,GPU", help="comma-separated levels (L0..L3, GPU)"
    )
    conf.add_argument("--vectors", default=None, metavar="DIR", help="default: io/vectors")
    conf.add_argument("-v", "--verbose", action="store_true", help="list every case")
    conf.add_argument("--json", action="store_true", help="every case as JSON lines")
    conf.set_defaults(func=_cmd_conformance)


def _cmd_conformance(args: argparse.Namespace) -> int:
    import json

    from dtm_mpi.conformance import Level, matrix_text, run_conformance

    try:
        levels = [Level(x.strip().upper()) for x in args.level.split(",") if x.strip()]
    except ValueError:
        raise UsageError(
            f"--level: comma-separated L0, L1, L2, L3, GPU; got {args.level!r}"
        ) from None
    from dtm_mpi.comm.handles import world_comm

    world = world_comm()  # one process alone: a world of 1 (the MPI cases say they need more)
    results = run_conformance(
        levels, vectors=Path(args.vectors) if args.vectors else None, world=world
    )
    if int(world.Get_rank()) == 0:
        if args.json:
            for r in results:
                print(
                    json.dumps(
                        {"level": r.level.value, "case": r.name, "ok": r.ok, "detail": r.detail}
                    )
                )
        else:
            print(matrix_text(results, verbose=args.verbose))
    return 1 if any(r.ok is False for r in results) else 0


def add_info_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    info = sub.add_parser(
        "info", help="report the runtime: MPI, parallel HDF5, ranks (collective), the GEMM choice"
    )
    info.add_argument(
        "--gemm-probe",
        action="store_true",
        help="measure the GEMM providers again (else this machine's cached measurement)",
    )
    info.set_defaults(func=_cmd_info)


#: Every group of subcommands, in the order ``dtm --help`` lists them.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (  # type: ignore[type-arg]
    add_ir_commands,
    add_bench_commands,
    add_info_command,
    add_exec_commands,
    add_store_commands,
    add_task_commands,
    add_hf_commands,
    add_data_commands,
    add_plot_commands,
    add_generate_command,
    add_conformance_command,
)


def _print_diagnostics(errors: Sequence[DiagnosticError]) -> None:
    for err in errors:
        print(err, file=sys.stderr)


def _cmd_check(args: argparse.Namespace) -> int:
    from dtm_mpi.ir import check_text
    from dtm_mpi.ir.source_files import read_source

    texts = [(path, read_source(path)) for path in args.files]
    failed = 0
    for path, text in texts:
        _, errors = check_text(text, path)
        _print_diagnostics(errors)
        failed += bool(errors)
    if failed:
        print(f"dtm check: {failed} of {len(texts)} file(s) have errors", file=sys.stderr)
        return 1
    return 0


def _load(path: str) -> Module:
    from dtm_mpi.runtime.request import load_module

    return load_module(path)


def _cmd_fmt(args: argparse.Namespace) -> int:
    from dtm_mpi.ir import print_module
    from dtm_mpi.ir.source_files import read_source

    original = read_source(args.file)
    text = print_module(_load(args.file))
    if args.check:
        if text != original:
            print(
                f"{args.file}: not in canonical form (run 'dtm fmt -w {args.file}')",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.write:
        if text != original:
            Path(args.file).write_text(text, encoding="utf-8")
        return 0
    sys.stdout.write(text)
    return 0


def _cmd_hash(args: argparse.Namespace) -> int:
    from dtm_mpi.ir import module_hash

    print(module_hash(_load(args.file)))
    return 0


def _cmd_grad(args: argparse.Namespace) -> int:
    from dtm_mpi.errors import GradientError
    from dtm_mpi.ir import print_module
    from dtm_mpi.ir.autodiff import grad_module
    from dtm_mpi.ir.source_files import read_source

    module = _load(args.file)
    name = args.function or (module.entry.name if module.entry is not None else "")
    wrt = [w.strip() for w in args.wrt.split(",") if w.strip()]
    if not wrt:
        raise UsageError("--wrt: name at least one parameter")
    try:
        text = print_module(grad_module(module, name, wrt, loss=args.loss))
    except GradientError as err:
        lines = read_source(args.file).splitlines()
        if 0 < err.span.line <= len(lines) and err.source_line is None:
            err.with_source(lines[err.span.line - 1])
        _print_diagnostics([err])
        return 1
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _cmd_bench_frontend(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.frontend import run_frontend_bench

    for key in ("layers", "repeat", "steps"):
        if getattr(args, key) < 1:
            raise UsageError(f"--{key} must be >= 1; got {getattr(args, key)}")
    print(run_frontend_bench(layers=args.layers, repeat=args.repeat, steps=args.steps))
    return 0


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what} takes comma-separated integers; got {text!r}") from None


def _cmd_bench_train(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.train import run_train_bench

    report, _ = run_train_bench(
        models=[m.strip() for m in args.models.split(",") if m.strip()],
        ranks=_int_list(args.ranks, "ranks"),
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        csv_path=args.csv,
        plot_path=args.plot,
        torch=not args.no_torch,
        mpirun=args.mpirun.split(),
        deterministic=args.deterministic,
        overlap=args.overlap,
    )
    print(report)
    return 0


def _cmd_bench_ops(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.ops import run_ops_bench

    sizes = _int_list(args.sizes, "sizes")
    if args.ops < 1 or args.repeat < 1 or not sizes or min(sizes) < 1:
        raise UsageError("need --ops >= 1, --repeat >= 1 and sizes >= 1")
    print(run_ops_bench(args.ops, sizes, args.repeat))
    return 0


def _cmd_bench_ir(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.ir import run_ir_bench

    print(run_ir_bench(ops=args.ops, repeat=args.repeat))
    return 0


def _cmd_bench_tasks(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.tasks import run_tasks_bench

    try:
        sizes = [int(x) for x in args.tasks.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--tasks: comma-separated integers; got {args.tasks!r}") from None
    print(run_tasks_bench(sizes, args.repeat))
    return 0


def _cmd_bench_ckpt(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.ckpt import run_ckpt_bench
    from dtm_mpi.units import parse_bytes, parse_ranks_per_file

    per_file = None
    if args.ranks_per_file is not None:
        try:
            per_file = parse_ranks_per_file(str(args.ranks_per_file))
        except UsageError as exc:
            raise UsageError(f"--ranks-per-file: {exc}") from None
    table = run_ckpt_bench(
        parse_bytes(args.bytes), args.tensors, args.dir, args.repeat, args.csv, per_file, args.cold
    )
    if table:
        print(table)
    return 0


def _cmd_bench_ckpt_async(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.ckpt import run_ckpt_async_bench

    table = run_ckpt_async_bench(
        args.batch, args.width, args.hidden, args.steps, args.every, args.dir, args.repeat
    )
    if table:
        print(table)
    return 0


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.kernels import run_kernel_bench

    dtypes = tuple(x.strip() for x in args.dtypes.split(",") if x.strip())
    bad = [d for d in dtypes if d not in ("f16", "f32", "f64")]
    if bad or not dtypes or args.rows < 1 or args.cols < 32 or args.cols % 32 or args.repeat < 1:
        raise UsageError(
            "need --dtypes from f16,f32,f64, --rows >= 1, --cols a multiple of 32, --repeat >= 1"
        )
    print(run_kernel_bench(args.backend, args.rows, args.cols, dtypes, args.repeat, args.csv))
    return 0


def _cmd_bench_comm(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.comm import run_comm_bench
    from dtm_mpi.units import parse_bytes

    sizes = [parse_bytes(x) for x in args.sizes.split(",")] if args.sizes else None
    ops = [x.strip() for x in args.ops.split(",") if x.strip()]
    table = run_comm_bench(
        ops,
        sizes,
        repeat=args.repeat,
        csv_path=args.csv,
        backend=args.backend,
        integrity=args.integrity,
        quantize=args.quantize,
    )
    if table:
        print(table)
    return 0


def _cmd_bench_pipeline(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.pipeline import run_pipeline_bench

    table = run_pipeline_bench(
        [x.strip() for x in args.schedules.split(",") if x.strip()],
        microbatches=args.microbatches,
        steps=args.steps,
        warmup=args.warmup,
        layers=args.layers,
        dim=args.dim,
        batch=args.batch,
        seq=args.seq,
        csv_path=args.csv,
        with_torch=not args.no_torch,
    )
    if table:
        print(table)
    return 0


def _cmd_bench_recipe(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.recipe import run_recipe_bench, run_recipe_curve

    if args.curve is not None:
        print(run_recipe_curve(args.curve), end="")
        return 0

    print(
        run_recipe_bench(
            layers=args.layers,
            hidden=args.hidden,
            vocab=args.vocab,
            batch=args.batch,
            context=args.context,
            steps=args.steps,
            warmup=args.warmup,
            with_torch=not args.no_torch,
        ),
        end="",
    )
    return 0


def _cmd_bench_generate(args: argparse.Namespace) -> int:
    from dtm_mpi.bench.generate import run_generate_bench

    print(
        run_generate_bench(
            layers=args.layers,
            hidden=args.hidden,
            vocab=args.vocab,
            prompt=args.prompt,
            new=args.new,
            repeat=args.repeat,
            ranks=tuple(int(x) for x in args.ranks.split(",") if x.strip()),
            with_torch=not args.no_torch,
            mpirun=args.mpirun,
        )
    )
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from dtm_mpi.comm.world import describe_world
    from dtm_mpi.config import get_config
    from dtm_mpi.kernels.gemm import describe_gemm

    report = describe_world()
    if report:
        print(report)
        print(describe_gemm(get_config().gemm, refresh=args.gemm_probe))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; raises :class:`~dtm_mpi.errors.DtmError`."""
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(words)
    except UsageError as exc:
        if runs_under_mpi(words):  # every rank of the job decides before any rank exits
            from dtm_mpi.runtime.mpirun import run_under_mpi

            refusal = exc

            def refused() -> Any:
                raise refusal

            return run_under_mpi(refused)  # raises this error, agreed
        raise
    code: int = args.func(args)
    return code


def run(argv: Sequence[str] | None = None) -> int:
    """The console entry point: errors become exit codes (and abort the job under MPI)."""
    return run_or_abort(lambda: main(argv))


if __name__ == "__main__":
    sys.exit(run())
