"""``dtm generate SOURCE``: text (or token ids) continued by a Llama from a Hugging Face model
directory or a store of ``dtm hf import`` (its latest checkpoint, e.g. after training), on
simulated ranks (``--sim``) or the ranks of mpirun/srun, on any mesh; thin, over
:mod:`dtm_mpi.frontend.model_source`, :mod:`dtm_mpi.frontend.tokenizer` and
:func:`dtm_mpi.frontend.generate.generation`."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dtm_mpi.errors import UsageError, agreed

__all__ = ["add_generate_command", "prompt_ids"]


def add_generate_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    gen = sub.add_parser(
        "generate",
        help="continue a prompt with a Llama from a Hugging Face directory or a store (KV cache, "
        "greedy or seeded top-k sampling, on any mesh)",
    )
    gen.add_argument(
        "source",
        metavar="SOURCE",
        help="a Hugging Face model directory (config.json, safetensors) or a store made by "
        "`dtm hf import` (the weights of its latest checkpoint)",
    )
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="text, encoded with SOURCE's tokenizer.json")
    what.add_argument(
        "--ids",
        metavar="IDS",
        help="token ids: 'ID ID ...' (or comma-separated), or a .npy file of [P] or [B, P]",
    )
    gen.add_argument("--max-new", type=int, default=32, help="new tokens (default 32)")
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample from softmax(logits / T) (default: greedy, the largest logit)",
    )
    gen.add_argument("--top-k", type=int, default=0, help="sample among the K largest (0: all)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    gen.add_argument(
        "--eos",
        type=int,
        default=None,
        metavar="ID",
        help="stop a sequence at this id (default: the config's eos_token_id; -1: never)",
    )
    gen.add_argument(
        "--mesh", metavar="AXIS=N,...", default="dp=1,tp=1", help="the mesh (default dp=1,tp=1)"
    )
    gen.add_argument(
        "--sim", type=int, default=None, metavar="N", help="N simulated ranks (else mpirun's)"
    )
    gen.add_argument(
        "--dtype",
        choices=("f32", "bf16", "f16", "f64"),
        default=None,
        help="compute dtype (default: the config's)",
    )
    gen.add_argument(
        "--explain",
        action="store_true",
        help="print the decode step's plan on the mesh (each rank's ops, communication and "
        "memory: its weights and key/value cache) and stop, without running",
    )
    gen.set_defaults(func=_cmd_generate)


def prompt_ids(text: str) -> np.ndarray:
    """The ids ``[B, P]`` of ``--ids``: a .npy file of [P] or [B, P] ints, or ids separated by
    spaces or commas."""
    if text.endswith(".npy"):
        p = Path(text)
        if not p.is_file():
            raise UsageError(f"--ids {text}: no such file")
        try:
            a = np.load(p, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise UsageError(f"--ids {text}: not a .npy file ({exc})") from None
        if a.ndim not in (1, 2) or not np.issubdtype(a.dtype, np.integer):
            raise UsageError(
                f"--ids {text}: want integer ids [P] or [B, P]; got {a.dtype}{list(a.shape)}"
            )
        return np.atleast_2d(a).astype(np.int64)
    words = text.replace(",", " ").split()
    try:
        ids = [int(w) for w in words]
    except ValueError:
        bad = next(w for w in words if not w.lstrip("-").isdigit())
        raise UsageError(f"--ids: {bad!r} is not a token id") from None
    if not ids:
        raise UsageError("--ids: no token ids")
    return np.array([ids], np.int64)


def _eos(args: argparse.Namespace, config: dict[str, object]) -> int | None:
    if args.eos is not None:
        return None if args.eos < 0 else int(args.eos)
    e = config.get("eos_token_id")
    if isinstance(e, list):  # several stop ids (Llama 3): the first, as a stop, is enough
        e = e[0] if e else None
    return int(e) if isinstance(e, int) else None


def _cmd_generate(args: argparse.Namespace) -> int:
    from dtm_mpi.comm import handles
    from dtm_mpi.console import say
    from dtm_mpi.frontend.generate import Sampling, generation
    from dtm_mpi.frontend.model_source import open_model
    from dtm_mpi.frontend.tokenizer import TextTokenizer, load_tokenizer
    from dtm_mpi.sharding.mesh import parse_mesh_binding

    speak = args.sim is not None or handles.world_rank() == 0
    try:  # decided from the command line and the files every rank reads alike
        sizes = parse_mesh_binding(args.mesh)
        src = open_model(args.source, sizes=sizes, dtype=args.dtype)
        if src.architecture != "llama":
            raise UsageError(
                f"{src.what}: generation runs Llama models; this is {src.architecture}"
            )
        tok: TextTokenizer | None = None
        if args.prompt is not None:
            if src.tokenizer_file is None:
                raise UsageError(
                    f"{src.what} has no tokenizer.json: give the prompt as --ids, or import a "
                    "directory that has one"
                )
            tok = load_tokenizer(src.tokenizer_file)
            ids = np.array([tok.encode(args.prompt)], np.int64)
        else:
            ids = prompt_ids(args.ids)
            if src.tokenizer_file is not None:
                try:
                    tok = load_tokenizer(src.tokenizer_file)
                except UsageError:
                    tok = None  # ids in, ids out: the text is a courtesy
        how = (
            Sampling()
            if args.temperature is None
            else Sampling(False, args.temperature, args.top_k, args.seed)
        )
    except UsageError as exc:
        raise agreed(exc) from None
    eos = _eos(args, src.config)
    if args.explain:  # fit prints the decode step's plan, then ends the run
        from dtm_mpi.config import switch_on

        switch_on("explain")
    res = generation(
        src.model,
        src.weights,
        ids.astype(np.int32),
        args.max_new,
        sizes=sizes,
        sim=args.sim,
        sampling=how,
        eos=eos,
        store=str(src.store) if src.store is not None else None,
    )
    if not speak:
        return 0
    lines = []
    for b, row in enumerate(res.tokens):
        new = [int(t) for t in row]
        if eos is not None and eos in new:
            new = new[: new.index(eos) + 1]
        tag = f"[{b}] " if res.tokens.shape[0] > 1 else ""
        lines.append(f"{tag}ids: {' '.join(map(str, new))}")
        if tok is not None:
            lines.append(f"{tag}text: {tok.decode([*ids[b].tolist(), *new])}")
    b, n = res.tokens.shape
    lines.append(
        f"{b * n} token(s) on mesh {args.mesh}: first after {res.first_s:.2f} s "
        f"(trace {res.trace_s:.2f} s, setup {res.setup_s:.2f} s), then {res.tokens_per_s:.1f} tokens/s"
    )
    say("\n".join(lines))
    return 0
