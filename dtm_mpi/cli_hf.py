"""``dtm hf import|export|check``: Hugging Face checkpoints into and out of a store, and the
parity of a model directory with transformers; thin, over :mod:`dtm_mpi.frontend.hf_store`
and :mod:`dtm_mpi.frontend.hf_check`."""

from __future__ import annotations

import argparse
from pathlib import Path

from dtm_mpi.cli_exec import byte_count
from dtm_mpi.cli_store import _strict_arg
from dtm_mpi.errors import UsageError, agreed

__all__ = ["add_hf_commands"]


def add_hf_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    hf = sub.add_parser(
        "hf", help="Hugging Face checkpoints: import into a store, export from one, check parity"
    )
    parser_class = type(hf)  # the CLI's parser: errors are UsageError (exit 2)
    hsub = hf.add_subparsers(dest="hf_command", metavar="COMMAND", parser_class=parser_class)
    hsub.required = True
    imp = hsub.add_parser(
        "import",
        help="save a model directory's weights (config.json, safetensors) as a new checkpoint of STORE",
    )
    imp.add_argument("hf_dir", metavar="HF_DIR")
    imp.add_argument("store", metavar="STORE", help="made when missing")
    imp.set_defaults(func=_cmd_import)
    exp = hsub.add_parser(
        "export",
        help="write a checkpoint of STORE as a model directory transformers loads",
    )
    exp.add_argument("store", metavar="STORE")
    exp.add_argument("hf_dir", metavar="HF_DIR")
    exp.add_argument("--step", type=int, default=None, help="the checkpoint (default: the latest)")
    exp.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="the model's config.json (default: the one `dtm hf import` saved in STORE/hf)",
    )
    exp.add_argument(
        "--max-shard-size",
        type=byte_count,
        default=5 * 1024**3,
        metavar="BYTES",
        help="shard the weights above this size, with model.safetensors.index.json (default 5G)",
    )
    _strict_arg(exp)
    exp.set_defaults(func=_cmd_export)
    chk = hsub.add_parser(
        "check",
        help="run transformers and dtm on the same seeded prompts: per-position KL, max |logit "
        "difference|, greedy agreement",
    )
    chk.add_argument("hf_dir", metavar="HF_DIR")
    chk.add_argument(
        "--mesh", metavar="AXIS=N,...", default="dp=1,tp=1", help="dtm's mesh (default dp=1,tp=1)"
    )
    chk.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    chk.add_argument("--length", type=int, default=32, help="tokens per prompt (default 32)")
    chk.add_argument("--seed", type=int, default=0, help="the prompts' seed (default 0)")
    chk.set_defaults(func=_cmd_check)


def _serial(command: str) -> None:
    from dtm_mpi.comm import handles

    if handles.world_size() > 1:
        raise agreed(
            UsageError(f"dtm hf {command} is a serial tool: run it in one process, without mpirun")
        )


def _cmd_import(args: argparse.Namespace) -> int:
    from dtm_mpi.comm import handles
    from dtm_mpi.console import say
    from dtm_mpi.frontend.hf_store import import_checkpoint
    from dtm_mpi.plan.explain import human_bytes

    _serial("import")
    r = import_checkpoint(args.hf_dir, Path(args.store), handles.self_comm())
    side = f"; kept {', '.join(r.side_files)}" if r.side_files else ""
    say(
        f"imported {r.architecture}: {r.tensors} tensor(s), {human_bytes(r.bytes)} into {r.checkpoint} "
        f"(step {r.step}); config in {Path(args.store) / 'hf'}{side}"
    )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dtm_mpi.console import say, write_line
    from dtm_mpi.frontend.hf_store import export_checkpoint
    from dtm_mpi.io.hf_files import read_config
    from dtm_mpi.io.tools import store_dir

    _serial("export")
    config = None
    if args.config is not None:
        p = Path(args.config)
        if not (p.is_dir() or p.name == "config.json"):
            raise UsageError(f"--config {args.config}: give a config.json file or its directory")
        config = read_config(p if p.is_dir() else p.parent)
    r = export_checkpoint(
        store_dir(args.store),
        args.hf_dir,
        step=args.step,
        config=config,
        max_shard_bytes=args.max_shard_size,
        warn=None if args.strict else write_line,
    )
    say(
        f"exported {r.architecture}: {r.tensors} tensor(s) of step {r.step} to {args.hf_dir} "
        f"({', '.join(p.name for p in r.files)})"
    )
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from dtm_mpi.console import say
    from dtm_mpi.frontend.hf_check import check_parity
    from dtm_mpi.sharding.mesh import parse_mesh_binding

    _serial("check")
    report = check_parity(
        args.hf_dir,
        sizes=parse_mesh_binding(args.mesh),
        prompts=args.prompts,
        length=args.length,
        seed=args.seed,
    )
    say(report.text())
    return 0 if report.passed else 1
