"""The ``torchinstruments`` command line (also ``python -m torchinstruments``).

Subcommands::

    torchinstruments merge DIR [--output-dir OUT] [--world-size N] [--max-bytes B]
                               [--threshold T]
    torchinstruments compare BASELINE CANDIDATE [-o OUT] [--max-bytes B] [--threshold T]

``merge`` combines the ``rank-NNN/report.json`` files written with ``rank_policy="all"``
into ``global-report.json`` and ``global-index.md`` and prints where it wrote them.
``compare`` reads the ``series.json`` of a baseline run and of a candidate run, writes
``comparison.json`` and ``comparison.md`` (default: into CANDIDATE), and prints where it
wrote them, the headline and the first divergences.
Exit status: 0 on success, 1 when the reports cannot be read or merged, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from .compare import (
    COMPARISON_INDEX_NAME,
    DIVERGENCE_THRESHOLD,
    compare_runs,
    first_divergence_lines,
)
from .compare import DEFAULT_MAX_BYTES as COMPARE_MAX_BYTES
from .errors import ConfigError, TorchInstrumentsError
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


def _compare(args: argparse.Namespace) -> int:
    """Run ``compare``: write the comparison, print its paths, headline and first lines."""
    path = compare_runs(
        args.baseline,
        args.candidate,
        args.output_dir,
        max_bytes=args.max_bytes,
        threshold=args.threshold,
    )
    comparison = json.loads(path.read_text(encoding="utf-8"))
    print(f"wrote {path}")
    print(f"wrote {path.with_name(COMPARISON_INDEX_NAME)}")
    print(comparison["summary"]["headline"])
    for line in first_divergence_lines(comparison):
        print(line)
    first = comparison["summary"]["first_divergence"]
    if first is not None and first.get("next_experiment"):
        print(f"next experiment: {first['next_experiment']}")
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
    compare = commands.add_parser(
        "compare",
        help="compare a candidate run with a baseline run: where they first part",
        description=(
            "Read BASELINE/series.json, then CANDIDATE/series.json, and write "
            "comparison.json and comparison.md: series present in one run only, the series "
            "that differ most per category, and the first points of divergence."
        ),
    )
    compare.add_argument("baseline", metavar="BASELINE", help="the baseline run's output_dir")
    compare.add_argument("candidate", metavar="CANDIDATE", help="the candidate run's output_dir")
    compare.add_argument(
        "-o",
        "--output-dir",
        metavar="OUT",
        default=None,
        help="where to write (default: CANDIDATE)",
    )
    compare.add_argument(
        "--max-bytes",
        metavar="B",
        type=int,
        default=COMPARE_MAX_BYTES,
        help=f"bound on comparison.json in bytes (default: {COMPARE_MAX_BYTES})",
    )
    compare.add_argument(
        "--threshold",
        metavar="T",
        type=float,
        default=DIVERGENCE_THRESHOLD,
        help=f"divergence threshold in noise units (default: {DIVERGENCE_THRESHOLD:g})",
    )
    compare.set_defaults(handler=_compare)
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
    except ConfigError as error:  # an option value out of range: a usage error
        print(f"{_PROGRAM} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (TorchInstrumentsError, OSError) as error:
        print(f"{_PROGRAM} {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
