"""``dtm plot metrics``: a run's metrics file (``fit(metrics_file=)``) drawn as curves;
thin, over :func:`dtm_mpi.frontend.run_report.plot_metrics`."""

from __future__ import annotations

import argparse

__all__ = ["add_plot_commands"]


def add_plot_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # (nothing of the frontend imported here: every ``dtm`` command builds this parser)
    plot = sub.add_parser("plot", help="draw a run's metrics file")
    parser_class = type(plot)  # the CLI's parser: errors are UsageError (exit 2)
    psub = plot.add_subparsers(dest="plot_command", metavar="COMMAND", parser_class=parser_class)
    psub.required = True
    met = psub.add_parser(
        "metrics",
        help="loss, learning rate, tokens/s and MFU over the steps of one or more JSON-lines "
        "metrics files, to a PNG",
    )
    met.add_argument("files", nargs="+", metavar="FILE", help="metrics files (one curve each)")
    met.add_argument("-o", "--out", required=True, metavar="PNG", help="the image to write")
    met.add_argument(
        "--keys",
        default=None,
        metavar="K,...",
        help="the metrics to draw, one panel each (default: loss, lr, tokens_per_s and mfu, "
        "those the files have)",
    )
    met.set_defaults(func=_cmd_metrics)


def _cmd_metrics(args: argparse.Namespace) -> int:
    from dtm_mpi.frontend.run_report import PLOTTED, plot_metrics

    keys = (
        PLOTTED
        if args.keys is None
        else tuple(k.strip() for k in args.keys.split(",") if k.strip())
    )
    shown = plot_metrics(list(args.files), args.out, keys)
    print(f"{args.out}: {', '.join(shown)} over {len(args.files)} run(s)")
    return 0
