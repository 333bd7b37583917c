"""What a :class:`~torchinstruments.track.SeriesTracker` answers about its series:
its properties, its bounded history, its departure at a recent sample and the break of
its trend (fitted when asked). The tracker inherits them from :class:`_TrackerViews`.
"""

from __future__ import annotations

import math
from collections import deque

from ._trend import (
    _LOG_OF_FLOOR,
    LOG_FLOOR,
    SHIFT_POINTS_AFTER,
    TREND_ONSET_SPREADS,
    TREND_POINTS_AFTER,
    TREND_POINTS_BEFORE,
    ChangePoint,
    Departure,
    SeriesPoint,
    _first_largest,
    _RunupEntry,
    bounded_exp,
    find_sustained_shift,
    fit_trend_break,
)
from .config import TrackConfig


class _TrackerState:
    """The state of a :class:`~torchinstruments.track.SeriesTracker`: one slot per
    field, shared by the classes its code lives in (``SeriesTracker._reset`` says what
    each field starts at). A field the tracker gains is added here."""

    __slots__ = (
        "_alpha_fast",
        "_alpha_slow",
        "_base_count",
        "_base_m2",
        "_changes",
        "_config",
        "_constant",
        "_cusum_neg",
        "_cusum_pos",
        "_flip_ema",
        "_forward",
        "_history",
        "_history_last",
        "_history_stride",
        "_last_diff",
        "_latest_sample",
        "_latest_value",
        "_level",
        "_log_scale",
        "_measuring_after",
        "_noise_floor",
        "_peak",
        "_pending_change",
        "_prev",
        "_recent",
        "_runup_neg",
        "_runup_pos",
        "_slope",
        "_spread",
        "_sustained_shift",
        "_trend_break",
        "_vol_rate_ema",
        "_vol_sq_ema",
        "_warm_gap_mean",
        "_warm_vol_rate",
        "_warm_vol_sq",
        "_warmup",
        "baseline_mean",
        "baseline_std",
        "baseline_volatility",
        "change_count",
        "count",
        "cusum_peak",
        "diffs",
        "ema_fast",
        "ema_slow",
        "first",
        "first_nonzero",
        "flips",
        "latest_change",
        "max",
        "max_drawdown",
        "min",
        "momentum",
        "nonzero_count",
        "warmup_end_sample",
    )

    _config: TrackConfig
    _log_scale: bool
    _noise_floor: float
    _alpha_fast: float
    _alpha_slow: float
    _warmup: int
    count: int
    first: SeriesPoint | None
    _latest_sample: int
    _latest_value: float
    _forward: int
    min: SeriesPoint | None
    max: SeriesPoint | None
    first_nonzero: SeriesPoint | None
    warmup_end_sample: int | None
    nonzero_count: int
    ema_fast: float
    ema_slow: float
    _warm_vol_sq: float
    _warm_vol_rate: float
    _warm_gap_mean: float
    _base_count: int
    _base_m2: float
    baseline_mean: float
    baseline_std: float
    baseline_volatility: float
    _level: float
    _slope: float
    _spread: float
    _cusum_pos: float
    _cusum_neg: float
    _runup_pos: list[_RunupEntry]
    _runup_neg: list[_RunupEntry]
    _recent: deque[tuple[int, int, float, float, float]]
    cusum_peak: float
    _pending_change: ChangePoint | None
    _changes: list[ChangePoint]
    latest_change: ChangePoint | None
    _measuring_after: list[ChangePoint]
    change_count: int
    momentum: float
    _peak: float
    max_drawdown: float
    _vol_sq_ema: float
    _vol_rate_ema: float
    _prev: float
    _last_diff: float
    flips: int
    diffs: int
    _flip_ema: float
    _history: list[tuple[int, float, int]]
    _history_stride: int
    _trend_break: tuple[int, ChangePoint | None]
    _sustained_shift: tuple[int, float, ChangePoint | None]
    _history_last: int
    _constant: bool


class _TrackerViews(_TrackerState):
    """The read side of :class:`~torchinstruments.track.SeriesTracker`."""

    __slots__ = ()

    def transform(self, value: float) -> float:
        """Map a raw value to tracked units (``ln`` for log-scale series)."""
        if self._log_scale:
            return math.log(value if value > LOG_FLOOR else LOG_FLOOR)
        return value

    @property
    def latest(self) -> SeriesPoint | None:
        """The latest observation, or None before the first."""
        if not self.count:
            return None
        return SeriesPoint(self._latest_sample, self._latest_value)

    @property
    def changes(self) -> tuple[ChangePoint, ...]:
        """Up to ``MAX_CHANGES`` change points in alarm order (the largest steps are kept)."""
        return tuple(self._changes)

    def departure_at(self, sample: int) -> Departure | None:
        """The value at ``sample`` against its trend forecast, if it is among the latest
        ``RECENT_POINTS`` values (a constant series: the value is its own forecast, up to
        its latest sample; a later sample had no value, as when the module was no longer
        called)."""
        if self._constant and self.count:
            if sample > self._latest_sample:
                return None
            v = self.transform(self._latest_value)
            forward = self._forward if sample == self._latest_sample else -1
            return Departure(sample, forward, v, v, self._noise_floor)
        for point in reversed(self._recent):
            if point[0] == sample:
                return Departure(*point)
            if point[0] < sample:
                break
        return None

    @property
    def config(self) -> TrackConfig:
        """The tracking configuration this tracker was built with."""
        return self._config

    @property
    def log_scale(self) -> bool:
        """True if the series is tracked in log space."""
        return self._log_scale

    @property
    def warmup_complete(self) -> bool:
        """True once ``warmup_samples`` values have been seen and the baseline is frozen."""
        return self.count >= self._config.warmup_samples

    @property
    def largest_change(self) -> ChangePoint | None:
        """The confirmed change with the largest step (the first of equals), or None."""
        return _first_largest(c for c in self._changes if c.confirmed)

    @property
    def strongest_change(self) -> ChangePoint | None:
        """The largest step among the kept changes that are not transient (the first of
        equals, so an earlier change wins a tie)."""
        return _first_largest(c for c in self._changes if not c.transient)

    @property
    def trend_level(self) -> float:
        """The trend's level at the latest value, in tracked units."""
        return self._level

    @property
    def trend_slope(self) -> float:
        """The trend's slope, in tracked units per training forward."""
        return self._slope

    @property
    def spread(self) -> float:
        """The robust spread of forecast residuals that the latest value was judged in,
        in tracked units (floored; the spread grows with the square root of the gap in
        forwards: an EMA of ``MAD_TO_STD * |residual| / sqrt(gap)``)."""
        if self._constant or not self._recent:
            return self._noise_floor
        return self._recent[-1][4]

    @property
    def cusum_positive(self) -> float:
        """Current upper CUSUM statistic, in residual spreads."""
        return self._cusum_pos

    @property
    def cusum_negative(self) -> float:
        """Current lower CUSUM statistic, in residual spreads."""
        return self._cusum_neg

    @property
    def warmup_mean_gap(self) -> float:
        """Mean gap between warm-up values, in training forwards (0 before the second)."""
        return self._warm_gap_mean

    @property
    def volatility_ratio(self) -> float:
        """Volatility now over volatility in warm-up, both per forward: the EMA (fast
        factor) of squared clipped excess residuals divided by their gaps, over the
        warm-up's mean of the same. Under a random walk a residual's variance grows with
        its gap, so a schedule whose samples grow apart is not mistaken for growing
        volatility. The warm-up's is floored at 0.05 per sample at its mean gap."""
        warm = self._warm_vol_rate
        floor = 0.0025 / max(self._warm_gap_mean, 1.0)
        if warm < floor:
            warm = floor
        return math.sqrt(max(self._vol_rate_ema, 0.0) / warm)

    @property
    def volatility(self) -> float:
        """EMA estimate of the root mean square forecast residual, excess over drift and
        clipped at ``RESIDUAL_CLIP`` spreads (tracked units)."""
        return math.sqrt(max(self._vol_sq_ema, 0.0))

    @property
    def flip_rate(self) -> float:
        """Slow EMA of sign flips between consecutive differences; 2/3 for i.i.d. noise."""
        return self._flip_ema

    @property
    def shift(self) -> float:
        """Fast EMA minus the run's baseline, in tracked units (log ratio for scale metrics)."""
        return self.ema_fast - self.baseline_mean

    @property
    def shift_z(self) -> float:
        """:attr:`shift` in baseline standard deviations."""
        return self.shift / self.baseline_std

    @property
    def drawdown(self) -> float:
        """Current decline from the running peak, in tracked units."""
        return self._peak - self._prev if self.count else 0.0

    def history(self) -> list[tuple[int, float]]:
        """Bounded ``(sample, value)`` points, oldest first: the first, those on a grid of
        sample indices whose stride doubles each time the history fills (the same grid for
        every series), and the latest."""
        points = [(sample, value) for sample, value, _ in self._history]
        if self.latest is not None and (not points or points[-1][0] != self.latest.sample):
            points.append((self.latest.sample, self.latest.value))
        return points

    def trend_break(self) -> ChangePoint | None:
        """The best break of the trend in the bounded history, as a :class:`ChangePoint`
        of kind ``"trend"``, or None (fewer than ``TREND_POINTS_BEFORE`` +
        ``TREND_POINTS_AFTER`` points to fit, or a constant series).

        The fit (:func:`fit_trend_break`, positions in training forwards, values in
        tracked units) covers the history from the end of warm-up, or from the latest
        step change that was not transient (a step is a change of its own, which a
        broken line would mistake for a bend), to the latest value. Whether the break
        matters (its size, its t-statistic, how much faster the new slope is) is the
        rules' judgement. Computed when asked, once per new value.
        """
        if self._trend_break[0] == self.count:
            return self._trend_break[1]
        found = self._fit_trend_break()
        self._trend_break = (self.count, found)
        return found

    def _history_from(self, start: int) -> list[tuple[int, float, int]]:
        """The bounded history's ``(sample, value, forward)`` points from sample
        ``start`` on, with the latest value last (the history may not hold it yet)."""
        points = [(s, v, f) for s, v, f in self._history if s >= start]
        if points and points[-1][0] != self._latest_sample:
            points.append((self._latest_sample, self._latest_value, self._forward))
        return points

    def _fit_trend_break(self) -> ChangePoint | None:
        start = self.warmup_end_sample
        if start is None or self._constant or self.first is None:
            return None
        for change in self._changes:
            if not change.transient and change.alarm_sample > start:
                start = change.alarm_sample
        points = self._history_from(start)
        if len(points) < TREND_POINTS_BEFORE + TREND_POINTS_AFTER:
            return None
        fit = fit_trend_break(
            [float(f) for _, _, f in points],
            [self.transform(v) for _, v, _ in points],
            spread_floor=self._noise_floor,
        )
        if fit is None:
            return None
        spread = fit.spread
        end = points[-1]
        # The onset: the first sample at or after the bend, interpolated between the two
        # kept points around it (samples between kept points are evenly spread there).
        after = next(i for i, p in enumerate(points) if p[2] >= fit.position)
        # A curve that keeps bending after the break (growth that compounds) puts the
        # best corner early: the onset is the first value, from the corner on, that is
        # TREND_ONSET_SPREADS spreads past the earlier trend in the break's direction.
        direction = 1.0 if fit.departure > 0 else -1.0
        before_end = fit.level_end - fit.departure
        departed = next(
            (
                i
                for i in range(after, len(points))
                if direction
                * (
                    self.transform(points[i][1])
                    - (before_end - fit.slope_before * (end[2] - points[i][2]))
                )
                > TREND_ONSET_SPREADS * spread
            ),
            after,
        )
        onset_sample, onset_forward = points[departed][0], points[departed][2]
        if departed == after and after > 0 and points[after][2] > fit.position:
            s0, _, f0 = points[after - 1]
            share = (fit.position - f0) / (onset_forward - f0)
            onset_sample = min(s0 + math.ceil(share * (onset_sample - s0)), onset_sample)
            onset_forward = min(math.ceil(fit.position), onset_forward)
        return ChangePoint(
            start_sample=onset_sample,
            alarm_sample=end[0],
            level_before=fit.level_end - fit.departure,
            std_before=spread,
            level_after=fit.level_end,
            confirmed=True,
            start_forward=onset_forward,
            alarm_forward=end[2],
            slope_before=fit.slope_before,
            reference_count=min(self.count, onset_sample - self.first.sample),
            spread_after=spread,
            kind="trend",
            slope_after=fit.slope_after,
            slope_change_t=fit.t,
        )

    def sustained_shift(self, least_step: float) -> ChangePoint | None:
        """The largest sustained shift of level in the bounded history
        (:func:`~torchinstruments.track.find_sustained_shift`: two windows of points
        compared, for a series too noisy for one value to tell a step), as a
        :class:`ChangePoint` of kind ``"sustained_shift"``, or None.

        The windows lie from the end of warm-up on; ``least_step`` (tracked units) is the
        least ``|step|`` considered. The change starts at the first point of the new
        level (past halfway to it) and its alarm is the last point of the window after
        it (when the new level had held long enough to tell); ``level_before`` is the
        reference it is measured from, ``level_after`` the median after, and both
        spreads the step's standard error, so that ``step_z`` is the step in standard
        errors. Computed when asked, once per new value and ``least_step``.
        """
        cached = self._sustained_shift
        if cached[0] == self.count and cached[1] == least_step:
            return cached[2]
        found = self._find_sustained_shift(least_step)
        self._sustained_shift = (self.count, least_step, found)
        return found

    def _find_sustained_shift(self, least_step: float) -> ChangePoint | None:
        start = self.warmup_end_sample
        if start is None or self._constant or self.first is None:
            return None
        points = self._history_from(start)
        shift = find_sustained_shift(
            [float(f) for _, _, f in points],
            [self.transform(v) for _, v, _ in points],
            least_step=least_step,
            spread_floor=self._noise_floor,
        )
        if shift is None:
            return None
        first, last = points[shift.onset], points[shift.index + SHIFT_POINTS_AFTER - 1]
        return ChangePoint(
            start_sample=first[0],
            alarm_sample=last[0],
            level_before=shift.reference,
            std_before=shift.error,
            level_after=shift.level_after,
            confirmed=True,
            start_forward=first[2],
            alarm_forward=last[2],
            slope_before=shift.slope_before,
            reference_count=min(self.count, first[0] - self.first.sample),
            spread_after=shift.error,
            kind="sustained_shift",
        )

    def level(self, tracked: float) -> float:
        """Map a tracked-units level (an EMA, the baseline) back to the metric's units
        (0 for a log-scale level at ``LOG_FLOOR``, where exact zeros were recorded; the
        largest float for a level past it, such as a forecast extrapolated far beyond any
        value seen)."""
        if not self._log_scale:
            return tracked
        if tracked <= _LOG_OF_FLOOR:
            return 0.0
        return bounded_exp(tracked)
