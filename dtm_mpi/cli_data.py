"""``dtm data prepare``: text files into a token file for :class:`~dtm_mpi.TokenLoader`;
thin, over :mod:`dtm_mpi.frontend.token_data`."""

from __future__ import annotations

import argparse

__all__ = ["add_data_commands"]


def add_data_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    data = sub.add_parser("data", help="training data: text files into token files")
    parser_class = type(data)  # the CLI's parser: errors are UsageError (exit 2)
    dsub = data.add_subparsers(dest="data_command", metavar="COMMAND", parser_class=parser_class)
    dsub.required = True
    prep = dsub.add_parser(
        "prepare",
        help="tokenize text files into a token file (nanoGPT .bin: uint16/uint32 ids) and its "
        ".json side file (dtype, count, vocabulary, SHA-256)",
    )
    prep.add_argument("texts", nargs="+", metavar="TEXT", help="UTF-8 text files")
    prep.add_argument("--tokenizer", required=True, metavar="FILE", help="a tokenizer.json")
    prep.add_argument("-o", "--out", required=True, metavar="BIN", help="the token file")
    prep.add_argument(
        "--val",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="the last FRACTION of the tokens into a validation file beside BIN (STEM.val.bin)",
    )
    prep.add_argument(
        "--eot", type=int, default=None, metavar="ID", help="an id appended after each file"
    )
    prep.add_argument("--quiet", action="store_true", help="no progress line")
    prep.set_defaults(func=_cmd_prepare)


def _cmd_prepare(args: argparse.Namespace) -> int:
    from dtm_mpi.frontend.token_data import prepare_tokens

    train, val = prepare_tokens(
        args.texts,
        args.tokenizer,
        args.out,
        val_fraction=args.val,
        eot=args.eot,
        progress=not args.quiet,
    )
    for f in (train, val):
        if f is not None:
            print(
                f"{f.path}: {f.tokens} {f.dtype} tokens, vocabulary {f.vocab_size}, sha256 {f.sha256[:16]}"
            )
    return 0
