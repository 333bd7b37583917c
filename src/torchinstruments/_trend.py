"""The pieces of a tracker that are not its state: its constants, the points and change
points it records, and the broken-line fit of a trend break (:func:`fit_trend_break`).
``track.py`` holds :class:`~torchinstruments.track.SeriesTracker` and describes the
method.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from ._metrics import MAD_TO_STD as MEDIAN_DEVIATION_TO_STD

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
        kind: ``"step"`` (a CUSUM alarm: the level moved between two samples),
            ``"trend"`` (a break of the trend found by :func:`fit_trend_break`: from
            ``start_sample`` on, the series moves at another slope; ``level_before`` is
            then the earlier trend extrapolated to ``alarm_sample``, the latest point,
            ``level_after`` the fitted value there, and both spreads the fit's residual
            spread), or ``"sustained_shift"`` (a sustained shift found by
            :func:`find_sustained_shift` over two windows of the history: ``level_before``
            is the reference it is measured from, ``level_after`` the median of the
            window after, both spreads the step's standard error).
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


#: Points of a sustained shift's window before it (:func:`find_sustained_shift`).
SHIFT_POINTS_BEFORE = 8
#: Points of a sustained shift's window from it on: the new level must hold this long.
SHIFT_POINTS_AFTER = 5


class SustainedShift(NamedTuple):
    """A level that moved and stayed, found by comparing two windows of a series'
    points (see :func:`find_sustained_shift`). Units are the series' (tracked units).

    Attributes:
        index: the first point of the window after (an index into the points given).
        onset: the first point of the new level: the first in the window after that
            lies past halfway from ``reference`` to ``level_after``.
        reference: the level the shift is measured from: the median of the window
            before, or the window's own straight line carried over the window after,
            whichever leaves the smaller step (see :func:`find_sustained_shift`).
        level_after: the median of the window from ``index`` on.
        spread: robust standard deviation of the window before about its line.
        error: standard error of the step, ``spread * sqrt(1/n_before + 1/n_after)``.
        slope_before: slope of the window before's line, per unit of ``x``.
    """

    index: int
    onset: int
    reference: float
    level_after: float
    spread: float
    error: float
    slope_before: float

    @property
    def step(self) -> float:
        """``level_after - reference``."""
        return self.level_after - self.reference

    @property
    def z(self) -> float:
        """:attr:`step` over its standard error."""
        return self.step / self.error


def _shift_at(
    xs: list[float], ys: list[float], index: int, before: int, after: int, spread_floor: float
) -> SustainedShift | None:
    """The shift at ``index`` between ``before`` points before it and ``after`` from it."""
    bx, by = xs[index - before : index], ys[index - before : index]
    ax, ay = xs[index : index + after], ys[index : index + after]
    slopes = [
        (by[j] - by[i]) / (bx[j] - bx[i])
        for i in range(before)
        for j in range(i + 1, before)
        if bx[j] > bx[i]
    ]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    intercept = statistics.median([y - slope * x for x, y in zip(bx, by, strict=True)])
    residuals = [y - (intercept + slope * x) for x, y in zip(bx, by, strict=True)]
    centre = statistics.median(residuals)
    spread = MEDIAN_DEVIATION_TO_STD * statistics.median([abs(r - centre) for r in residuals])
    spread = max(spread, spread_floor)
    if not spread > 0.0:
        return None
    level_after = statistics.median(ay)
    flat = level_after - statistics.median(by)
    along = statistics.median([y - (intercept + slope * x) for x, y in zip(ax, ay, strict=True)])
    if flat * along <= 0.0:
        return None
    step = flat if abs(flat) < abs(along) else along
    reference = level_after - step
    # The new level begins at its first value past halfway from the reference.
    onset = next(
        (index + k for k, y in enumerate(ay) if (y - reference) * step >= 0.5 * step * step),
        index,
    )
    error = spread * math.sqrt(1.0 / before + 1.0 / after)
    return SustainedShift(index, onset, reference, level_after, spread, error, slope)


def find_sustained_shift(
    xs: list[float],
    ys: list[float],
    *,
    least_step: float,
    points_before: int = SHIFT_POINTS_BEFORE,
    points_after: int = SHIFT_POINTS_AFTER,
    spread_floor: float = 0.0,
) -> SustainedShift | None:
    """The largest shift of level, in standard errors, between a window of
    ``points_before`` points and the ``points_after`` points that follow it.

    For a series too noisy for one value to tell a step (a trend that follows each
    value absorbs a step of a few spreads within two samples), a window tells it: at
    every point with enough points on both sides, the window before is fitted with a
    straight line (Theil-Sen: the median of the slopes between pairs of points, Sen
    1968), whose residuals give a robust spread (median absolute deviation about their
    median, times ``MEDIAN_DEVIATION_TO_STD``); the step is the median of the
    window after, measured both from the median of the window before (no slope) and
    from the line carried over the window after (the median of the departures from
    it). The two must point the same way and the smaller in size is the step (a
    series that stops rising is not a step, nor is one that keeps rising along its
    line); its standard error is that of a difference of two means of that spread. This
    is a two-sample comparison of levels, in the spirit of Chow's test for a break
    (Chow 1960), with medians so that one wild value does not make or hide a shift.

    Args:
        xs: increasing positions (training forwards).
        ys: values at them (tracked units), as long as ``xs``.
        least_step: least ``|step|`` considered (tracked units).
        points_before, points_after: window sizes (at least 3 and 1).
        spread_floor: least spread (the series' noise floor).

    Returns:
        Among the points whose step is at least ``least_step``, the one with the largest
        ``|z|`` (the first of equals), or None.

    Raises:
        ValueError: when ``xs`` and ``ys`` differ in length, or a window is too small.

    Example:
        >>> xs = [float(x) for x in range(13)]
        >>> ys = [0.0, 0.1, -0.1, 0.0, 0.1, -0.1, 0.0, 0.1, 2.0, 2.1, 1.9, 2.0, 2.1]
        >>> shift = find_sustained_shift(xs, ys, least_step=1.0)
        >>> shift.index, round(shift.step, 3), round(shift.z, 1)
        (8, 2.0, 23.7)
    """
    if len(xs) != len(ys):
        raise ValueError(f"find_sustained_shift: xs has {len(xs)} points, ys {len(ys)}")
    if points_before < 3 or points_after < 1:
        raise ValueError(
            "find_sustained_shift: points_before must be >= 3 and points_after >= 1, "
            f"got {points_before} and {points_after}"
        )
    best: SustainedShift | None = None
    for index in range(points_before, len(xs) - points_after + 1):
        shift = _shift_at(xs, ys, index, points_before, points_after, spread_floor)
        if shift is None or abs(shift.step) < least_step:
            continue
        if best is None or abs(shift.z) > abs(best.z):
            best = shift
    return best
