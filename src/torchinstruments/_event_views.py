"""What an event shows of its series for ``events``: the dense history around each
change, and the cross-section at the onset (the module and its neighbours in forward
order, each against its own trend).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .find import Candidate, display_module
from .series import CHANGE_CONTEXT_SAMPLES, RMS_TO_ROOT, TensorSeries, forward_positions
from .track import ChangePoint, SeriesTracker

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot
from ._event_groups import SameTensor

#: Points of an event's history outside the windows around its change points (evenly
#: spaced over the bounded history, the first and the latest included).
HISTORY_REST_POINTS = 16
#: Neighbours listed on each side of an event's module in its cross-section.
CROSS_SECTION_NEIGHBOURS = 3
#: Departure, in residual spreads, from which a neighbour counts as having moved at the
#: onset (the cross-section's ``moved``), as ``find.base.UPSTREAM_DEPARTURE_SPREADS``.
MOVED_SPREADS = 3.0


def event_history(
    series: TensorSeries, metric: str, tracker: SeriesTracker, observer: RunSnapshot
) -> list[list[float | int | None]]:
    """``[sample, forward, value]`` points of one series: every observed sample from
    ``CHANGE_CONTEXT_SAMPLES`` before to as many after each change point's first sample
    (``TensorSeries.change_windows``), and ``HISTORY_REST_POINTS`` points of the bounded
    history (the first and the latest among them), in sample order. ``forward`` is the
    sample's training forward (None where the schedule no longer says)."""
    history = tracker.history()
    if len(history) > HISTORY_REST_POINTS:
        step = (len(history) - 1) / (HISTORY_REST_POINTS - 1)
        history = [history[round(i * step)] for i in range(HISTORY_REST_POINTS)]
    points: dict[int, tuple[int | None, float]] = {
        sample: (observer.sample_forwards.forward(sample), value) for sample, value in history
    }
    for sample, forward, value in series.change_windows.get(metric, ()):
        points[sample] = (forward, value)
    return [[sample, forward, value] for sample, (forward, value) in sorted(points.items())]


def cross_section(
    c: Candidate, observer: RunSnapshot, same: SameTensor
) -> list[dict[str, Any]] | None:
    """At the change's first sample, the candidate's module and up to
    ``CROSS_SECTION_NEIGHBOURS`` observed neighbours on each side in forward order
    (same signal, call and judged metric; one row per tensor): each value against its
    own trend forecast, as ``before`` (the forecast), ``after`` (observed), their
    ``ratio`` (log-scale metrics; a ``difference`` otherwise) and ``in_spreads`` (the
    departure in that series' own residual spreads), and ``offset`` (its place from the
    candidate's module, negative before it), with ``measured``: ``against_trend``. For
    a sample no longer among a neighbour's latest values, its row compares the kept
    points on each side of the sample (``measured``: ``between_kept_points``, with
    their ``samples``; ``in_spreads`` in its current residual spread). The module's own
    row (offset 0) is its change point's: the numbers the event states. None without a
    change point."""
    change = c.change
    if change is None:
        return None
    metric = c.metric if c.judged is c.tracker else RMS_TO_ROOT
    sample = change.start_sample
    signal = c.series.signal
    origin = c.series
    own = same.primary(origin)
    # One row per tensor: the candidate's own series stands for its tensor.
    peers = [
        s
        for s in observer.series.values()
        if s.signal == signal
        and metric in s.trackers
        and (s is origin or (same.primary(s) is s and s is not own))
    ]
    positions = forward_positions(observer.series.values())
    peers.sort(key=lambda s: (positions.get((s.module, s.call_index, s.tensor_path), 0), s.module))
    index = next((i for i, s in enumerate(peers) if s is origin), None)
    if index is None or metric not in origin.trackers:
        return None
    rows: list[dict[str, Any]] = []
    start = max(0, index - CROSS_SECTION_NEIGHBOURS)
    for offset, s in enumerate(peers[start : index + CROSS_SECTION_NEIGHBOURS + 1], start - index):
        tracker = s.trackers[metric]
        if s is origin and change.kind == "step":
            row = _change_row(tracker, change)  # the event's own numbers, at any age
        else:
            row = _trend_row(tracker, sample)
        if row is None:
            row = _history_row(s, metric, tracker, sample)
        if row is None:
            continue
        rows.append(
            {
                "offset": offset,
                "module": display_module(s.module),
                "call_index": s.call_index,
                "tensor_path": s.tensor_path,
                **row,
            }
        )
    return rows


def _against_trend(
    tracker: SeriesTracker, forecast: float, value: float, in_spreads: float
) -> dict[str, Any]:
    """A row of a value against its trend's forecast (both in tracked units)."""
    before = tracker.level(forecast)
    after = tracker.level(value)
    row: dict[str, Any] = {"measured": "against_trend", "before": before, "after": after}
    if tracker.log_scale:
        row["ratio"] = after / before if before > 0 else None
    else:
        row["difference"] = after - before
    row["in_spreads"] = in_spreads
    return row


def _change_row(tracker: SeriesTracker, change: ChangePoint) -> dict[str, Any]:
    """The module's own row: its change point's forecast, value and step in spreads (the
    numbers the event states)."""
    return _against_trend(tracker, change.level_before, change.level_after, change.step_z)


def _trend_row(tracker: SeriesTracker, sample: int) -> dict[str, Any] | None:
    """The value at ``sample`` against its trend forecast, while it is among the
    tracker's latest values."""
    departure = tracker.departure_at(sample)
    if departure is None:
        return None
    return _against_trend(tracker, departure.forecast, departure.value, departure.z)


def _history_row(
    s: TensorSeries, metric: str, tracker: SeriesTracker, sample: int
) -> dict[str, Any] | None:
    """For a ``sample`` older than the tracker's latest values: the kept points on each
    side of it (the windows around change points, else the bounded history), their
    ratio or difference, and that in the tracker's current residual spread."""
    points = sorted({*tracker.history(), *((p[0], p[2]) for p in s.change_windows.get(metric, ()))})
    before = next((p for p in reversed(points) if p[0] < sample), None)
    after = next((p for p in points if p[0] >= sample), None)
    if before is None or after is None:
        return None
    row: dict[str, Any] = {
        "measured": "between_kept_points",
        "samples": [before[0], after[0]],
        "before": before[1],
        "after": after[1],
    }
    spread = tracker.spread
    if tracker.log_scale:
        if before[1] <= 0 or after[1] <= 0:
            return None
        row["ratio"] = after[1] / before[1]
        change = math.log(after[1] / before[1])
    else:
        row["difference"] = after[1] - before[1]
        change = after[1] - before[1]
    row["in_spreads"] = change / spread if spread > 0 else None
    return row


def _echo_points(e: Candidate, observer: RunSnapshot) -> list[list[float | int | None]]:
    """``[sample, forward, value]`` of an echo's judged measure (``rms_to_root`` for an
    output gradient ranked on it) around its own change: the observed samples from
    ``CHANGE_CONTEXT_SAMPLES`` before to as many after its first sample (at most 7; for
    a break of trend, found when the report is built, the bounded history's points in
    that range)."""
    measure = e.metric if e.judged is e.tracker else RMS_TO_ROOT
    onset = e.onset
    if onset is None:
        return []
    low, high = onset - CHANGE_CONTEXT_SAMPLES, onset + CHANGE_CONTEXT_SAMPLES
    window = e.series.change_windows.get(measure, ())
    points: list[list[float | int | None]] = [
        [sample, forward, value] for sample, forward, value in window if low <= sample <= high
    ]
    if points:
        return points
    return [
        [sample, observer.sample_forwards.forward(sample), value]
        for sample, value in e.judged.history()
        if low <= sample <= high
    ]


def onset_of(sample: int | None, observer: RunSnapshot) -> dict[str, int | None]:
    """An event's ``onset``: its first sample, that sample's training forward, and
    ``after_forward``, the forward of the sample before it (None at the first sample or
    where the schedule no longer says): the change happened in the forwards after
    ``after_forward``, up to and including ``forward``."""
    forwards = observer.sample_forwards
    before = forwards.forward(sample - 1) if sample is not None and sample > 0 else None
    return {
        "sample": sample,
        "forward": forwards.forward(sample) if sample is not None else None,
        "after_forward": before,
    }
