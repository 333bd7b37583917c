"""The ``torchinstruments`` command line (also ``python -m torchinstruments``).

Subcommands::

    torchinstruments merge DIR [--output-dir OUT] [--world-size N] [--max-bytes B]
                               [--threshold T]

``merge`` combines the ``rank-NNN/report.json`` files written with ``rank_policy="all"``
into ``global-report.json`` and ``global-index.md`` and prints where it wrote them.
Exit status: 0 on success, 1 when the reports cannot be merged, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from .errors import TorchInstrumentsError
from .merge import (
    DEFAULT_MAX_BYTES,
    GLOBAL_INDEX_NAME,
    OUTLIER_THRESHOLD,
    merge_rank_reports,
)

__all__ = ["build_parser", "main"]

_PROGRAM = "torchinstruments"


def _merge(args: argparse.Namespace) -> int:
    """Run ``merge``: write the global report, print its paths and headline."""
    path = merge_rank_reports(
        args.directory,
        output_dir=args.output_dir,
        world_size=args.world_size,
        max_bytes=args.max_bytes,
        threshold=args.threshold,
    )
    report = json.loads(path.read_text(encoding="utf-8"))
    print(f"wrote {path}")
    print(f"wrote {path.with_name(GLOBAL_INDEX_NAME)}")
    print(report["summary"]["headline"])
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subparser per subcommand, each with a ``handler``.

    Returns:
        An ``argparse.ArgumentParser`` whose parsed namespace carries ``handler``, a
        callable taking the namespace and returning the exit status.
    """
    parser = argparse.ArgumentParser(
        prog=_PROGRAM,
        description="Passive PyTorch telemetry: tools for the reports torchinstruments writes.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    merge = commands.add_parser(
        "merge",
        help="merge per-rank reports (rank_policy='all') into a global report",
        description=(
            "Read DIR/rank-NNN/report.json one at a time and write global-report.json and "
            "global-index.md: ranks present, missing, unreadable and truncated, and rank "
            "outliers."
        ),
    )
    merge.add_argument("directory", metavar="DIR", help="the output_dir of the training run")
    merge.add_argument(
        "--output-dir", metavar="OUT", default=None, help="where to write (default: DIR)"
    )
    merge.add_argument(
        "--world-size",
        metavar="N",
        type=int,
        default=None,
        help="expected number of ranks (default: as the rank reports state)",
    )
    merge.add_argument(
        "--max-bytes",
        metavar="B",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help=f"bound on global-report.json in bytes (default: {DEFAULT_MAX_BYTES})",
    )
    merge.add_argument(
        "--threshold",
        metavar="T",
        type=float,
        default=OUTLIER_THRESHOLD,
        help=f"series-value outlier threshold in spreads (default: {OUTLIER_THRESHOLD:g})",
    )
    merge.set_defaults(handler=_merge)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 1 when the command failed (the error is printed
        to stderr), 2 on a usage error or without a subcommand.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and usage errors (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except (TorchInstrumentsError, OSError) as error:
        print(f"{_PROGRAM} {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
