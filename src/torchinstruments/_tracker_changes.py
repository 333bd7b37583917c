"""Change detection of a :class:`~torchinstruments.track.SeriesTracker`: the CUSUM
step on its excess residuals, the alarm that records a change point and re-anchors the
trend, and what follows an alarm (confirmation, reversion, the spread after). The
tracker inherits them from :class:`_TrackerChanges`; the method is in its docstring.
"""

from __future__ import annotations

import math

from ._tracker_views import _TrackerState
from ._trend import (
    AFTER_RESIDUALS,
    CONFIRM_SAMPLES,
    MAX_CHANGES,
    REVERT_SHARE,
    REVERT_SPREADS,
    ChangePoint,
    _change_start,
    _keep_runup,
    _RunupEntry,
)


class _TrackerChanges(_TrackerState):
    """The change-point side of :class:`~torchinstruments.track.SeriesTracker`."""

    __slots__ = ()

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
