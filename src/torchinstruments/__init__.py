"""torchinstruments: passive PyTorch model telemetry.

One call instruments a model; training runs unchanged; a small, ranked, byte-bounded
report says which internal signals (module activations and output gradients) moved,
where, when and how much::

    from torchinstruments import inject_observer, remove_observer

    inject_observer(model, output_dir="stats")
    ...  # train as usual
    remove_observer(model)  # writes stats/report.json and stats/index.md

The public names are loaded on first use (PEP 562): ``import torchinstruments`` and the
command line (``python -m torchinstruments``) import nothing of torch until a name that
needs it is used; the offline tools (``merge_rank_reports``, ``compare_runs``) never do.
"""

from __future__ import annotations

import contextlib as _contextlib
import importlib as _importlib
import sys as _sys
import types as _types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .api import ObserverHandle, inject_observer, observer_of, remove_observer
    from .compare import compare_runs
    from .config import ReportConfig, TrackConfig
    from .errors import ConfigError, ObserverStateError, ReportReadError, TorchInstrumentsError
    from .histogram import HistogramSpec, histogram
    from .merge import merge_rank_reports
    from .sampling import DefaultSampling, EveryNSampling, SamplingPolicy, TimeBudgetSampling
    from .sinks import (
        DirectorySink,
        MemorySink,
        MetricLoggerSink,
        ScalarSink,
        Sink,
        TensorBoardSink,
    )

from ._version import __version__

__all__ = [
    "ConfigError",
    "DefaultSampling",
    "DirectorySink",
    "EveryNSampling",
    "HistogramSpec",
    "MemorySink",
    "MetricLoggerSink",
    "ObserverHandle",
    "ObserverStateError",
    "ReportConfig",
    "ReportReadError",
    "SamplingPolicy",
    "ScalarSink",
    "Sink",
    "TensorBoardSink",
    "TimeBudgetSampling",
    "TorchInstrumentsError",
    "TrackConfig",
    "__version__",
    "compare_runs",
    "histogram",
    "inject_observer",
    "merge_rank_reports",
    "observer_of",
    "remove_observer",
]

#: Public name -> the submodule that defines it.
_SOURCES = {
    "ObserverHandle": "api",
    "inject_observer": "api",
    "observer_of": "api",
    "remove_observer": "api",
    "compare_runs": "compare",
    "ReportConfig": "config",
    "TrackConfig": "config",
    "ConfigError": "errors",
    "ObserverStateError": "errors",
    "ReportReadError": "errors",
    "TorchInstrumentsError": "errors",
    "HistogramSpec": "histogram",
    "histogram": "histogram",
    "merge_rank_reports": "merge",
    "DefaultSampling": "sampling",
    "EveryNSampling": "sampling",
    "SamplingPolicy": "sampling",
    "TimeBudgetSampling": "sampling",
    "DirectorySink": "sinks",
    "MemorySink": "sinks",
    "MetricLoggerSink": "sinks",
    "ScalarSink": "sinks",
    "Sink": "sinks",
    "TensorBoardSink": "sinks",
}


def __getattr__(name: str) -> object:
    """Load a public name from its submodule on first use and keep it (PEP 562).

    Public classes and functions are shown as ``torchinstruments.X`` (in reprs and
    documentation).

    Raises:
        AttributeError: ``name`` is not a public name of the package.
    """
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{source}", __name__), name)
    if isinstance(value, type) or callable(value):
        with _contextlib.suppress(AttributeError, TypeError):
            value.__module__ = __name__
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    """The package module: importing the submodule ``torchinstruments.histogram`` does
    not hide the public function ``histogram`` of the same name."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, _types.ModuleType) and _SOURCES.get(name) == name:
            return  # the import system binding a submodule over a public name
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
