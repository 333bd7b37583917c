"""Per-series trackers: fixed-size state updated once per sample.

A :class:`SeriesTracker` follows one series (module, call index, signal, tensor path,
metric) over samples. Its state has a fixed size whatever the run length: count; first,
latest, min and max values with their sample indices; fast and slow exponential moving
averages (EMA); a baseline frozen after warm-up; two-sided CUSUM against that baseline;
momentum; drawdown; volatility of changes; oscillation (sign flips of consecutive
differences); and a bounded, downsampled history for pictures.

Scale metrics (``rms``, ``mean_abs``, ``max_abs``, ``tail_ratio``) are tracked in natural
log space, so that EMAs, CUSUM and volatility measure relative change; fractions and
kurtosis are tracked as they are.

After a CUSUM alarm a new segment learns its level over ``max(4, warmup_samples // 3)``
values, during which CUSUM is not armed. On scale metrics a jump of at least 4x from both
the level learnt so far and the level before, and more than ``h + k`` standard deviations
of the segment before, starts a change of its own even then (once per learning segment),
so that a fault arriving just after a (possibly false) alarm is not averaged into the
new level.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from .config import TrackConfig

__all__ = ["ChangePoint", "SeriesPoint", "SeriesTracker"]

#: Values at or below this are treated as this, before taking logs (a dead unit's RMS is 0).
LOG_FLOOR = 1e-30
_LOG_OF_FLOOR = math.log(LOG_FLOOR)
#: Least factor of a jump that starts a change while a new segment is learning its level.
LEARNING_JUMP_FACTOR = 4.0
_LOG_LEARNING_JUMP = math.log(LEARNING_JUMP_FACTOR)
#: Change points kept per series (the largest steps survive when more are found).
MAX_CHANGES = 8
#: Latest CUSUM increments kept to place the start of a change (bounded run-up).
RUNUP_POINTS = 32


def _keep_runup(runup: list[tuple[int, float]], sample: int, z: float) -> None:
    runup.append((sample, z))
    if len(runup) > RUNUP_POINTS:
        del runup[0]


def _first_largest(changes: Iterable[ChangePoint]) -> ChangePoint | None:
    largest: ChangePoint | None = None
    for change in changes:
        if largest is None or abs(change.step) > abs(largest.step):
            largest = change
    return largest


def _change_start(runup: list[tuple[int, float]], fallback: int) -> int:
    """Where a change began: the first sample of the CUSUM run-up whose deviation is at
    least a quarter of the largest one in it. Page's estimate (the sample where the sum
    last left zero) runs early when noise keeps the sum just above zero before a large
    step; for a gradual shift both agree."""
    if not runup:
        return fallback
    largest = max(z for _, z in runup)
    for sample, z in runup:
        if z >= 0.25 * largest:
            return sample
    return fallback


class SeriesPoint(NamedTuple):
    """One observation: the sample index and the metric value in its own units.

    A named tuple: built once per update on the hot path, so it must be cheap.
    """

    sample: int
    value: float

    def as_dict(self) -> dict[str, float | int]:
        return {"sample": self.sample, "value": self.value}


@dataclass(slots=True)
class ChangePoint:
    """A level shift found by CUSUM, in tracked units (log for scale metrics).

    Attributes:
        start_sample: the estimated first sample of the new level: within the CUSUM
            run-up (from where the alarming sum last left zero, Page 1954), the first
            sample whose deviation is at least a quarter of the run-up's largest.
        alarm_sample: the sample at which CUSUM crossed its threshold.
        level_before: mean of the segment before, in tracked units.
        std_before: its standard deviation (floored), in tracked units.
        level_after: mean of the new segment's first ``max(4, warmup_samples // 3)``
            values (running mean until then), in tracked units.
        confirmed: the new segment has seen that many values.
    """

    start_sample: int
    alarm_sample: int
    level_before: float
    std_before: float
    level_after: float
    confirmed: bool = False

    @property
    def step(self) -> float:
        """``level_after - level_before`` in tracked units (log ratio for scale metrics)."""
        return self.level_after - self.level_before

    @property
    def step_z(self) -> float:
        """:attr:`step` in standard deviations of the segment before."""
        return self.step / self.std_before


class SeriesTracker:
    """Streaming state of one series, of fixed size.

    Args:
        config: the tracking configuration (warm-up length, EMA factors, CUSUM k and h).
        log_scale: track ``ln(value)`` rather than ``value`` (scale metrics).
        noise_floor: smallest standard deviation of a reference, in tracked units (log
            units when ``log_scale``), so that a series that was constant during warm-up
            does not turn every later wiggle into an alarm.

    Two references are kept. The *baseline* is the mean and standard deviation of the
    first ``warmup_samples`` values of the run; :attr:`shift` measures the end-to-end
    movement against it. The *segment* reference is the same statistic over the current
    segment: two-sided CUSUM (Page 1954) runs against it, and when it alarms a
    :class:`ChangePoint` is recorded and a new segment starts (the detector re-arms, as
    river's drift detectors do after firing), so both abrupt steps and the level they
    lead to are measured, while slow drift shows up as many small steps.

    The tracker is fed with :meth:`update` in increasing sample order with finite
    floats (callers skip undefined values).

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
        "_changes",
        "_config",
        "_constant",
        "_cusum_neg",
        "_cusum_neg_start",
        "_cusum_pos",
        "_cusum_pos_start",
        "_flip_ema",
        "_history",
        "_history_stride",
        "_jump_restarted",
        "_last_diff",
        "_latest_sample",
        "_latest_value",
        "_log_scale",
        "_noise_floor",
        "_peak",
        "_pending_change",
        "_prev",
        "_runup_neg",
        "_runup_pos",
        "_seg_count",
        "_seg_m2",
        "_seg_mean",
        "_seg_std",
        "_vol_sq_ema",
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
        self.min: SeriesPoint | None = None
        self.max: SeriesPoint | None = None
        self.first_nonzero: SeriesPoint | None = None
        self.warmup_end_sample: int | None = None
        self.nonzero_count = 0
        self.ema_fast = 0.0
        self.ema_slow = 0.0
        self._warm_vol_sq = 0.0
        self.baseline_mean = 0.0
        self.baseline_std = self._noise_floor
        self.baseline_volatility = 0.0
        self._seg_count = 0
        self._seg_mean = 0.0
        self._seg_m2 = 0.0
        self._seg_std = self._noise_floor
        self._cusum_pos = 0.0
        self._cusum_neg = 0.0
        self._cusum_pos_start = -1
        self._cusum_neg_start = -1
        self._runup_pos: list[tuple[int, float]] = []
        self._runup_neg: list[tuple[int, float]] = []
        self.cusum_peak = 0.0
        self._pending_change: ChangePoint | None = None
        self._jump_restarted = False
        self._changes: list[ChangePoint] = []
        self.latest_change: ChangePoint | None = None
        self.change_count = 0
        self.momentum = 0.0
        self._peak = -math.inf
        self.max_drawdown = 0.0
        self._vol_sq_ema = 0.0
        self._prev = 0.0
        self._last_diff = 0.0
        self.flips = 0
        self.diffs = 0
        self._flip_ema = 2.0 / 3.0
        self._history: list[tuple[int, float]] = []
        self._history_stride = 1
        #: Every value so far was equal (see :meth:`_repeat`).
        self._constant = True

    # ------------------------------------------------------------------ update
    def transform(self, value: float) -> float:
        """Map a raw value to tracked units (``ln`` for log-scale series)."""
        if self._log_scale:
            return math.log(value if value > LOG_FLOOR else LOG_FLOOR)
        return value

    def update(self, sample: int, value: float) -> None:
        """Add the value observed at ``sample`` (0-based sample index)."""
        # The hot path of the host side (one call per series and metric per sample):
        # a SeriesPoint is built only where one is kept.
        if self._constant and self.count:
            if value == self._latest_value:
                self._repeat(sample, value)
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
            self._vol_sq_ema += alpha_fast * (diff * diff - self._vol_sq_ema)
            if count <= warmup:
                self._warm_vol_sq += diff * diff
                self.baseline_volatility = math.sqrt(self._warm_vol_sq / (count - 1))
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

        self._update_segment(sample, v)
        if count <= warmup:
            # The run's baseline is the first segment's reference as it freezes.
            self.baseline_mean = self._seg_mean
            self.baseline_std = self._seg_std
            if count == warmup:
                self.warmup_end_sample = sample
        if (count - 1) % self._history_stride == 0:
            self._append_history(sample, value)

    def _repeat(self, sample: int, value: float) -> None:
        """:meth:`update` for a series whose every value so far equals ``value``, with
        the same resulting state in fewer steps (a zero ``nonfinite_fraction`` is such a
        series in nearly every run, a zero ``zero_fraction`` in most): the EMAs,
        momentum, volatility, drawdown and segment mean already equal the value or zero,
        CUSUM stays at zero and the segment's deviation at its floor, so only counters,
        the decay of the flip rate and the history move."""
        count = self.count + 1
        self.count = count
        self._latest_sample = sample
        self._latest_value = value
        if value != 0.0:
            self.nonzero_count += 1
        if self.diffs > 0:
            self._flip_ema -= self._alpha_slow * self._flip_ema
        self.diffs += 1
        if not self._log_scale:
            self._prev = value  # the same number, down to the sign of a zero
        if self._seg_count < self._config.warmup_samples:
            self._seg_count += 1
        if count == self._warmup:
            self.warmup_end_sample = sample
        if (count - 1) % self._history_stride == 0:
            self._append_history(sample, value)

    @property
    def latest(self) -> SeriesPoint | None:
        """The latest observation, or None before the first."""
        if not self.count:
            return None
        return SeriesPoint(self._latest_sample, self._latest_value)

    def _update_segment(self, sample: int, v: float) -> None:
        # The first segment learns over the whole warm-up; after a change point the
        # detector is blind while the new segment learns, so that is kept short.
        warmup = self._config.warmup_samples
        if self.change_count:
            warmup = max(4, warmup // 3)
            pending = self._pending_change
            if (
                pending is not None
                and self._seg_count < warmup
                and not self._jump_restarted
                and self._jumps_while_learning(v, pending)
            ):
                self._start_change(sample, sample, v, pending.std_before)
                # Once per learning segment: an oscillation must not start a change at
                # every sample (the next segment then learns its level in full).
                self._jump_restarted = True
                return
        if self._seg_count < warmup:
            # Welford's update of the segment's mean and sum of squared deviations.
            self._seg_count += 1
            delta = v - self._seg_mean
            self._seg_mean += delta / self._seg_count
            self._seg_m2 += delta * (v - self._seg_mean)
            if self._seg_count > 1:
                std = math.sqrt(self._seg_m2 / (self._seg_count - 1))
                self._seg_std = max(std, self._noise_floor)
            pending = self._pending_change
            if pending is not None:
                pending.level_after = self._seg_mean
                if self._seg_count == warmup:
                    pending.confirmed = True
                    self._pending_change = None
                    self._jump_restarted = False
            return
        # The reference is frozen once the segment has seen warm-up: a slow fault must
        # not be absorbed into it (as in Page's CUSUM with a known in-control mean).
        z = (v - self._seg_mean) / self._seg_std
        k = self._config.cusum_allowance
        pos = self._cusum_pos + z - k
        if pos > 0.0:
            if self._cusum_pos <= 0.0:
                self._cusum_pos_start = sample
                self._runup_pos.clear()
            self._cusum_pos = pos
            _keep_runup(self._runup_pos, sample, z)
        else:
            self._cusum_pos = 0.0
        neg = self._cusum_neg - z - k
        if neg > 0.0:
            if self._cusum_neg <= 0.0:
                self._cusum_neg_start = sample
                self._runup_neg.clear()
            self._cusum_neg = neg
            _keep_runup(self._runup_neg, sample, -z)
        else:
            self._cusum_neg = 0.0
        peak = max(self._cusum_pos, self._cusum_neg)
        if peak > self.cusum_peak:
            self.cusum_peak = peak
        if peak > self._config.cusum_threshold:
            up = self._cusum_pos >= self._cusum_neg
            runup = self._runup_pos if up else self._runup_neg
            start = _change_start(runup, self._cusum_pos_start if up else self._cusum_neg_start)
            self._start_change(start, sample, v, self._seg_std)

    def _start_change(self, start: int, alarm: int, v: float, std_before: float) -> None:
        """Record a change point at ``alarm`` and start a new segment with value ``v``."""
        change = ChangePoint(
            start_sample=start,
            alarm_sample=alarm,
            level_before=self._seg_mean,
            std_before=std_before,
            level_after=v,
        )
        self.change_count += 1
        self.latest_change = change
        self._pending_change = change
        self._jump_restarted = False
        self._keep_change(change)
        # Re-arm: a new segment starts with this value.
        self._seg_count = 1
        self._seg_mean = v
        self._seg_m2 = 0.0
        self._seg_std = self._noise_floor
        self._cusum_pos = self._cusum_neg = 0.0
        self._runup_pos.clear()
        self._runup_neg.clear()

    def _jumps_while_learning(self, v: float, pending: ChangePoint) -> bool:
        """While a new segment learns its level after a change, CUSUM is not armed; a
        fault arriving then would be averaged into the new level. A value that jumps at
        least ``LEARNING_JUMP_FACTOR`` (4x) away from both the level learnt so far and the
        level before the change, and more than a single-sample CUSUM alarm (``h + k``
        standard deviations of the segment before the change), starts a change of its
        own, once per learning segment. Scale (log) series only: for them the factor is
        a fixed yardstick whatever the noise of the new regime."""
        if not self._log_scale:
            return False
        jump = abs(v - self._seg_mean)
        if jump < _LOG_LEARNING_JUMP or abs(v - pending.level_before) < _LOG_LEARNING_JUMP:
            return False  # a small move, or back to the level before the change
        config = self._config
        return jump > (config.cusum_threshold + config.cusum_allowance) * max(
            pending.std_before, self._noise_floor
        )

    def _keep_change(self, change: ChangePoint) -> None:
        # Bounded: past MAX_CHANGES, forget the smallest confirmed step (ties: the later),
        # or, with none confirmed, the smallest step but the newest.
        changes = self._changes
        changes.append(change)
        if len(changes) > MAX_CHANGES:
            pool = [c for c in changes if c.confirmed] or changes[:-1]
            smallest = min(pool, key=lambda c: (abs(c.step), -c.alarm_sample))
            changes.remove(smallest)

    @property
    def changes(self) -> tuple[ChangePoint, ...]:
        """Up to ``MAX_CHANGES`` change points in alarm order (the largest steps are kept)."""
        return tuple(self._changes)

    def first_change(self, *, min_abs_step: float, min_abs_step_z: float) -> ChangePoint | None:
        """The earliest kept change point whose step is at least this large, or None.

        Args:
            min_abs_step: least ``|step|``, in tracked units (log for scale metrics).
            min_abs_step_z: least ``|step_z|``, in standard deviations of the level before.
        """
        for change in self._changes:
            if abs(change.step) >= min_abs_step and abs(change.step_z) >= min_abs_step_z:
                return change
        return None

    def _append_history(self, sample: int, value: float) -> None:
        self._history.append((sample, value))
        if len(self._history) >= self._config.history_points:
            # Keep every other point and halve the density of what follows.
            self._history = self._history[::2]
            self._history_stride *= 2

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
        """The largest step among the kept changes, the unconfirmed latest one included
        (the first of equals, so a confirmed change wins a tie)."""
        return _first_largest(self._changes)

    @property
    def cusum_positive(self) -> float:
        """Current upper CUSUM statistic, in segment standard deviations."""
        return self._cusum_pos

    @property
    def cusum_negative(self) -> float:
        """Current lower CUSUM statistic, in segment standard deviations."""
        return self._cusum_neg

    @property
    def volatility(self) -> float:
        """EMA estimate of the root mean square per-sample change (tracked units)."""
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
        """Bounded, evenly downsampled ``(sample, value)`` points, oldest first."""
        points = list(self._history)
        if self.latest is not None and (not points or points[-1][0] != self.latest.sample):
            points.append((self.latest.sample, self.latest.value))
        return points

    def level(self, tracked: float) -> float:
        """Map a tracked-units level (an EMA, the baseline) back to the metric's units
        (0 for a log-scale level at ``LOG_FLOOR``, where exact zeros were recorded)."""
        if not self._log_scale:
            return tracked
        return 0.0 if tracked <= _LOG_OF_FLOOR else math.exp(tracked)
