"""The ``torchinstruments`` command line (also ``python -m torchinstruments``).

Subcommands::

    torchinstruments show DIR
    torchinstruments merge DIR [--output-dir OUT] [--world-size N] [--max-bytes B]
                               [--threshold T]
    torchinstruments compare BASELINE CANDIDATE [-o OUT] [--max-bytes B] [--threshold T]
    torchinstruments --version

``show`` prints a report in the terminal: the headline, the notable findings in a few
lines each, and the coverage and limits, for ``DIR/report.json`` and (after ``merge``)
``DIR/global-report.json``.

``merge`` combines the ``rank-NNN/report.json`` files written with ``rank_policy="all"``
into ``global-report.json`` and ``global-index.md`` and prints where it wrote them.
``compare`` reads the ``series.json`` of a baseline run and of a candidate run, writes
``comparison.json`` and ``comparison.md`` (default: into CANDIDATE), and prints where it
wrote them, the headline and the first divergences.

The command line reads JSON only and does not import torch. Every input is bounded (see
:mod:`torchinstruments._jsonio`) and every failure is one line on stderr::

    torchinstruments COMMAND: error: MESSAGE

Exit status (:data:`EXIT_STATUSES`): 0 success; 1 a report cannot be read, compared or
merged, or an output cannot be written; 2 a usage error (unknown option, value out of
range, no subcommand); 3 an internal error (a bug, reported in one line).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._jsonio import one_line, read_json_object
from ._version import __version__
from .compare import (
    COMPARISON_INDEX_NAME,
    COMPARISON_SCHEMA,
    DIVERGENCE_THRESHOLD,
    compare_runs,
    first_divergence_lines,
)
from .compare import DEFAULT_MAX_BYTES as COMPARE_MAX_BYTES
from .errors import ConfigError, TorchInstrumentsError
from .merge import (
    DEFAULT_MAX_BYTES,
    GLOBAL_INDEX_NAME,
    GLOBAL_SCHEMA,
    OUTLIER_THRESHOLD,
    merge_rank_reports,
)
from .show import show_directory

__all__ = ["EXIT_STATUSES", "build_parser", "main"]

_PROGRAM = "torchinstruments"
#: Exit status -> meaning, as ``--help`` prints it.
EXIT_STATUSES = {
    0: "success",
    1: "a report cannot be read, compared or merged, or an output cannot be written",
    2: "usage error (unknown option, value out of range, no subcommand)",
    3: "internal error (a bug; the one-line message names it)",
}
_EPILOG = "exit status:\n" + "\n".join(f"  {code}  {text}" for code, text in EXIT_STATUSES.items())


class _Formatter(argparse.HelpFormatter):
    """Wraps descriptions as argparse does; prints the exit-status table as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("exit status:"):
            return text
        return super()._fill_text(text, width, indent)


def _show(args: argparse.Namespace) -> int:
    """Run ``show``: print the terminal view of the report(s) in DIR."""
    sys.stdout.write(show_directory(args.directory))
    return 0


def _read_written(path: os.PathLike[str], schema: str) -> dict[str, Any]:
    """A file this command has just written (our own bounded output)."""
    return read_json_object(
        Path(path),
        what="the file just written",
        max_bytes=1 << 26,
        schema=schema,
        required={"summary": dict},
    )


def _merge(args: argparse.Namespace) -> int:
    """Run ``merge``: write the global report, print its paths and headline."""
    path = merge_rank_reports(
        args.directory,
        output_dir=args.output_dir,
        world_size=args.world_size,
        max_bytes=args.max_bytes,
        threshold=args.threshold,
    )
    report = _read_written(path, GLOBAL_SCHEMA)
    print(f"wrote {path}")
    print(f"wrote {path.with_name(GLOBAL_INDEX_NAME)}")
    print(one_line(str(report["summary"]["headline"]), 1000))
    ranks = report.get("ranks")
    if isinstance(ranks, dict) and ranks.get("separate_runs") is True:
        note = one_line(str(ranks["notes"][0]), 1000)
        print(f"{_PROGRAM} merge: warning: {note}", file=sys.stderr)
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
    comparison = _read_written(path, COMPARISON_SCHEMA)
    print(f"wrote {path}")
    print(f"wrote {path.with_name(COMPARISON_INDEX_NAME)}")
    print(one_line(str(comparison["summary"]["headline"]), 1000))
    for line in first_divergence_lines(comparison):
        print(one_line(line, 1000))
    first = comparison["summary"]["first_divergence"]
    if first is not None and first.get("next_experiment"):
        print(one_line(f"next experiment: {first['next_experiment']}", 1000))
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
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"{_PROGRAM} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    show = commands.add_parser(
        "show",
        help="print a report in the terminal: headline, notable findings, coverage and limits",
        description=(
            "Print DIR/global-report.json (written by merge) and DIR/report.json: the "
            "headline, the notable findings in a few lines each, and the coverage and "
            "limits. DIR may also be one of those files."
        ),
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    show.add_argument("directory", metavar="DIR", help="the output_dir of the training run")
    show.set_defaults(handler=_show)
    merge = commands.add_parser(
        "merge",
        help="merge per-rank reports (rank_policy='all') into a global report",
        description=(
            "Read DIR/rank-NNN/report.json one at a time and write global-report.json and "
            "global-index.md: ranks present, missing, unreadable and truncated, and rank "
            "outliers."
        ),
        epilog=_EPILOG,
        formatter_class=_Formatter,
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
        epilog=_EPILOG,
        formatter_class=_Formatter,
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
        The exit status (:data:`EXIT_STATUSES`): 0 on success (also for ``--help`` and
        ``--version``), 1 when an input cannot be read, compared or merged or an output
        cannot be written, 2 on a usage error or without a subcommand, 3 on an internal
        error. Each error is one line on stderr.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help, --version (0) and usage errors (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    status = 3
    try:
        status = handler(args)
    except ConfigError as error:  # an option value out of range: a usage error
        _error(args.command, str(error))
        status = 2
    except BrokenPipeError:  # the reader went away (``show DIR | head``)
        status = 0
    except (TorchInstrumentsError, OSError) as error:
        _error(args.command, str(error))
        status = 1
    except Exception as error:
        _error(args.command, f"internal error: {type(error).__name__}: {error}")
        status = 3
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


def _error(command: str, message: str) -> None:
    print(f"{_PROGRAM} {command}: error: {one_line(message, 1000)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
