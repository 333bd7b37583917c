"""Series bookkeeping: one :class:`TensorSeries` per (module, call, signal, tensor path).

A tensor series owns one :class:`~torchinstruments.track.SeriesTracker` per metric; the
(module, call index, signal, tensor path, metric) tuple is what docs/report.md calls a series.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .config import TrackConfig
from .track import SeriesTracker

__all__ = [
    "ACTIVATION",
    "GRAD_OUTPUT",
    "RMS_TO_ROOT",
    "SIGNALS",
    "TensorSeries",
    "forward_positions",
]

ACTIVATION = "activation"
GRAD_OUTPUT = "grad_output"
SIGNALS = (ACTIVATION, GRAD_OUTPUT)
#: Derived gradient metric: a module's output-gradient RMS divided by the root output's
#: output-gradient RMS (the loss gradient) in the same sample. Loss scaling, loss
#: reduction and the natural shrinking of the loss gradient cancel in it.
RMS_TO_ROOT = "rms_to_root"

#: Metrics tracked in log space (relative change matters, not absolute).
LOG_SCALE_METRICS = frozenset({"rms", "mean_abs", "max_abs", "tail_ratio", RMS_TO_ROOT})

#: Smallest baseline standard deviation per metric, in tracked units. Log-scale metrics:
#: 0.02 (2% relative); fractions: 0.005 absolute; excess kurtosis: 0.1 absolute.
_NOISE_FLOORS = {
    "rms": 0.02,
    "mean_abs": 0.02,
    "max_abs": 0.02,
    "tail_ratio": 0.02,
    "excess_kurtosis": 0.1,
    "zero_fraction": 0.005,
    "nonfinite_fraction": 0.005,
    RMS_TO_ROOT: 0.02,
}


@dataclass(slots=True)
class TensorSeries:
    """All metrics of one tensor path of one call of one module, for one signal.

    Attributes:
        module: qualified module name (``""`` for the root).
        call_index: 0-based call of the module within its root forward.
        signal: ``"activation"`` or ``"grad_output"``.
        tensor_path: where the tensor sits in the module output (``output[0]``, ...).
        forward_position: position of this call in the forward call order of the latest
            sample that observed it (0 = first module call of the forward).
        trackers: one tracker per metric, created on the metric's first defined value.
        observations: number of samples that observed this tensor.
        undefined: per metric, number of samples whose value did not exist.
    """

    module: str
    call_index: int
    signal: str
    tensor_path: str
    forward_position: int
    trackers: dict[str, SeriesTracker]
    observations: int = 0
    undefined_values: int = 0

    def update(
        self,
        config: TrackConfig,
        sample: int,
        values: dict[str, float | None],
        forward: int | None = None,
    ) -> None:
        """Feed one sample's metric values (``None`` where undefined) to the trackers.

        ``values`` maps metric names (:data:`~torchinstruments.reduce.METRICS`, plus
        :data:`RMS_TO_ROOT` for output gradients) to values; ``forward`` is the sample's
        training forward (default: the sample index), the time axis of the trends.
        """
        self.observations += 1
        trackers = self.trackers
        for metric, value in values.items():
            if value is None:
                self.undefined_values += 1
                continue
            tracker = trackers.get(metric)
            if tracker is None:
                tracker = SeriesTracker(
                    config,
                    log_scale=metric in LOG_SCALE_METRICS,
                    noise_floor=_NOISE_FLOORS[metric],
                )
                trackers[metric] = tracker
            tracker.update(sample, value, forward)


def forward_positions(series: Iterable[TensorSeries]) -> dict[tuple[str, int, str], int]:
    """Forward call position per (module, call index, tensor path), from the activations.

    Output gradients take the position of the activation of the same module call and
    tensor path, so both signals can be put in propagation order.
    """
    return {
        (s.module, s.call_index, s.tensor_path): s.forward_position
        for s in series
        if s.signal == ACTIVATION
    }
