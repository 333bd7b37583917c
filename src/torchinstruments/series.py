"""Series bookkeeping: one :class:`TensorSeries` per (module, call, signal, tensor path).

A tensor series owns one :class:`~torchinstruments.track.SeriesTracker` per metric; the
(module, call index, signal, tensor path, metric) tuple is what docs/report.md calls a series.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ._metrics import ATTENTION_LOGITS_PATH, LOG_SCALE_METRICS, METRICS, RMS_TO_ROOT
from .config import TrackConfig
from .track import SeriesTracker

__all__ = [
    "ACTIVATION",
    "ATTENTION_LOGITS_PATH",
    "GRAD_OUTPUT",
    "LOG_SCALE_METRICS",
    "RMS_TO_ROOT",
    "SIGNALS",
    "TensorSeries",
    "forward_positions",
]

#: Observed samples kept on each side of a change point's first sample, for the dense
#: part of an event's history (``TensorSeries.change_windows``).
CHANGE_CONTEXT_SAMPLES = 3
#: How far before a change point's first sample its window looks for observed samples,
#: in samples (among the tracker's latest values, ``track.RECENT_POINTS``).
_WINDOW_LOOKBACK_SAMPLES = 12
#: Most points held per metric in ``TensorSeries.change_windows`` (eight change points
#: of seven points each); past it the oldest go.
MAX_WINDOW_POINTS = 56

ACTIVATION = "activation"
GRAD_OUTPUT = "grad_output"
SIGNALS = (ACTIVATION, GRAD_OUTPUT)
#: Metric properties (log scale, noise floors) are in ``_metrics.METRICS``;
#: ``RMS_TO_ROOT`` and ``LOG_SCALE_METRICS`` are named here too, for the series' users.
_TRACKER_FLOORS = {m: p.tracker_floor for m, p in METRICS.items() if p.tracker_floor is not None}


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
        change_windows: per metric, every observed ``(sample, forward, value)`` from
            ``CHANGE_CONTEXT_SAMPLES`` observed samples before to as many after the first
            sample of each change point its tracker found (metric units; at most
            ``MAX_WINDOW_POINTS``, oldest dropped), in sample order. Empty for a
            metric without change points.
    """

    module: str
    call_index: int
    signal: str
    tensor_path: str
    forward_position: int
    trackers: dict[str, SeriesTracker]
    observations: int = 0
    undefined_values: int = 0
    change_windows: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)
    # Per metric: (change points seen, samples still to add after the latest one's start).
    _windows_open: dict[str, tuple[int, int]] = field(default_factory=dict)

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
                    noise_floor=_TRACKER_FLOORS[metric],
                )
                trackers[metric] = tracker
            tracker.update(sample, value, forward)
            if tracker.change_count:
                self._follow_windows(metric, tracker, sample)

    def _follow_windows(self, metric: str, tracker: SeriesTracker, sample: int) -> None:
        """Add ``sample`` to the window of the latest change point while it is open,
        and open a window when the tracker found a new change point."""
        seen, remaining = self._windows_open.get(metric, (0, 0))
        points = self.change_windows.setdefault(metric, [])
        change = tracker.latest_change
        if tracker.change_count != seen and change is not None:
            start = change.start_sample
            found = []
            for s in range(max(start - _WINDOW_LOOKBACK_SAMPLES, 0), sample + 1):
                departure = tracker.departure_at(s)
                if departure is not None and departure.sample == s:
                    found.append((s, departure.forward, tracker.level(departure.value)))
            before = [p for p in found if p[0] < start][-CHANGE_CONTEXT_SAMPLES:]
            after = [p for p in found if p[0] >= start]
            remaining = max(CHANGE_CONTEXT_SAMPLES + 1 - len(after), 0)
            self._add_points(points, before + after)
            self._windows_open[metric] = (tracker.change_count, remaining)
            return
        if remaining:
            departure = tracker.departure_at(sample)
            if departure is not None and departure.sample == sample:
                self._add_points(
                    points, [(sample, departure.forward, tracker.level(departure.value))]
                )
            self._windows_open[metric] = (seen, remaining - 1)

    @staticmethod
    def _add_points(
        points: list[tuple[int, int, float]], new: list[tuple[int, int, float]]
    ) -> None:
        known = {p[0] for p in points}
        points.extend(p for p in new if p[0] not in known)
        points.sort()
        if len(points) > MAX_WINDOW_POINTS:
            del points[: len(points) - MAX_WINDOW_POINTS]


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
