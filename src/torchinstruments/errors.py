"""Exceptions raised by torchinstruments.

One root, so that callers can catch everything of ours with a single class::

    TorchInstrumentsError
    ├── ConfigError (also ValueError)         an argument or config field is invalid
    ├── ObserverStateError (also RuntimeError) inject/remove called in the wrong state
    └── ReportReadError (also ValueError)     a report on disk cannot be read or merged

Errors that happen inside hooks during training are never raised: they are caught,
counted and listed under ``errors`` in ``report.json``.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ObserverStateError", "ReportReadError", "TorchInstrumentsError"]


class TorchInstrumentsError(Exception):
    """Root of every exception raised by torchinstruments."""


class ConfigError(TorchInstrumentsError, ValueError):
    """An argument or a configuration field has an invalid value or type."""


class ObserverStateError(TorchInstrumentsError, RuntimeError):
    """An observer operation was called in a state that does not allow it.

    Example: ``inject_observer`` on a model that already carries an observer.
    """


class ReportReadError(TorchInstrumentsError, ValueError):
    """A report file could not be read, parsed or merged."""
