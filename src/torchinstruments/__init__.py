"""torchinstruments: passive PyTorch model telemetry.

One call instruments a model; training runs unchanged; a small, ranked, byte-bounded
report says which internal signals (module activations and output gradients) moved,
where, when and how much::

    from torchinstruments import inject_observer, remove_observer

    inject_observer(model, output_dir="stats")
    ...  # train as usual
    remove_observer(model)  # writes stats/report.json and stats/index.md
"""

from __future__ import annotations

import contextlib as _contextlib

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

__version__ = "0.1.0"

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


def _present_as_public() -> None:
    """Show public objects as ``torchinstruments.X`` (in reprs and documentation)."""
    for name in __all__:
        value = globals()[name]
        if isinstance(value, type) or callable(value):
            with _contextlib.suppress(AttributeError, TypeError):
                value.__module__ = "torchinstruments"


_present_as_public()
