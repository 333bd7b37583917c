"""The error table: errors raised inside hooks, counted and kept by kind and place.

Telemetry never breaks training: every hook catches its own errors and hands them to
:meth:`ErrorLog.record`; the report's ``errors`` section lists the entries and
``coverage.errors_total`` the count. What a user must hear of at once (a report that
could not be written) is also said with :func:`warn`, which never raises.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

__all__ = ["ErrorEntry", "ErrorLog", "warn"]


def warn(message: str) -> None:
    """Issue a ``RuntimeWarning`` that never raises: under ``-W error`` (or a
    ``filterwarnings = error`` test setting) a warning becomes an exception, which must
    not reach the training loop; it is then dropped (the error it reports is counted in
    the report anyway)."""
    with contextlib.suppress(Exception):
        warnings.warn(message, RuntimeWarning, stacklevel=3)


#: Most characters of an error message kept (its first line).
MAX_MESSAGE_CHARS = 300


@dataclass(slots=True)
class ErrorEntry:
    """One kind of error at one place: ``stage`` (``forward``, ``backward``, ``flush``,
    ...), ``module`` (a module name, a sink's class name, or ``""``), the exception's
    class name, its first message, how many times it was raised and the sample open at
    the first (None before the first sample)."""

    stage: str
    module: str
    error_type: str
    message: str
    count: int = 0
    first_sample: int | None = None


class ErrorLog:
    """Counts every error; keeps up to ``4 * max_entries`` distinct entries.

    Errors are grouped by kind and place (stage, module, exception type), never by
    message text, which may vary from one occurrence to the next (a temporary file name,
    a tensor shape): one failure repeated fills one entry, which keeps the first message,
    so a later, different error still gets an entry of its own.

    Args:
        max_entries: ``ReportConfig.max_error_entries``, the entries the report lists.
    """

    __slots__ = ("_capacity", "entries", "sample", "total")

    def __init__(self, max_entries: int) -> None:
        self._capacity = max(max_entries, 1) * 4
        #: (stage, module, error type) -> entry, in order of first occurrence.
        self.entries: dict[tuple[str, str, str], ErrorEntry] = {}
        #: Errors recorded, kept or not.
        self.total = 0
        #: The sample opened last (None before the first): a new entry's first sample.
        self.sample: int | None = None

    def record(self, stage: str, module: str, error: BaseException) -> None:
        """Count ``error``, raised at ``stage`` for ``module``."""
        self.total += 1
        try:
            text = str(error).strip()
        except Exception:  # a user exception whose __str__ raises
            text = ""
        message = text.splitlines()[0][:MAX_MESSAGE_CHARS] if text else ""
        key = (stage, module, type(error).__name__)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self._capacity:
                return
            entry = ErrorEntry(stage, module, type(error).__name__, message)
            entry.first_sample = self.sample
            self.entries[key] = entry
        entry.count += 1
