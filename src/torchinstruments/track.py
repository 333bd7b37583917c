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
(:func:`fit_trend_break`); the rules judge whether the bend matters.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from .config import TrackConfig

__all__ = [
    "ChangePoint",
    "Departure",
    "SeriesPoint",
    "SeriesTracker",
    "TrendBreakFit",
    "fit_trend_break",
]

#: Least points of a trend break's fit at and before the break, and after it.
TREND_POINTS_BEFORE = 4
TREND_POINTS_AFTER = 3
#: Spreads past the earlier trend that date a trend break's onset.
TREND_ONSET_SPREADS = 2.0

#: Values at or below this are treated as this, before taking logs (a dead unit's RMS is 0).
LOG_FLOOR = 1e-30
_LOG_OF_FLOOR = math.log(LOG_FLOOR)
_LOG_OF_MAX = math.log(sys.float_info.max)
#: Change points kept per series (the largest steps survive when more are found).
MAX_CHANGES = 8
#: Latest CUSUM increments kept to place the start of a change (bounded run-up).
RUNUP_POINTS = 32
#: Latest points kept per series with their forecast, for cross-sections at a change.
RECENT_POINTS = 32
#: Gain of the trend's level: the share of a forecast residual taken into the level.
LEVEL_GAIN = 0.5
#: Gain of the trend's slope, per forward: ``slope += SLOPE_GAIN * residual / gap``. High,
#: so that the slope follows a curve that bends as training settles.
SLOPE_GAIN = 0.3
#: Gain of the spread's EMA of absolute residuals (about 10 samples of memory).
SPREAD_GAIN = 0.1
#: Mean absolute deviation to standard deviation for normal residuals: sqrt(pi / 2).
MAD_TO_STD = math.sqrt(math.pi / 2.0)
#: Share of the trend's predicted movement over a gap that a residual may take without
#: counting: a linear forecast of a smoothly bending series misses by a share of the
#: movement it predicts (more the longer the gap), and that is drift, not a change.
DRIFT_TOLERANCE = 0.5
#: Residuals past this many spreads are clipped (Huber) where they update the level, the
#: slope and the spread once the reference is trusted, so that a step is not absorbed at once.
RESIDUAL_CLIP = 3.0
#: Values after an alarm that confirm a change (or find it transient). One: the old
#: trend extrapolated further is no yardstick (a fault changes the dynamics after it),
#: and a spike returns at the next sample.
CONFIRM_SAMPLES = 1
#: A change whose next value returns to the old trend, within this share of its step (or
#: within ``REVERT_SPREADS`` spreads), is transient: a spike, not a change. A fault that
#: the optimizer partly compensates (a weight scaled down regrows behind a BatchNorm)
#: stays a change.
REVERT_SHARE = 0.2
REVERT_SPREADS = 3.0
#: Interpolation residuals after a change that give its spread after: a step into a
#: noisier regime is judged by the larger of the spreads before and after it (as a
#: two-sample test uses the variance of both samples), so that a curve whose noise grows
#: as it turns does not make its first wiggle a change of many spreads.
AFTER_RESIDUALS = 4


def bounded_exp(x: float) -> float:
    """``exp(x)``, saturated at the largest float instead of raising OverflowError (a
    ratio between log-tracked levels, one of them a forecast extrapolated past any value)."""
    return math.exp(x) if x < _LOG_OF_MAX else sys.float_info.max


#: Before any sample (the history's last kept sample, at first).
_NO_SAMPLE = -(1 << 62)


#: A CUSUM run-up entry: (sample, forward, excess residual in spreads, forecast, spread,
#: slope before the value, value), in tracked units.
_RunupEntry = tuple[int, int, float, float, float, float, float]


def _keep_runup(runup: list[_RunupEntry], entry: _RunupEntry) -> None:
    runup.append(entry)
    if len(runup) > RUNUP_POINTS:
        del runup[0]


def _first_largest(changes: Iterable[ChangePoint]) -> ChangePoint | None:
    largest: ChangePoint | None = None
    for change in changes:
        if largest is None or abs(change.step) > abs(largest.step):
            largest = change
    return largest


def _change_start(runup: list[_RunupEntry]) -> _RunupEntry:
    """Where a change began: the first entry of the CUSUM run-up whose excess residual
    is at least a quarter of the largest one in it. Page's estimate (the sample where the
    sum last left zero) runs early when noise keeps the sum just above zero before a large
    step; for a gradual shift both agree."""
    largest = max(entry[2] for entry in runup)
    for entry in runup:
        if entry[2] >= 0.25 * largest:
            return entry
    return runup[0]


class SeriesPoint(NamedTuple):
    """One observation: the sample index and the metric value in its own units.

    A named tuple: built once per update on the hot path, so it must be cheap.
    """

    sample: int
    value: float

    def as_dict(self) -> dict[str, float | int]:
        return {"sample": self.sample, "value": self.value}


class Departure(NamedTuple):
    """One value against its series' trend forecast, in tracked units.

    Attributes:
        sample: the sample index.
        forward: the training forward of the sample.
        forecast: the trend's forecast for this value (tracked units: log for scale
            metrics), from the values before it.
        value: the value observed (tracked units).
        spread: the residual spread the value is judged in (tracked units).
    """

    sample: int
    forward: int
    forecast: float
    value: float
    spread: float

    @property
    def z(self) -> float:
        """``(value - forecast) / spread``: the departure in the series' own noise units."""
        return (self.value - self.forecast) / self.spread


@dataclass(slots=True)
class ChangePoint:
    """A departure from the series' trend found by CUSUM, in tracked units (log for
    scale metrics).

    Attributes:
        start_sample: the first sample of the new level: within the CUSUM run-up (from
            where the alarming sum last left zero, Page 1954), the first sample whose
            excess residual is at least a quarter of the run-up's largest.
        alarm_sample: the sample at which CUSUM crossed its threshold.
        level_before: the trend's forecast for ``start_sample``, from the values before.
        std_before: the residual spread at ``start_sample``.
        spread_after: the noise of the values from the alarm on, free of any local
            linear trend: each value against the straight line through its neighbours
            (a second difference, for irregular spacing; divided by its standard deviation
            for unit noise, ``sqrt(1 + w_before^2 + w_after^2)``), as a mean absolute value
            times ``MAD_TO_STD``, over up to ``AFTER_RESIDUALS`` values (0 until the second
            value after the alarm).
        level_after: the value at ``start_sample``. The step is what the series did
            between two samples: a change that builds up over several samples (a curve
            that accelerates) has a small first step however far it goes.
        confirmed: the ``CONFIRM_SAMPLES`` values after the alarm stayed away from the
            old trend (by more than ``REVERT_SHARE`` of the step and ``REVERT_SPREADS``
            spreads).
        transient: a value after the alarm returned to the old trend.
        start_forward, alarm_forward: training forwards of those samples.
        slope_before: the trend's slope before the change, per training forward.
        reference_count: values the series had seen before the alarm (how much its
            reference rests on).
        kind: ``"step"`` (a CUSUM alarm: the level moved between two samples) or
            ``"trend"`` (a break of the trend found by :func:`fit_trend_break`: from
            ``start_sample`` on, the series moves at another slope; ``level_before`` is
            then the earlier trend extrapolated to ``alarm_sample``, the latest point,
            ``level_after`` the fitted value there, and both spreads the fit's residual
            spread).
        slope_after: for a trend break, the slope from ``start_sample`` on, per training
            forward (tracked units); 0 for a step.
        slope_change_t: for a trend break, the t-statistic of the change of slope (its
            least-squares estimate over its standard error); 0 for a step.
        value_before: for a step, the last value before ``start_sample`` (tracked
            units); NaN when none was kept.
    """

    start_sample: int
    alarm_sample: int
    level_before: float
    std_before: float
    level_after: float
    confirmed: bool = False
    transient: bool = False
    start_forward: int = -1
    alarm_forward: int = -1
    slope_before: float = 0.0
    reference_count: int = 0
    spread_after: float = 0.0
    kind: str = "step"
    slope_after: float = 0.0
    slope_change_t: float = 0.0
    value_before: float = math.nan
    _after_count: int = 1
    _after_sum: float = 0.0
    _after_residuals: int = 0
    _after_points: tuple[tuple[int, float], ...] = ()

    @property
    def step(self) -> float:
        """``level_after - level_before`` in tracked units (log ratio for scale metrics)."""
        return self.level_after - self.level_before

    @property
    def step_z(self) -> float:
        """:attr:`step` in residual spreads: the larger of :attr:`std_before` and
        :attr:`spread_after`."""
        spread = self.std_before
        if self.spread_after > spread:
            spread = self.spread_after
        return self.step / spread

    @property
    def step_without_trend(self) -> float:
        """The part of a step that the slope before it cannot explain, in tracked units.

        :attr:`step` is measured from the trend's forecast, which carries the slope
        across the gap between two samples; the slope of a series that rose steeply is
        uncertain, and a series that merely stops rising departs from the forecast by the
        whole predicted movement. So the step is also measured from the last value before
        it (:attr:`value_before`: the slope stopped): the smaller of the two in size
        when both point the same way, else 0 (the value lies between the forecast and
        the last value). A step along the trend keeps its forecast-based size; one
        against it loses what the slope would have added. Breaks of trend, and changes
        without a value before them, return :attr:`step`.
        """
        step = self.step
        before = self.value_before
        if self.kind != "step" or math.isnan(before):
            return step
        flat = self.level_after - before
        if flat * step <= 0.0:
            return 0.0
        return step if abs(step) < abs(flat) else flat

    @property
    def step_without_trend_z(self) -> float:
        """:attr:`step_without_trend` in residual spreads (the spread of :attr:`step_z`)."""
        spread = self.std_before
        if self.spread_after > spread:
            spread = self.spread_after
        return self.step_without_trend / spread

    def note_after(self, forward: int, value: float) -> None:
        """Count one value (tracked units) at ``forward``, from the alarm on, into
        :attr:`spread_after`."""
        points = self._after_points
        if len(points) < 2:
            self._after_points = (*points, (forward, value))
            return
        (f0, v0), (f1, v1) = points
        self._after_points = ((f1, v1), (forward, value))
        span = forward - f0
        if span <= 0:
            return
        w = (f1 - f0) / span
        residual = v1 - (v0 + (value - v0) * w)
        self._after_sum += abs(residual) / math.sqrt(1.0 + w * w + (1.0 - w) * (1.0 - w))
        self._after_residuals += 1
        self.spread_after = MAD_TO_STD * self._after_sum / self._after_residuals


class TrendBreakFit(NamedTuple):
    """The best broken line through a series' points (see :func:`fit_trend_break`).

    Attributes:
        position: where the two pieces meet, in the units of ``x`` (between two points,
            or on one).
        slope_before, slope_after: slopes of the two pieces, per unit of ``x``.
        departure: how far the second piece is from the first one's extension at the
            last point (``(slope_after - slope_before) * (x_last - x_break)``).
        spread: residual standard deviation of the fit, ``sqrt(RSS / (n - 3))``.
        t: ``(slope_after - slope_before)`` over its standard error.
        level_end: the fitted value at the last point.
    """

    position: float
    slope_before: float
    slope_after: float
    departure: float
    spread: float
    t: float
    level_end: float


def _broken_line(
    n: int, sums: tuple[float, float, float, float, float], hinge: tuple[float, float, float, float]
) -> tuple[float, float, float, float, float] | None:
    """Solve the 3x3 normal equations of ``v = a + s*u + d*h`` (``h = max(0, u - u_b)``)
    from the sums ``(Su, Suu, Sv, Suv, Svv)`` and ``(Sh, Shh, Suh, Shv)``; return
    ``(rss, a, s, d, (X'X)^-1_dd)``, or None for a singular system (Cramer's rule)."""
    s_u, s_uu, s_v, s_uv, s_vv = sums
    s_h, s_hh, s_uh, s_hv = hinge
    a11, a12, a13, a22, a23, a33 = float(n), s_u, s_h, s_uu, s_uh, s_hh
    c11 = a22 * a33 - a23 * a23
    c12 = a13 * a23 - a12 * a33
    c13 = a12 * a23 - a13 * a22
    det = a11 * c11 + a12 * c12 + a13 * c13
    if not det > 1e-12 * max(a11 * a22 * a33, 1e-300):
        return None
    c22 = a11 * a33 - a13 * a13
    c23 = a12 * a13 - a11 * a23
    c33 = a11 * a22 - a12 * a12
    coef_a = (c11 * s_v + c12 * s_uv + c13 * s_hv) / det
    coef_s = (c12 * s_v + c22 * s_uv + c23 * s_hv) / det
    coef_d = (c13 * s_v + c23 * s_uv + c33 * s_hv) / det
    rss = s_vv - (coef_a * s_v + coef_s * s_uv + coef_d * s_hv)
    return rss, coef_a, coef_s, coef_d, c33 / det


def _hinge_sums(us: list[float], vs: list[float], ub: float) -> tuple[float, float, float, float]:
    """``(Sh, Shh, Suh, Shv)`` of the hinge column ``max(0, u - ub)``, directly."""
    s_h = s_hh = s_uh = s_hv = 0.0
    for u, v in zip(us, vs, strict=True):
        if u > ub:
            h = u - ub
            s_h += h
            s_hh += h * h
            s_uh += u * h
            s_hv += h * v
    return s_h, s_hh, s_uh, s_hv


#: Golden-section steps that place a break between its neighbouring points.
_REFINE_STEPS = 24
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def fit_trend_break(
    xs: list[float],
    ys: list[float],
    *,
    points_before: int = TREND_POINTS_BEFORE,
    points_after: int = TREND_POINTS_AFTER,
    spread_floor: float = 0.0,
) -> TrendBreakFit | None:
    """Least-squares fit of a continuous broken line (two straight pieces that meet at a
    point), ``y = a + s*x + d*max(0, x - x_b)`` (segmented regression, Hinkley 1971).

    Every point with at least ``points_before`` points at or before it and
    ``points_after`` after it is tried as ``x_b``, each in O(1) from suffix sums; the one
    with the smallest residual sum of squares is then moved, by golden-section search,
    to the best position between its two neighbouring points (a bend between two
    sparse samples is dated where the lines meet, not at the point before it).

    Args:
        xs: increasing positions (training forwards).
        ys: values at them (tracked units), as long as ``xs``.
        points_before, points_after: least points at or before the break, and after it.
        spread_floor: least residual spread (a perfect fit is not infinitely sure).

    Returns:
        The fit, or None with too few points or degenerate positions.
    """
    n = len(xs)
    if n < points_before + points_after or n != len(ys):
        return None
    x0, span = xs[0], xs[-1] - xs[0]
    if span <= 0:
        return None
    us = [(x - x0) / span for x in xs]
    mean_y = sum(ys) / n
    vs = [y - mean_y for y in ys]
    sums = (
        sum(us),
        sum(u * u for u in us),
        sum(vs),
        sum(u * v for u, v in zip(us, vs, strict=True)),
        sum(v * v for v in vs),
    )
    best: tuple[float, int] | None = None
    # Suffix sums over the points strictly after each break candidate.
    t_u = t_uu = t_v = t_uv = 0.0
    for count, b in enumerate(range(n - 1, points_before - 2, -1)):
        if count >= points_after and b >= points_before - 1:
            ub = us[b]
            hinge = (
                t_u - count * ub,
                t_uu - 2.0 * ub * t_u + count * ub * ub,
                t_uu - ub * t_u,
                t_uv - ub * t_v,
            )
            solved = _broken_line(n, sums, hinge)
            if solved is not None and (best is None or solved[0] < best[0]):
                best = (solved[0], b)
        u, v = us[b], vs[b]
        t_u += u
        t_uu += u * u
        t_v += v
        t_uv += u * v
    if best is None:
        return None
    index = best[1]

    def rss_at(ub: float) -> float:
        solved = _broken_line(n, sums, _hinge_sums(us, vs, ub))
        return math.inf if solved is None else solved[0]

    low, high = us[index - 1] if index > 0 else us[index], us[index + 1]
    x1, x2 = high - _GOLDEN * (high - low), low + _GOLDEN * (high - low)
    r1, r2 = rss_at(x1), rss_at(x2)
    for _ in range(_REFINE_STEPS):
        if r1 <= r2:
            high, x2, r2 = x2, x1, r1
            x1 = high - _GOLDEN * (high - low)
            r1 = rss_at(x1)
        else:
            low, x1, r1 = x1, x2, r2
            x2 = low + _GOLDEN * (high - low)
            r2 = rss_at(x2)
    ub = x1 if r1 <= r2 else x2
    solved = _broken_line(n, sums, _hinge_sums(us, vs, ub))
    if solved is None or solved[0] > best[0]:
        ub = us[index]
        solved = _broken_line(n, sums, _hinge_sums(us, vs, ub))
    assert solved is not None
    rss, coef_a, coef_s, coef_d, inverse_dd = solved
    spread = max(math.sqrt(max(rss, 0.0) / (n - 3)), spread_floor)
    error = spread * math.sqrt(max(inverse_dd, 0.0))
    departure = coef_d * (1.0 - ub)
    if error > 0.0:
        t = coef_d / error
    else:  # an exact fit: a break is certain if there is one at all
        t = math.copysign(math.inf, coef_d) if abs(departure) > 1e-9 * (1.0 + abs(mean_y)) else 0.0
    return TrendBreakFit(
        position=x0 + ub * span,
        slope_before=coef_s / span,
        slope_after=(coef_s + coef_d) / span,
        departure=departure,
        spread=spread,
        t=t,
        level_end=mean_y + coef_a + coef_s + departure,
    )


class SeriesTracker:
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
        self._history_last = _NO_SAMPLE
        #: Every value so far was equal (see :meth:`_repeat`).
        self._constant = True

    # ------------------------------------------------------------------ update
    def transform(self, value: float) -> float:
        """Map a raw value to tracked units (``ln`` for log-scale series)."""
        if self._log_scale:
            return math.log(value if value > LOG_FLOOR else LOG_FLOOR)
        return value

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

    @property
    def latest(self) -> SeriesPoint | None:
        """The latest observation, or None before the first."""
        if not self.count:
            return None
        return SeriesPoint(self._latest_sample, self._latest_value)

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

    def _cusum(
        self, sample: int, forward: int, v: float, forecast: float, z: float, spread: float
    ) -> bool:
        """Page's two-sided CUSUM step on the excess residual ``z`` (in spreads); on an
        alarm, record the change and re-anchor (returns True)."""
        k = self._config.cusum_allowance
        slope = self._slope
        pos = self._cusum_pos + z - k
        if pos > 0.0:
            if self._cusum_pos <= 0.0:
                self._runup_pos.clear()
            self._cusum_pos = pos
            _keep_runup(self._runup_pos, (sample, forward, z, forecast, spread, slope, v))
        else:
            self._cusum_pos = 0.0
        neg = self._cusum_neg - z - k
        if neg > 0.0:
            if self._cusum_neg <= 0.0:
                self._runup_neg.clear()
            self._cusum_neg = neg
            _keep_runup(self._runup_neg, (sample, forward, -z, forecast, spread, slope, v))
        else:
            self._cusum_neg = 0.0
        peak = max(self._cusum_pos, self._cusum_neg)
        if peak > self.cusum_peak:
            self.cusum_peak = peak
        if peak <= self._config.cusum_threshold:
            return False
        runup = self._runup_pos if self._cusum_pos >= self._cusum_neg else self._runup_neg
        self._alarm(sample, forward, v, runup)
        return True

    def _alarm(self, sample: int, forward: int, v: float, runup: list[_RunupEntry]) -> None:
        """Record a change at ``sample`` that began within ``runup``, then re-anchor the
        trend on ``v`` with the slope from before the run-up."""
        start_sample, start_forward, _, forecast, spread, slope, after = _change_start(runup)
        latest = self.latest_change
        if (
            latest is not None
            and not latest.transient
            and start_sample <= latest.alarm_sample + 1
            and (after - forecast) * latest.step > 0.0
        ):
            # The same departure, still growing from one sample to the next (a curve
            # that accelerates): one change, whose step stays what happened at its
            # first sample.
            latest.alarm_sample = sample
            latest.alarm_forward = forward
            latest._after_sum = 0.0
            latest._after_residuals = 0
            latest._after_points = ((forward, v),)
            latest.spread_after = 0.0
            if latest not in self._measuring_after:
                self._measuring_after.append(latest)
        else:
            change = ChangePoint(
                start_sample=start_sample,
                alarm_sample=sample,
                level_before=forecast,
                std_before=spread,
                level_after=after,
                start_forward=start_forward,
                alarm_forward=forward,
                slope_before=slope,
                reference_count=self.count - 1,
                value_before=self._value_before(start_sample),
                _after_points=((forward, v),),
            )
            self.change_count += 1
            self.latest_change = change
            self._pending_change = change
            self._keep_change(change)
            self._measuring_after.append(change)
            if len(self._measuring_after) > MAX_CHANGES:
                del self._measuring_after[0]
        self._reanchor(v, slope)

    def _value_before(self, start_sample: int) -> float:
        """The last value before ``start_sample`` among the recent points (tracked
        units; NaN if none). A constant run keeps no recent points after its first, and
        its values are all equal; ``+ 0.0`` makes a signed zero the same either way."""
        for point in reversed(self._recent):
            if point[0] < start_sample:
                return point[3] + 0.0
        return math.nan

    def _measure_after(self, forward: int, v: float) -> None:
        """Feed one value to the spread after of each change still measuring it."""
        measuring = self._measuring_after
        for change in measuring:
            change.note_after(forward, v)
        if measuring[0]._after_residuals >= AFTER_RESIDUALS:
            self._measuring_after = [c for c in measuring if c._after_residuals < AFTER_RESIDUALS]

    def _reanchor(self, level: float, slope: float) -> None:
        """Restart the trend at ``level`` with ``slope``, CUSUM at zero."""
        self._level = level
        self._slope = slope
        self._cusum_pos = self._cusum_neg = 0.0
        self._runup_pos.clear()
        self._runup_neg.clear()

    def _follow_pending(self, pending: ChangePoint, forward: int, v: float) -> bool:
        """A value after an alarm: confirm the change, or find it transient (returns
        True: the value is back on the trend from before the change)."""
        after = v - pending.slope_before * (forward - pending.start_forward)
        back = abs(after - pending.level_before)
        if back < REVERT_SHARE * abs(pending.step) or back < REVERT_SPREADS * pending.std_before:
            pending.transient = True
            self._pending_change = None
            return True
        count = pending._after_count + 1
        pending._after_count = count
        if count > CONFIRM_SAMPLES:
            pending.confirmed = True
            self._pending_change = None
        return False

    def _keep_change(self, change: ChangePoint) -> None:
        # Bounded: past MAX_CHANGES, forget the smallest settled step (ties: the later),
        # or the smallest step but the newest.
        changes = self._changes
        changes.append(change)
        if len(changes) > MAX_CHANGES:
            pool = [c for c in changes[:-1] if c.transient] or changes[:-1]
            smallest = min(pool, key=lambda c: (abs(c.step), -c.alarm_sample))
            changes.remove(smallest)

    @property
    def changes(self) -> tuple[ChangePoint, ...]:
        """Up to ``MAX_CHANGES`` change points in alarm order (the largest steps are kept)."""
        return tuple(self._changes)

    def departure_at(self, sample: int) -> Departure | None:
        """The value at ``sample`` against its trend forecast, if it is among the latest
        ``RECENT_POINTS`` values (a constant series: the value is its own forecast)."""
        if self._constant and self.count:
            v = self.transform(self._latest_value)
            forward = self._forward if sample == self._latest_sample else -1
            return Departure(sample, forward, v, v, self._noise_floor)
        for point in reversed(self._recent):
            if point[0] == sample:
                return Departure(*point)
            if point[0] < sample:
                break
        return None

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

    # ------------------------------------------------------------------ views
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

    def _fit_trend_break(self) -> ChangePoint | None:
        start = self.warmup_end_sample
        if start is None or self._constant or self.first is None:
            return None
        for change in self._changes:
            if not change.transient and change.alarm_sample > start:
                start = change.alarm_sample
        points = [(s, v, f) for s, v, f in self._history if s >= start]
        if points and points[-1][0] != self._latest_sample:
            points.append((self._latest_sample, self._latest_value, self._forward))
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
