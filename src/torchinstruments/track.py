"""Per-series trackers: fixed-size state updated once per sample.

A :class:`SeriesTracker` follows one series (module, call index, signal, tensor path,
metric) over samples. Its state has a fixed size whatever the run length: count; first,
latest, min and max values with their sample indices; fast and slow exponential moving
averages (EMA); a baseline frozen after warm-up; a local trend (level and slope per
training forward) with a robust spread of its forecast residuals; two-sided CUSUM on those
residuals; momentum; drawdown; volatility of residuals; oscillation (sign flips of
consecutive differences); the latest points (for cross-sections); and a bounded,
downsampled history for pictures.

Scale metrics (``rms``, ``mean_abs``, ``max_abs``, ``tail_ratio``) are tracked in natural
log space, so that trends, CUSUM and volatility measure relative change; fractions and
kurtosis are tracked as they are.

Change detection (see :class:`SeriesTracker`): each value is compared with the forecast of
the series' own local linear trend, Holt's exponential smoothing (Holt 1957; irregular
spacing handled as in Wright 1986, with time in training forwards), so that smooth drift
of any size is followed and only a departure from it counts. The part of a residual that a
bending trend can explain (``DRIFT_TOLERANCE`` of the trend's own predicted movement over
the gap) is not counted. What remains, in units of a robust spread of past residuals (mean
absolute residual times sqrt(pi/2), Huber-clipped, so that a fault does not inflate it),
feeds Page's two-sided CUSUM (Page 1954). An alarm records a :class:`ChangePoint` dated at
the sample where the departure began and re-anchors the trend on the new level; the next
``CONFIRM_SAMPLES`` values confirm the change or mark it transient.

A fault that bends the trend rather than stepping it is found when a report is built:
:meth:`SeriesTracker.trend_break` fits a continuous broken line to the bounded history
(:func:`fit_trend_break`); the rules judge whether the bend matters. A level that moved
and stayed in a series too noisy for one value to tell (the trend absorbs a step of a
few spreads within two samples) is found the same way, by comparing two windows of the
history (:meth:`SeriesTracker.sustained_shift`, :func:`find_sustained_shift`).

The tracker's code is in three places: its state and its updates here, its change
detection in ``_tracker_changes.py`` and what it answers (properties, history, the
trend break) in ``_tracker_views.py``; its constants, points, change points and the
broken-line fit are in ``_trend.py``.
"""

from __future__ import annotations

import math
from collections import deque

from ._tracker_changes import _TrackerChanges
from ._tracker_views import _TrackerViews
from ._trend import (
    _NO_SAMPLE,
    DRIFT_TOLERANCE,
    LEVEL_GAIN,
    LOG_FLOOR,
    MAD_TO_STD,
    RECENT_POINTS,
    RESIDUAL_CLIP,
    SLOPE_GAIN,
    SPREAD_GAIN,
    ChangePoint,
    Departure,
    SeriesPoint,
    SustainedShift,
    TrendBreakFit,
    _RunupEntry,
    bounded_exp,
    find_sustained_shift,
    fit_trend_break,
)
from .config import TrackConfig

__all__ = [
    "DRIFT_TOLERANCE",
    "LEVEL_GAIN",
    "LOG_FLOOR",
    "MAD_TO_STD",
    "RECENT_POINTS",
    "RESIDUAL_CLIP",
    "SLOPE_GAIN",
    "SPREAD_GAIN",
    "ChangePoint",
    "Departure",
    "SeriesPoint",
    "SeriesTracker",
    "SustainedShift",
    "TrendBreakFit",
    "bounded_exp",
    "find_sustained_shift",
    "fit_trend_break",
]


class SeriesTracker(_TrackerChanges, _TrackerViews):
    """Streaming state of one series, of fixed size.

    Args:
        config: the tracking configuration (warm-up length, EMA factors, CUSUM k and h).
        log_scale: track ``ln(value)`` rather than ``value`` (scale metrics).
        noise_floor: smallest residual spread (and baseline standard deviation), in
            tracked units (log units when ``log_scale``), so that a series that was
            nearly constant does not turn every later wiggle into an alarm.

    Two references are kept. The *baseline* is the mean and standard deviation of the
    first ``warmup_samples`` values of the run; :attr:`shift` measures the end-to-end
    movement against it (evidence only: real training moves far from its first values).
    The *trend* is the reference changes are measured against: a local level and slope
    per training forward (Holt's linear exponential smoothing; a value ``gap`` forwards
    after the last is forecast as ``level + slope * gap``). A residual's part within
    ``DRIFT_TOLERANCE`` of the predicted movement ``|slope * gap|`` is taken as drift; the
    rest, divided by the spread (``MAD_TO_STD`` times an EMA of absolute excess
    residuals, floored by ``noise_floor``), feeds two-sided CUSUM with allowance k and
    threshold h. CUSUM is armed once ``warmup_samples`` values have been seen (the
    trend and spread of early training are not a trustworthy reference). Once armed,
    residuals update level, slope and spread clipped at ``RESIDUAL_CLIP`` spreads. An
    alarm records a :class:`ChangePoint` and re-anchors the level on the new value
    (keeping the slope): a later step is a change of its own, never merged into an
    earlier one, and its onset is where it happened.

    The tracker is fed with :meth:`update` in increasing sample order with finite
    floats (callers skip undefined values), each with its training forward.

    Example:
        >>> tracker = SeriesTracker(TrackConfig(warmup_samples=3), log_scale=False, noise_floor=0.1)
        >>> for sample, value in enumerate([1.0, 2.0, 3.0, 10.0]):
        ...     tracker.update(sample, value)
        >>> tracker.count, tracker.warmup_complete, tracker.baseline_mean
        (4, True, 2.0)
    """

    # The state, one slot per field, is declared in _tracker_views._TrackerState.
    __slots__ = ()

    def __init__(self, config: TrackConfig, *, log_scale: bool, noise_floor: float) -> None:
        self._config = config
        self._log_scale = log_scale
        self._noise_floor = noise_floor
        self._alpha_fast = config.fast_ema_alpha
        self._alpha_slow = config.slow_ema_alpha
        self._warmup = config.warmup_samples
        self._reset()

    def _reset(self) -> None:
        self.count = 0
        self.first: SeriesPoint | None = None
        self._latest_sample = -1
        self._latest_value = 0.0
        self._forward = -1
        self.min: SeriesPoint | None = None
        self.max: SeriesPoint | None = None
        self.first_nonzero: SeriesPoint | None = None
        self.warmup_end_sample: int | None = None
        self.nonzero_count = 0
        self.ema_fast = 0.0
        self.ema_slow = 0.0
        self._warm_vol_sq = 0.0
        self._warm_vol_rate = 0.0
        self._warm_gap_mean = 0.0
        self._base_count = 0
        self._base_m2 = 0.0
        self.baseline_mean = 0.0
        self.baseline_std = self._noise_floor
        self.baseline_volatility = 0.0
        self._level = 0.0
        self._slope = 0.0
        self._spread = 0.0
        self._cusum_pos = 0.0
        self._cusum_neg = 0.0
        self._runup_pos: list[_RunupEntry] = []
        self._runup_neg: list[_RunupEntry] = []
        # Plain tuples (sample, forward, forecast, value, spread): built on every update.
        self._recent: deque[tuple[int, int, float, float, float]] = deque(maxlen=RECENT_POINTS)
        self.cusum_peak = 0.0
        self._pending_change: ChangePoint | None = None
        self._changes: list[ChangePoint] = []
        self.latest_change: ChangePoint | None = None
        # Changes whose spread after is still being measured (at most MAX_CHANGES).
        self._measuring_after: list[ChangePoint] = []
        self.change_count = 0
        self.momentum = 0.0
        self._peak = -math.inf
        self.max_drawdown = 0.0
        self._vol_sq_ema = 0.0
        self._vol_rate_ema = 0.0
        self._prev = 0.0
        self._last_diff = 0.0
        self.flips = 0
        self.diffs = 0
        self._flip_ema = 2.0 / 3.0
        self._history: list[tuple[int, float, int]] = []
        self._history_stride = 1
        self._trend_break: tuple[int, ChangePoint | None] = (-1, None)
        self._sustained_shift: tuple[int, float, ChangePoint | None] = (-1, 0.0, None)
        self._history_last = _NO_SAMPLE
        #: Every value so far was equal (see :meth:`_repeat`).
        self._constant = True

    # ------------------------------------------------------------------ update

    def update(self, sample: int, value: float, forward: int | None = None) -> None:
        """Add the value observed at ``sample`` (0-based sample index).

        Args:
            sample: the sample index, increasing from call to call.
            value: the metric value, finite.
            forward: the training forward of the sample (0-based), increasing; default
                ``sample`` (samples one forward apart).
        """
        # The hot path of the host side (one call per series and metric per sample):
        # a SeriesPoint is built only where one is kept.
        if forward is None:
            forward = sample
        if self._constant and self.count:
            if value == self._latest_value:
                self._repeat(sample, value, forward)
                return
            self._constant = False
        v = self.transform(value)
        count = self.count + 1
        self.count = count
        self._latest_sample = sample
        self._latest_value = value
        alpha_fast = self._alpha_fast
        if count == 1:
            point = SeriesPoint(sample, value)
            self.first = point
            self.min = point
            self.max = point
            self.ema_fast = v
            self.ema_slow = v
        else:
            if value < self.min.value:  # type: ignore[union-attr]
                self.min = SeriesPoint(sample, value)
            elif value > self.max.value:  # type: ignore[union-attr]
                self.max = SeriesPoint(sample, value)
            self.ema_fast += alpha_fast * (v - self.ema_fast)
            self.ema_slow += self._alpha_slow * (v - self.ema_slow)
        if value != 0.0:
            self.nonzero_count += 1
            if self.first_nonzero is None:
                self.first_nonzero = SeriesPoint(sample, value)

        warmup = self._warmup
        if count > 1:
            diff = v - self._prev
            self.momentum += alpha_fast * (diff - self.momentum)
            if self.diffs > 0:
                if diff * self._last_diff < 0.0:
                    self.flips += 1
                    self._flip_ema += self._alpha_slow * (1.0 - self._flip_ema)
                else:
                    self._flip_ema -= self._alpha_slow * self._flip_ema
            if diff != 0.0:
                self._last_diff = diff
            self.diffs += 1
        self._prev = v

        if v > self._peak:
            self._peak = v
        drawdown = self._peak - v
        if drawdown > self.max_drawdown:
            self.max_drawdown = drawdown

        if count <= warmup:
            # Welford's update of the warm-up baseline's mean and sum of squares.
            self._base_count = count
            delta = v - self.baseline_mean
            self.baseline_mean += delta / count
            self._base_m2 += delta * (v - self.baseline_mean)
            if count > 1:
                self.baseline_std = max(math.sqrt(self._base_m2 / (count - 1)), self._noise_floor)
            if count == warmup:
                self.warmup_end_sample = sample
        self._update_trend(sample, forward, v, count)
        stride = self._history_stride
        if sample % stride == 0 or sample > self._history_last + stride:
            self._append_history(sample, value, forward)

    def _repeat(self, sample: int, value: float, forward: int) -> None:
        """:meth:`update` for a series whose every value so far equals ``value``, with
        the same resulting state in fewer steps (a zero ``nonfinite_fraction`` is such a
        series in nearly every run, a zero ``zero_fraction`` in most): the EMAs,
        momentum, trend, residuals and baseline already equal the value or zero, CUSUM
        stays at zero and the spread at its floor, so only counters, the decay of the
        flip rate, the forward and the history move (the latest points are implied:
        every forecast equals the value)."""
        count = self.count + 1
        self.count = count
        self._latest_sample = sample
        self._latest_value = value
        if 1 < count <= self._warmup:
            gap = forward - self._forward if forward > self._forward else 1
            self._warm_gap_mean += (gap - self._warm_gap_mean) / (count - 1)
        self._forward = forward
        if value != 0.0:
            self.nonzero_count += 1
        if self.diffs > 0:
            self._flip_ema -= self._alpha_slow * self._flip_ema
        self.diffs += 1
        if not self._log_scale:
            self._prev = value  # the same number, down to the sign of a zero
        if count <= self._warmup:
            self._base_count = count
            if count == self._warmup:
                self.warmup_end_sample = sample
        stride = self._history_stride
        if sample % stride == 0 or sample > self._history_last + stride:
            self._append_history(sample, value, forward)

    def _update_trend(self, sample: int, forward: int, v: float, count: int) -> None:
        """Forecast ``v`` from the trend, run CUSUM on the excess residual, then update
        level, slope and spread (see the class docstring)."""
        if count == 1 or self._forward < 0:
            self._level = v
            self._slope = 0.0
            self._forward = forward
            self._recent.append((sample, forward, v, v, self._noise_floor))
            return
        gap = forward - self._forward
        if gap < 1:
            gap = 1
        self._forward = forward
        moved = self._slope * gap
        forecast = self._level + moved
        residual = v - forecast
        tolerance = DRIFT_TOLERANCE * abs(moved)
        if residual > tolerance:
            excess = residual - tolerance
        elif residual < -tolerance:
            excess = residual + tolerance
        else:
            excess = 0.0
        root_gap = math.sqrt(gap)
        spread = self._spread * root_gap
        if spread < self._noise_floor:
            spread = self._noise_floor
        self._recent.append((sample, forward, forecast, v, spread))
        armed = count > self._warmup
        used = excess
        if armed:
            bound = RESIDUAL_CLIP * spread
            if used > bound:
                used = bound
            elif used < -bound:
                used = -bound
        # Volatility: EMA of squared (clipped) excess residuals, in tracked units.
        self._vol_sq_ema += self._alpha_fast * (used * used - self._vol_sq_ema)
        self._vol_rate_ema += self._alpha_fast * (used * used / gap - self._vol_rate_ema)
        if self._measuring_after:
            self._measure_after(forward, v)
        pending = self._pending_change
        if pending is not None and self._follow_pending(pending, forward, v):
            # Back on the trend from before the change: re-anchor there, no new change.
            self._reanchor(v, pending.slope_before)
            return
        if armed and self._cusum(sample, forward, v, forecast, excess / spread, spread):
            return  # re-anchored on the new level
        correction = residual - excess + used
        self._level = forecast + LEVEL_GAIN * correction
        self._slope += SLOPE_GAIN * correction / gap
        self._spread += SPREAD_GAIN * (MAD_TO_STD * abs(used) / root_gap - self._spread)
        if not armed:
            # The warm-up's residual volatility: RMS of its excess residuals.
            self._warm_vol_sq += excess * excess
            self.baseline_volatility = math.sqrt(self._warm_vol_sq / (count - 1))
            self._warm_vol_rate += (excess * excess / gap - self._warm_vol_rate) / (count - 1)
            self._warm_gap_mean += (gap - self._warm_gap_mean) / (count - 1)

    def _append_history(self, sample: int, value: float, forward: int) -> None:
        """Keep a point on the history's grid: sample indices that are multiples of the
        stride, the same for every series and run (so that series that began at
        different samples, or two runs, keep the same samples), or, for a series that
        misses the grid, a point more than a stride after the last one kept. When full,
        the stride doubles and the points off the new grid go (the first stays)."""
        self._history.append((sample, value, forward))
        self._history_last = sample
        if len(self._history) < self._config.history_points:
            return
        stride = self._history_stride * 2
        self._history_stride = stride
        kept: list[tuple[int, float, int]] = []
        last = _NO_SAMPLE
        for point in self._history:
            if not kept or point[0] % stride == 0 or point[0] > last + stride:
                kept.append(point)
                last = point[0]
        if len(kept) >= self._config.history_points:
            kept = self._history[::2]  # not reduced by the grid: every other point
        self._history = kept
        self._history_last = kept[-1][0]
