"""One report written by the observer: the files of ``output_dir`` and the sinks.

:func:`write_report_files` is the sequence behind
:meth:`~torchinstruments.observer.Observer.write_report` (which adds the guard that
nothing raises into training, and the cost accounting): the report is built once and
written everywhere, each directory sink's files switched in together
(:class:`~torchinstruments.sinks.DirectorySink` ``begin``/``commit``).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from ._error_log import warn

if TYPE_CHECKING:
    from .observer import Observer

__all__ = ["warn_if_never_written", "write_report_files"]


def write_report_files(observer: Observer, block: bool, flush: bool, files_only: bool) -> None:
    """Write one report: number it, build it from one snapshot, hand it to the
    observer's writer and sinks, with ``series.json`` and ``details.json`` where they
    are wanted, every file of a directory sink into one generation (``begin`` before
    anything is built, ``commit`` at the end). Each step's error is counted in the
    observer's error table and the next step runs; a failed write to a directory warns
    once and leaves ``WRITE_FAILED.txt`` beside its files (which report they are),
    removed by the next report put in place. Arguments as for
    :meth:`~torchinstruments.observer.Observer.write_report`.
    """
    from .report import build_report, build_series_summary
    from .sinks import DirectorySink

    observer.context.last_write = time.monotonic()
    sinks = () if files_only else observer.sinks
    summarising = [
        target
        for target in (observer.writer, *sinks)
        if target is not None and getattr(target, "write_series_summary", False)
    ]
    summary = None
    # Numbered before anything is built, so series.json states the same number.
    observer.report_number += 1
    # Every file of this report goes into one generation, switched in at the end.
    directories = [t for t in (observer.writer, *sinks) if isinstance(t, DirectorySink)]
    for directory in directories:
        with contextlib.suppress(OSError):  # the write below meets it and counts it
            directory.choose_write_mode()
        directory.begin()
    try:
        if flush:
            observer.flush_statistics(block=block)
        if summarising:
            # Before the report, whose coverage counts the rows it omits.
            summary = build_series_summary(
                observer.snapshot(), observer.report_config.series_summary_max_bytes
            )
            observer.series_summary_omitted = summary["omitted"]
    except Exception as error:
        observer.record_error("series_summary", "", error)
    try:
        snapshot = observer.snapshot()
        report = build_report(snapshot)  # statistics flushed above
    except Exception as error:
        # The run's coverage and this error still reach output_dir: a report without
        # ranking, rather than the previous report left in place with final: false.
        observer.record_error("report", "", error)
        _warn_ranking(observer, error)
        try:
            snapshot = observer.snapshot()
            report = build_report(snapshot, ranking=False)
        except Exception as fallback_error:
            observer.record_error("report", "", fallback_error)
            return
    writer = observer.writer
    failed: dict[int, Exception] = {}  # id of a directory sink -> why its report failed
    if writer is not None:
        try:
            writer.write(report)
            observer.reports_written += 1
        except Exception as error:  # each file is written on its own: go on
            observer.record_error("write", "", error)
            _warn_write(observer, error, writer)
            failed[id(writer)] = error
    for sink in sinks:
        try:
            sink.write(report)
        except Exception as error:
            observer.record_error("sink", type(sink).__name__, error)
            failed[id(sink)] = error
    if summary is not None:
        for target in summarising:
            try:
                target.write_summary(summary)
            except Exception as error:
                observer.record_error("series_summary", type(target).__name__, error)
    wanting = [
        target
        for target in (writer, *sinks)
        if target is not None and getattr(target, "write_full_details", False)
    ]
    if wanting:
        from .report import build_details

        details = build_details(snapshot)
        for target in wanting:
            try:
                target.write_details(details)
            except Exception as error:
                observer.record_error("details", type(target).__name__, error)
    for directory in directories:
        try:
            directory.commit()
        except Exception as error:
            observer.record_error("write", "", error)
            _warn_write(observer, error, directory)
            failed.setdefault(id(directory), error)
        # Say beside the files whether they are this report or an earlier one.
        if id(directory) in failed:
            directory.note_failed_write(report, failed[id(directory)])
        else:
            directory.note_written(report)


def _warn_ranking(observer: Observer, error: Exception) -> None:
    if observer.warned_ranking:
        return
    observer.warned_ranking = True
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    warn(
        f"torchinstruments could not rank this run's findings "
        f"({type(error).__name__}: {error}{where}); the report it writes lists none, "
        "training continues. This is a defect of torchinstruments: please report it "
        "with this message."
    )


def _warn_write(observer: Observer, error: Exception, target: object) -> None:
    observer.last_write_error = error
    if not observer.warned_write:
        observer.warned_write = True
        warn(
            f"torchinstruments could not write its report to {_where(target)} ({error}); "
            "training continues, the error is counted and the next write is retried"
        )


def _where(target: object) -> str:
    path = getattr(target, "path", None)
    return repr(str(path)) if path is not None else type(target).__name__


def warn_if_never_written(observer: Observer) -> None:
    """After the final report (removal, or interpreter exit): warn once more for each
    directory of the observer that no report of this run ever reached, with the last
    write error, so that a run into an unwritable ``output_dir`` does not end
    silently."""
    from .sinks import DirectorySink

    error = observer.last_write_error
    if error is None:
        return
    for target in (observer.writer, *observer.sinks):
        if isinstance(target, DirectorySink) and not target.written_once:
            warn(
                f"torchinstruments wrote no report to {_where(target)} in this run: "
                f"every write failed, the last with {error}. Give inject_observer an "
                "output_dir this process can create and write."
            )
