"""``dtm task plan|run``: task graphs over a tensor store (io/TASKS.md); thin, over
:mod:`dtm_mpi.io.task_graph`, :mod:`dtm_mpi.runtime.task_run`."""

from __future__ import annotations

import argparse

from dtm_mpi.cli_exec import byte_count

__all__ = ["add_task_commands"]


def add_task_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    task = sub.add_parser("task", help="plan and run task graphs over a tensor store")
    parser_class = type(task)  # the CLI's parser: errors are UsageError (exit 2)
    tsub = task.add_subparsers(dest="task_command", metavar="COMMAND", parser_class=parser_class)
    tsub.required = True
    plan = tsub.add_parser(
        "plan", help="the order and placement of a graph's tasks, their memory and traffic"
    )
    plan.add_argument("graph", metavar="GRAPH")
    plan.add_argument("--ranks", type=int, default=1, help="the job's ranks (default 1)")
    _capacity(plan)
    plan.add_argument(
        "--devices", type=int, default=0, help="accelerators per rank the plan may use (default 0)"
    )
    plan.set_defaults(func=_cmd_plan)
    run = tsub.add_parser(
        "run",
        help="run a graph's tasks on the ranks of mpirun/srun; a task whose program and "
        "inputs are unchanged and whose outputs are stored is skipped",
    )
    run.add_argument("graph", metavar="GRAPH")
    _capacity(run)
    run.add_argument(
        "--rerun", action="store_true", help="run every task, whatever the store holds"
    )
    run.set_defaults(func=_cmd_run)


def _capacity(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--capacity",
        type=byte_count,
        default=None,
        metavar="BYTES",
        help="memory per rank a task may plan for (e.g. 8G); a task over it fits nowhere",
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from dtm_mpi.console import say
    from dtm_mpi.errors import UsageError
    from dtm_mpi.io.task_graph import parse_task_graph
    from dtm_mpi.plan.task_plan import task_plan_text
    from dtm_mpi.runtime.task_run import plan_task_graph

    if args.ranks < 1 or args.devices < 0:
        raise UsageError(
            f"--ranks must be >= 1 and --devices >= 0; got {args.ranks}, {args.devices}"
        )
    graph = parse_task_graph(args.graph)
    _, plan = plan_task_graph(
        graph, job_ranks=args.ranks, capacity=args.capacity, devices=args.devices
    )
    say(task_plan_text(plan).rstrip("\n"))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from dtm_mpi.io.task_graph import parse_task_graph
    from dtm_mpi.runtime.task_run import run_task_graph

    return run_task_graph(parse_task_graph(args.graph), capacity=args.capacity, rerun=args.rerun)
