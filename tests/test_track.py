"""SeriesTracker against hand-computed sequences.

Expected values are recomputed here from the documented recurrences (``ema += alpha * (v -
ema)``, the first value seeds; Welford mean and sample standard deviation floored by the
noise floor; Page's two-sided CUSUM ``S = max(0, S +/- z - k)``), in float64 like the
tracker, so the tolerances only absorb the order in which the same float64 operations
happen (``rel=1e-12``).
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from torchinstruments.config import TrackConfig
from torchinstruments.sampling import DefaultSampling
from torchinstruments.track import (
    DRIFT_TOLERANCE,
    LEVEL_GAIN,
    LOG_FLOOR,
    MAD_TO_STD,
    RESIDUAL_CLIP,
    SLOPE_GAIN,
    SPREAD_GAIN,
    ChangePoint,
    SeriesPoint,
    SeriesTracker,
    find_sustained_shift,
    fit_trend_break,
)

EXACT = 1e-12  # same float64 operations, possibly in another order


def make(
    *,
    warmup: int = 4,
    fast: float = 0.5,
    slow: float = 0.25,
    k: float = 0.5,
    h: float = 5.0,
    history: int = 32,
    log_scale: bool = False,
    noise_floor: float = 0.01,
) -> SeriesTracker:
    config = TrackConfig(
        warmup_samples=warmup,
        fast_ema_alpha=fast,
        slow_ema_alpha=slow,
        cusum_allowance=k,
        cusum_threshold=h,
        history_points=history,
    )
    return SeriesTracker(config, log_scale=log_scale, noise_floor=noise_floor)


def feed(tracker: SeriesTracker, values, *, first_sample: int = 0, every: int = 1) -> None:
    for i, value in enumerate(values):
        tracker.update(first_sample + i * every, value)


def ema(values, alpha: float) -> float:
    out = values[0]
    for v in values[1:]:
        out += alpha * (v - out)
    return out


# ---------------------------------------------------------------- before any value


def test_fresh_tracker():
    t = make(noise_floor=0.1)
    assert t.count == 0
    assert t.first is None and t.latest is None and t.min is None and t.max is None
    assert t.first_nonzero is None and t.nonzero_count == 0
    assert not t.warmup_complete
    assert t.baseline_std == 0.1
    assert t.change_count == 0 and t.latest_change is None and t.strongest_change is None
    assert t.drawdown == 0.0
    assert t.flip_rate == pytest.approx(2.0 / 3.0, rel=EXACT)
    assert t.history() == []


# ---------------------------------------------------------------- points


def test_first_latest_min_max_with_sample_indices():
    t = make(warmup=10)
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 9.0, 0.5]
    feed(t, values, first_sample=100, every=3)  # samples 100, 103, ..., 127
    assert t.count == 10
    assert t.first == SeriesPoint(100, 3.0)
    assert t.latest == SeriesPoint(127, 0.5)
    assert t.min == SeriesPoint(127, 0.5)
    # Ties keep the first occurrence: 9.0 is seen at samples 115 and 124.
    assert t.max == SeriesPoint(115, 9.0)
    assert t.latest.as_dict() == {"sample": 127, "value": 0.5}


def test_min_tie_keeps_first_occurrence():
    t = make()
    feed(t, [2.0, 1.0, 3.0, 1.0], first_sample=10)
    assert t.min == SeriesPoint(11, 1.0)


def test_first_nonzero_and_nonzero_count():
    t = make()
    feed(t, [0.0, 0.0, 0.25, 0.0, 0.5, 0.0], first_sample=40)
    assert t.first_nonzero == SeriesPoint(42, 0.25)
    assert t.nonzero_count == 2
    assert t.latest == SeriesPoint(45, 0.0)


def test_first_nonzero_counts_negative_values():
    t = make()
    feed(t, [0.0, -1.0, 0.0])
    assert t.first_nonzero == SeriesPoint(1, -1.0)
    assert t.nonzero_count == 1


# ---------------------------------------------------------------- EMAs and momentum


def test_fast_and_slow_ema_follow_recurrence():
    values = [2.0, 4.0, 1.0, 7.0, 3.0, 3.0]
    t = make(fast=0.5, slow=0.25, warmup=10)
    feed(t, values)
    assert t.ema_fast == pytest.approx(ema(values, 0.5), rel=EXACT)
    assert t.ema_slow == pytest.approx(ema(values, 0.25), rel=EXACT)
    # By hand, alpha 0.5: 2 -> 3 -> 2 -> 4.5 -> 3.75 -> 3.375.
    assert t.ema_fast == 3.375
    # alpha 0.25: 2 -> 2.5 -> 2.125 -> 3.34375 -> 3.2578125 -> 3.193359375.
    assert t.ema_slow == 3.193359375


def test_first_value_seeds_ema_even_if_zero():
    t = make()
    t.update(0, 0.0)
    assert t.ema_fast == 0.0 and t.ema_slow == 0.0
    t.update(1, 8.0)
    assert t.ema_fast == 4.0  # 0 + 0.5 * (8 - 0)
    assert t.ema_slow == 2.0  # 0 + 0.25 * (8 - 0)


def test_momentum_is_fast_ema_of_differences():
    values = [1.0, 3.0, 2.0, 6.0]
    t = make(fast=0.5)
    feed(t, values)
    # diffs 2, -1, 4; momentum starts at 0: 1.0 -> 0.0 -> 2.0.
    assert t.momentum == 2.0


# ---------------------------------------------------------------- warm-up baseline


def test_warmup_baseline_is_welford_mean_and_sample_std():
    values = [1.0, 2.0, 4.0, 7.0]
    t = make(warmup=4, noise_floor=0.01)
    for i, v in enumerate(values):
        t.update(i, v)
        seen = values[: i + 1]
        assert t.warmup_complete is (i + 1 >= 4)
        assert t.baseline_mean == pytest.approx(statistics.fmean(seen), rel=EXACT)
        expected_std = statistics.stdev(seen) if len(seen) > 1 else 0.01
        assert t.baseline_std == pytest.approx(max(expected_std, 0.01), rel=EXACT)
    assert t.baseline_mean == 3.5
    assert t.baseline_std == pytest.approx(math.sqrt(21.0 / 3.0), rel=EXACT)


def test_baseline_frozen_after_warmup():
    t = make(warmup=4, h=1e9)  # no alarm: only the baseline is under test
    feed(t, [1.0, 2.0, 4.0, 7.0])
    mean, std = t.baseline_mean, t.baseline_std
    feed(t, [100.0, -50.0, 3.0], first_sample=4)
    assert t.baseline_mean == mean
    assert t.baseline_std == std
    # shift is the fast EMA net of the frozen baseline.
    assert t.shift == pytest.approx(t.ema_fast - 3.5, rel=EXACT)
    assert t.shift_z == pytest.approx(t.shift / std, rel=EXACT)


def test_baseline_std_floored_by_noise_floor():
    t = make(warmup=3, noise_floor=0.25)
    feed(t, [5.0, 5.0, 5.0])
    assert t.baseline_mean == 5.0
    assert t.baseline_std == 0.25
    t2 = make(warmup=3, noise_floor=0.25)
    feed(t2, [5.0, 5.1, 5.0])
    assert t2.baseline_std == 0.25  # sample std 0.0577 < floor
    t3 = make(warmup=3, noise_floor=0.25)
    feed(t3, [5.0, 6.0, 7.0])
    assert t3.baseline_std == pytest.approx(1.0, rel=EXACT)


def test_warmup_complete_counts_values():
    t = make(warmup=5)
    for i in range(4):
        t.update(i, 1.0)
        assert not t.warmup_complete
    t.update(4, 1.0)
    assert t.warmup_complete


# ---------------------------------------------------------------- log scale


def test_log_scale_tracks_natural_log():
    t = make(log_scale=True, warmup=3, noise_floor=0.02)
    e = math.e
    feed(t, [1.0, e, e**2])
    assert t.log_scale
    # Tracked units are ln(value); points keep the raw value.
    assert t.baseline_mean == pytest.approx(1.0, rel=EXACT)
    assert t.baseline_std == pytest.approx(1.0, rel=EXACT)
    assert t.ema_fast == pytest.approx(ema([0.0, 1.0, 2.0], 0.5), rel=EXACT)
    assert t.latest == SeriesPoint(2, e**2)
    assert t.max == SeriesPoint(2, e**2)
    assert t.level(t.baseline_mean) == pytest.approx(e, rel=EXACT)
    assert t.transform(e**3) == pytest.approx(3.0, rel=EXACT)


def test_log_scale_floors_zero_and_tiny_values():
    t = make(log_scale=True)
    assert LOG_FLOOR == 1e-30
    assert t.transform(0.0) == math.log(1e-30)
    assert t.transform(1e-40) == math.log(1e-30)
    t.update(0, 0.0)
    assert t.ema_fast == math.log(1e-30)
    assert t.min == SeriesPoint(0, 0.0)


def test_linear_scale_is_identity():
    t = make(log_scale=False)
    assert not t.log_scale
    assert t.transform(-3.5) == -3.5
    assert t.level(-3.5) == -3.5


# ---------------------------------------------------------------- volatility, flips


def test_flip_counting_and_flip_rate():
    values = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.5]
    t = make(slow=0.25, warmup=20)
    feed(t, values)
    # diffs: +1, -1, +1, 0, -1, +0.5. A zero difference is no flip and keeps the last
    # nonzero sign, so +1, 0, -1 is one flip.
    assert t.diffs == 6
    assert t.flips == 4
    # flip EMA from 2/3, one update per difference after the first: flip, flip, none,
    # flip, flip.
    expected = 2.0 / 3.0
    for flip in (1.0, 1.0, 0.0, 1.0, 1.0):
        expected += 0.25 * (flip - expected)
    assert t.flip_rate == pytest.approx(expected, rel=EXACT)


def test_monotone_series_has_no_flips():
    t = make(slow=0.5)
    feed(t, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert t.flips == 0
    assert t.diffs == 4
    # Three non-flip updates from 2/3 with alpha 0.5.
    assert t.flip_rate == pytest.approx((2.0 / 3.0) / 8.0, rel=EXACT)


def test_drawdown_and_max_drawdown():
    t = make(h=1e9)
    feed(t, [1.0, 5.0, 2.0, 4.0, 6.0, 5.5])
    # peak 5 then 2: drawdown 3; new peak 6 then 5.5: drawdown 0.5.
    assert t.max_drawdown == 3.0
    assert t.drawdown == 0.5


def test_drawdown_in_log_units():
    t = make(log_scale=True, h=1e9)
    feed(t, [4.0, 1.0, 2.0])
    assert t.max_drawdown == pytest.approx(math.log(4.0), rel=EXACT)
    assert t.drawdown == pytest.approx(math.log(2.0), rel=EXACT)


# ---------------------------------------------------------------- trend and change points


def trend_by_hand(values, forwards, *, warmup, k, h, floor, log_scale=False):
    """The documented recurrences of the local trend, written out once more: forecast
    ``level + slope * gap``; the residual's excess over ``DRIFT_TOLERANCE * |slope * gap|``;
    spread ``max(floor, s * sqrt(gap))`` with ``s += SPREAD_GAIN * (MAD_TO_STD * |e| /
    sqrt(gap) - s)``; level ``forecast + LEVEL_GAIN * r``, slope ``+= SLOPE_GAIN * r /
    gap``; after warm-up the excess is clipped at ``RESIDUAL_CLIP`` spreads where it
    updates them, and CUSUM runs on it. Returns per value (forecast, spread, z) and the
    first alarm's index (or None); stops at the first alarm."""
    vs = [math.log(v) if log_scale else v for v in values]
    level, slope, unit = vs[0], 0.0, 0.0
    pos = neg = 0.0
    rows = [(vs[0], floor, 0.0)]
    for i in range(1, len(vs)):
        gap = max(forwards[i] - forwards[i - 1], 1)
        moved = slope * gap
        forecast = level + moved
        residual = vs[i] - forecast
        tol = DRIFT_TOLERANCE * abs(moved)
        excess = math.copysign(max(abs(residual) - tol, 0.0), residual)
        spread = max(floor, unit * math.sqrt(gap))
        z = excess / spread
        rows.append((forecast, spread, z))
        armed = i + 1 > warmup
        used = (
            max(-RESIDUAL_CLIP * spread, min(RESIDUAL_CLIP * spread, excess)) if armed else excess
        )
        if armed:
            pos = max(0.0, pos + z - k)
            neg = max(0.0, neg - z - k)
            if max(pos, neg) > h:
                return rows, i
        correction = residual - excess + used
        level = forecast + LEVEL_GAIN * correction
        slope += SLOPE_GAIN * correction / gap
        unit += SPREAD_GAIN * (MAD_TO_STD * abs(used) / math.sqrt(gap) - unit)
    return rows, None


SCHEDULE = [i for i in range(4000) if DefaultSampling().should_sample(i)]


def test_trend_forecasts_follow_the_documented_recurrences():
    rng = random.Random(7)
    forwards = SCHEDULE[:40]
    values = [1.0 + 0.002 * f + rng.gauss(0.0, 0.01) for f in forwards]
    t = make(warmup=24, k=2.5, h=5.0, noise_floor=0.001)
    expected, alarm = trend_by_hand(values, forwards, warmup=24, k=2.5, h=5.0, floor=0.001)
    assert alarm is None
    for sample, (forward, value) in enumerate(zip(forwards, values, strict=True)):
        t.update(sample, value, forward)
        departure = t.departure_at(sample)
        assert departure is not None
        forecast, spread, _z = expected[sample]
        assert departure.forward == forward
        assert departure.forecast == pytest.approx(forecast, rel=EXACT)
        assert departure.spread == pytest.approx(spread, rel=EXACT)
        if sample:
            assert departure.value - departure.forecast == pytest.approx(
                value - forecast, abs=1e-12
            )
    assert t.change_count == 0
    # The slope is per training forward, whatever the spacing of the samples.
    assert t.trend_slope == pytest.approx(0.002, rel=0.2)


@pytest.mark.parametrize("rate", [0.01, 0.0005, -0.004])
def test_smooth_drift_of_any_size_is_not_a_change(rate):
    """Log RMS that drifts at a steady rate per training forward (x50 and more over the
    run), sampled on the default schedule whose interval doubles: no change point, as
    the trend follows the drift; a tracker that treated samples as equally spaced would
    see the drift speed up at every stage boundary."""
    rng = random.Random(3)
    t = make(warmup=24, k=2.5, h=5.0, log_scale=True, noise_floor=0.02)
    for sample, forward in enumerate(SCHEDULE[:48]):
        t.update(sample, math.exp(rate * forward + rng.gauss(0.0, 0.01)), forward)
    assert t.change_count == 0, t.changes


def test_a_bending_trend_is_not_a_change():
    """Early training: RMS rises x10 in the first hundred forwards and then settles
    (saturating), kurtosis-like series climb and flatten; no change point."""
    rng = random.Random(5)
    rising = make(warmup=24, k=2.5, h=5.0, log_scale=True, noise_floor=0.02)
    climbing = make(warmup=24, k=2.5, h=5.0, noise_floor=0.1)
    for sample, forward in enumerate(SCHEDULE[:48]):
        rising.update(
            sample, 0.1 + 0.9 * (1 - math.exp(-forward / 60)) + 0.005 * rng.random(), forward
        )
        climbing.update(
            sample, 1.0 + 19.0 * forward / (forward + 300.0) + rng.gauss(0, 0.3), forward
        )
    assert rising.change_count == 0, rising.changes
    assert climbing.change_count == 0, climbing.changes


def test_a_step_alarms_where_it_is_with_the_trend_forecast_as_level_before():
    rng = random.Random(11)
    forwards = SCHEDULE[:44]
    values = [1.0 + 0.001 * f + rng.gauss(0.0, 0.01) for f in forwards]
    step_at = 36
    values[step_at:] = [v + 0.5 for v in values[step_at:]]
    t = make(warmup=24, k=2.5, h=5.0, noise_floor=0.001)
    for sample, (forward, value) in enumerate(zip(forwards, values, strict=True)):
        t.update(sample, value, forward)
    expected, alarm = trend_by_hand(values, forwards, warmup=24, k=2.5, h=5.0, floor=0.001)
    assert alarm == step_at
    assert t.change_count == 1
    change = t.changes[0]
    forecast, spread, _z = expected[step_at]
    assert (change.start_sample, change.alarm_sample) == (step_at, step_at)
    assert (change.start_forward, change.alarm_forward) == (forwards[step_at],) * 2
    assert change.level_before == pytest.approx(forecast, rel=EXACT)
    assert change.std_before == pytest.approx(spread, rel=EXACT)
    assert change.level_after == values[step_at]
    assert change.step == pytest.approx(values[step_at] - forecast, rel=EXACT)
    assert change.step_z == pytest.approx(change.step / spread, rel=EXACT)
    assert change.confirmed and not change.transient
    assert t.strongest_change is change and t.largest_change is change


def test_two_moderate_departures_accumulate_to_one_alarm_dated_at_the_first():
    t = make(warmup=4, k=2.5, h=5.0, noise_floor=0.1)
    feed(t, [1.0] * 6)  # flat: the spread stays at its floor, 0.1
    # Excess residuals of 5.2 then (after the level took half of it) about 2.6 + ...
    t.update(6, 1.52)
    assert t.change_count == 0
    assert t.cusum_positive == pytest.approx(5.2 - 2.5, rel=1e-9)
    t.update(7, 1.52 + 0.36)
    change = t.latest_change
    assert change is not None
    assert (change.start_sample, change.alarm_sample) == (6, 7)
    assert change.level_before == pytest.approx(1.0, rel=EXACT)


def test_a_later_step_is_never_merged_into_an_earlier_drift():
    """Slow drift up, then a step down: one change, dated at the step (a CUSUM on a
    frozen reference would have alarmed upwards during the drift and absorbed the step)."""
    rng = random.Random(2)
    t = make(warmup=24, k=2.5, h=5.0, log_scale=True, noise_floor=0.02)
    forwards = SCHEDULE[:46]
    step_at = 40
    for sample, forward in enumerate(forwards):
        value = math.exp(0.003 * forward + rng.gauss(0.0, 0.01))
        if sample >= step_at:
            value /= 3.0
        t.update(sample, value, forward)
    assert [c.start_sample for c in t.changes] == [step_at]
    assert t.changes[0].step == pytest.approx(-math.log(3.0), abs=0.1)


def test_a_value_that_returns_to_the_old_trend_is_transient():
    t = make(warmup=4, k=2.5, h=5.0, noise_floor=0.1)
    feed(t, [1.0] * 6)
    t.update(6, 3.0)
    change = t.latest_change
    assert change is not None and not change.confirmed and not change.transient
    t.update(7, 1.0)  # back on the old trend
    assert change.transient and not change.confirmed
    assert t.strongest_change is None and t.largest_change is None
    assert t.changes == (change,)  # kept, marked transient


def test_a_change_is_confirmed_by_the_values_after_it():
    t = make(warmup=4, k=2.5, h=5.0, noise_floor=0.1)
    feed(t, [1.0] * 6)
    t.update(6, 3.0)
    change = t.latest_change
    assert change is not None and not change.confirmed  # CONFIRM_SAMPLES = 1 after it
    t.update(7, 3.05)
    assert change.confirmed and not change.transient
    assert t.change_count == 1


def test_rearms_after_a_change_and_records_the_next_step():
    t = make(warmup=4, k=2.5, h=5.0, noise_floor=0.1)
    feed(t, [1.0] * 6)
    feed(t, [3.0] * 6, first_sample=6)
    feed(t, [6.0] * 4, first_sample=12)
    assert [(c.start_sample, c.confirmed) for c in t.changes] == [(6, True), (12, True)]
    assert t.changes[1].level_before == pytest.approx(3.0, rel=EXACT)
    assert t.changes[1].level_after == 6.0
    assert t.strongest_change is t.changes[1]  # the larger step
    # The baseline of the run is still the warm-up's.
    assert t.baseline_mean == 1.0


def test_no_alarm_before_the_reference_is_trusted():
    t = make(warmup=10, k=2.5, h=5.0, noise_floor=0.1)
    feed(t, [1.0] * 5 + [9.0] * 5)  # a jump inside warm-up: the trend learns it
    assert t.change_count == 0


@pytest.mark.parametrize(
    "tail",
    [[5.0, 1.0] * 500, [5.0, 1.0, 1.0] * 333, [0.0, 1.0] * 500],
    ids=["oscillation-5x", "spike-every-3rd", "zero-and-back"],
)
def test_oscillation_keeps_change_points_bounded(tail):
    """Spikes that come back are transient changes, each dated at its spike; the list
    stays bounded (transient ones are forgotten first) and the spikes show in the
    volatility instead."""
    t = make(warmup=12, log_scale=True, noise_floor=0.02)
    feed(t, [1.0, 1.01] * 25)
    quiet = t.volatility
    feed(t, tail, first_sample=50)
    assert len(t.changes) <= 8
    assert all(c.start_sample >= 50 and c.start_sample == c.alarm_sample for c in t.changes)
    assert t.volatility > 3 * quiet


def test_change_point_step_properties():
    change = ChangePoint(
        start_sample=3, alarm_sample=5, level_before=1.0, std_before=0.5, level_after=2.5
    )
    assert change.step == 1.5
    assert change.step_z == 3.0
    assert not change.confirmed and not change.transient


def test_volatility_is_an_ema_of_squared_excess_residuals():
    t = make(fast=0.5, warmup=3, h=1e9, noise_floor=0.01)
    values = [1.0, 3.0, 2.0, 2.0]
    feed(t, values)
    expected, _ = trend_by_hand(values, [0, 1, 2, 3], warmup=3, k=0.5, h=1e9, floor=0.01)
    # Sample 1: slope 0, so the whole residual 2.0 is excess (no clipping in warm-up).
    assert expected[1][2] == pytest.approx(2.0 / 0.01, rel=EXACT)
    assert t.baseline_volatility > 0.0
    assert t.volatility > 0.0


# ---------------------------------------------------------------- bounded history


def test_history_downsampling_by_hand():
    t = make(history=4, h=1e9)
    feed(t, [float(i) for i in range(9)], first_sample=100)
    # Stored: 0,1,2,3 -> halved to 0,2 (stride 2); 4; 6 -> 0,2,4,6 -> 0,4 (stride 4); 8.
    assert t.history() == [(100, 0.0), (104, 4.0), (108, 8.0)]
    t.update(109, 9.0)
    # 9 is off the stride: only kept as the latest point.
    assert t.history() == [(100, 0.0), (104, 4.0), (108, 8.0), (109, 9.0)]


@pytest.mark.parametrize("points", [4, 5, 8, 32])
def test_history_is_bounded_and_keeps_first_and_latest(points):
    t = make(history=points, h=1e9)
    for i in range(500):
        t.update(2 * i, math.sin(i))
        history = t.history()
        assert len(history) <= points
        assert history[0] == (0, 0.0)
        assert history[-1] == (2 * i, math.sin(i))
        samples = [s for s, _ in history]
        assert samples == sorted(set(samples))


def test_history_returns_a_copy():
    t = make()
    feed(t, [1.0, 2.0])
    t.history().append((99, 99.0))
    assert t.history() == [(0, 1.0), (1, 2.0)]


def test_config_property():
    config = TrackConfig(warmup_samples=7)
    t = SeriesTracker(config, log_scale=False, noise_floor=0.1)
    assert t.config is config


def _state(tracker: SeriesTracker) -> dict[str, str]:
    """Every slot but the constant-run flag, as text (so -0.0 and 0.0 differ)."""
    return {
        name: repr(getattr(tracker, name))
        for name in SeriesTracker.__slots__
        # The latest points are implied for a constant run (every forecast equals the
        # value): only the full path keeps them.
        if name not in ("_constant", "_config", "_recent")
    }


@pytest.mark.parametrize(
    ("log_scale", "values"),
    [
        (False, [0.0] * 40),
        (True, [0.0] * 40),
        (True, [3.5] * 300),  # past the history limit: downsampled as in full updates
        (False, [3.5] * 30 + [3.6] + [3.5] * 30),
        (True, [3.5] * 3 + [7.0] * 20),  # the run ends inside warm-up, then a step
        (False, [0.0, -0.0, 0.0, -0.0] * 5 + [1.0, 1.0, -0.0]),
        (True, [-0.0, 0.0] * 10 + [2.0, 2.0]),
        (False, [1e-40] * 12),
    ],
    ids=["zeros", "log-zeros", "long", "blip", "step", "signed-zeros", "log-signed", "tiny"],
)
def test_a_constant_run_takes_the_short_update_with_the_same_state(
    log_scale: bool, values: list[float]
) -> None:
    short = make(log_scale=log_scale, history=32)
    full = make(log_scale=log_scale, history=32)
    full._constant = False  # every update takes the full path
    for sample, value in enumerate(values):
        short.update(sample, value)
        full.update(sample, value)
        assert _state(short) == _state(full), f"after sample {sample}"
    assert short._constant == (len(set(values)) == 1)


def test_a_constant_series_has_no_departure_after_its_latest_sample():
    # A module's gradient zero fraction, 0.0 at every sample until the module stopped
    # being called after sample 35: sample 36 has no value to compare with a forecast.
    tracker = make()
    for sample in range(36):
        tracker.update(sample, 0.0)
    at_latest = tracker.departure_at(35)
    assert at_latest is not None
    assert (at_latest.sample, at_latest.value, at_latest.forecast) == (35, 0.0, 0.0)
    assert tracker.departure_at(36) is None


def test_an_accelerating_curve_is_one_change_with_a_small_first_step():
    """Position-embedding kurtosis in a clean GPT-2: flat, then x4 per sample for a few
    samples, then flat again. Each sample's departure is large, but the change builds
    up over samples: one change, dated where its run-up has a quarter of its largest
    excess (sample 31: 1.6 against a forecast of 0.29 after 0.35 at sample 30), whose
    step is that sample's (1.31), not the 28 it reaches."""
    t = make(warmup=24, k=2.5, h=5.0, noise_floor=0.1)
    values = [0.05] * 30 + [0.35, 1.6, 6.2, 16.0, 26.0, 28.5, 29.0, 29.0, 29.2]
    feed(t, values)
    assert t.change_count == 1, t.changes
    change = t.changes[0]
    assert change.start_sample == 31
    # Sample 30: level 0.05 + 0.5 * 0.3 = 0.2, slope 0.3 * 0.3 = 0.09: forecast 0.29.
    assert change.level_before == pytest.approx(0.29, rel=1e-9)
    assert change.level_after == 1.6
    assert change.step == pytest.approx(1.31, rel=1e-9)
    assert change.alarm_sample > change.start_sample


# ---------------------------------------------------------------- spread after a change
def test_a_step_into_noise_is_judged_by_the_spread_after_it():
    t = make(warmup=4, k=2.5, noise_floor=1.0)
    feed(t, [1.0] * 8 + [21.0, 23.0, 19.0, 23.0, 19.0, 23.0, 19.0])
    (change,) = t.changes
    assert (change.start_sample, change.level_before, change.level_after) == (8, 1.0, 21.0)
    assert change.std_before == 1.0  # a constant series: the noise floor
    # Each value from the alarm on against the line through its neighbours (equal gaps:
    # weights 1/2, unit-noise scale sqrt(1.5)): 23 - 20 = 3, then -4, 4, -4; four at most.
    mean_abs = (3.0 + 4.0 + 4.0 + 4.0) / 4
    assert change.spread_after == pytest.approx(MAD_TO_STD * mean_abs / math.sqrt(1.5), rel=EXACT)
    assert change.step_z == pytest.approx(20.0 / change.spread_after, rel=EXACT)


def test_the_spread_after_uses_the_gaps_of_irregular_samples():
    t = make(warmup=4, k=2.5, noise_floor=1.0)
    for sample, (forward, value) in enumerate(
        [
            (0, 1.0),
            (1, 1.0),
            (2, 1.0),
            (3, 1.0),
            (4, 1.0),
            (5, 1.0),
            (6, 21.0),
            (8, 22.0),
            (12, 21.0),
        ]
    ):
        t.update(sample, value, forward)
    (change,) = t.changes
    # The line through (6, 21) and (12, 21) is 21 at forward 8: residual 1, weights 1/3
    # and 2/3, unit-noise scale sqrt(1 + 1/9 + 4/9).
    w = (8 - 6) / (12 - 6)
    expected = MAD_TO_STD * 1.0 / math.sqrt(1.0 + w * w + (1.0 - w) ** 2)
    assert change.spread_after == pytest.approx(expected, rel=EXACT)
    assert change.step_z == pytest.approx(20.0 / max(1.0, expected), rel=EXACT)


def test_a_step_into_calm_keeps_the_spread_before():
    t = make(warmup=4, k=2.5, noise_floor=0.5)
    feed(t, [1.0] * 8 + [21.0] * 6)
    (change,) = t.changes
    assert change.spread_after == 0.0
    assert change.step_z == 20.0 / 0.5


# ---------------------------------------------------------------- volatility per forward
def test_volatility_ratio_is_per_forward_so_wider_gaps_are_not_more_volatile():
    # A random walk sampled at every forward in warm-up, then at every 16th: each later
    # residual is about 4x larger (sqrt(16)) without the walk being any more volatile.
    rng = random.Random(7)
    t = make(warmup=24, k=2.5, noise_floor=0.001)
    level, forward = 0.0, 0
    for sample in range(200):
        gap = 1 if sample < 24 else 16
        for _ in range(gap):
            level += rng.gauss(0.0, 0.1)
        forward += gap
        t.update(sample, level, forward)
    assert t.warmup_mean_gap == 1.0
    per_sample = t.volatility / t.baseline_volatility
    assert per_sample > 2.5
    assert 0.4 < t.volatility_ratio < 1.6


def test_history_keeps_the_same_samples_for_series_that_began_at_different_samples():
    # A series observed from sample 0 and one first observed at sample 1 (a module added
    # to the observation after the first sampled forward) keep the same grid of sample
    # indices, so two series (or two runs) are compared at the same samples.
    early, late = make(history=8, h=1e9), make(history=8, h=1e9)
    for sample in range(200):
        early.update(sample, math.sin(sample))
        if sample >= 1:
            late.update(sample, math.cos(sample))
    grid_early = [s for s, _ in early.history()][1:-1]
    grid_late = [s for s, _ in late.history()][1:-1]
    assert grid_early == grid_late == [32, 64, 96, 128, 160, 192]
    assert early.history()[0][0] == 0 and late.history()[0][0] == 1  # the first stays


def test_history_of_a_series_off_the_grid_is_still_kept_and_bounded():
    t = make(history=8, h=1e9)
    for i in range(300):
        t.update(2 * i + 1, float(i))  # odd samples only: never a multiple of the stride
    samples = [s for s, _ in t.history()]
    assert 4 <= len(samples) <= 8
    assert samples[0] == 1 and samples[-1] == 599
    assert samples == sorted(set(samples))


# ---------------------------------------------------------------- breaks of trend
def test_fit_trend_break_recovers_an_exact_broken_line():
    """Irregular positions, slope 0.01 up to x = 75 and 0.05 after: the corner is found
    between the points 70 and 80, where the two lines meet."""
    xs = [0.0, 10.0, 30.0, 40.0, 70.0, 80.0, 100.0, 130.0, 150.0, 160.0]
    ys = [2.0 + 0.01 * x + 0.04 * max(0.0, x - 75.0) for x in xs]
    fit = fit_trend_break(xs, ys)
    assert fit is not None
    assert fit.position == pytest.approx(75.0, abs=1e-3)
    # The corner is placed by golden-section search (to about 1e-5 of the span).
    assert fit.slope_before == pytest.approx(0.01, rel=1e-4)
    assert fit.slope_after == pytest.approx(0.05, rel=1e-4)
    assert fit.departure == pytest.approx(0.04 * (160.0 - 75.0), rel=1e-4)
    assert fit.level_end == pytest.approx(2.0 + 0.01 * 160.0 + 0.04 * 85.0, rel=1e-6)
    assert fit.spread == pytest.approx(0.0, abs=1e-4)
    assert fit.t > 1e3
    # A straight line has no break: zero departure, t = 0 against the floor.
    line = fit_trend_break(xs, [1.0 + 0.3 * x for x in xs], spread_floor=0.01)
    assert line is not None
    assert abs(line.departure) < 1e-9 and abs(line.t) < 1e-6


def test_fit_trend_break_is_the_least_squares_broken_line():
    """Against numpy's least squares: the chosen corner has the smallest residual sum of
    squares over a fine grid of corners, and slopes, spread and t are those of the
    regression at that corner."""
    numpy = pytest.importorskip("numpy")
    rng = random.Random(11)
    xs = [float(x) for x in (0, 3, 9, 14, 20, 31, 38, 45, 60, 62, 75, 90, 101, 120)]
    ys = [0.5 - 0.002 * x + 0.02 * max(0.0, x - 52.0) + rng.gauss(0.0, 0.03) for x in xs]
    fit = fit_trend_break(xs, ys)
    assert fit is not None
    x, y = numpy.array(xs), numpy.array(ys)

    def regression(corner: float):
        design = numpy.stack([numpy.ones_like(x), x, numpy.maximum(0.0, x - corner)], axis=1)
        coef, rss, *_ = numpy.linalg.lstsq(design, y, rcond=None)
        return coef, float(rss[0]), design

    coef, rss, design = regression(fit.position)
    grid = numpy.linspace(xs[2], xs[-4], 2000)  # corners with 4 points before, 3 after
    assert rss <= min(regression(c)[1] for c in grid) + 1e-12
    spread = math.sqrt(rss / (len(xs) - 3))
    error = spread * math.sqrt(numpy.linalg.inv(design.T @ design)[2, 2])
    assert fit.slope_before == pytest.approx(coef[1], rel=1e-8)
    assert fit.slope_after == pytest.approx(coef[1] + coef[2], rel=1e-8)
    assert fit.spread == pytest.approx(spread, rel=1e-8)
    assert fit.t == pytest.approx(coef[2] / error, rel=1e-6)
    assert fit.departure == pytest.approx(coef[2] * (xs[-1] - fit.position), rel=1e-8)


def test_fit_trend_break_needs_points_on_both_sides():
    assert fit_trend_break([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [0.0] * 6) is None
    assert fit_trend_break([1.0] * 8, [0.0] * 8) is None


def test_trend_break_of_a_series_that_starts_to_grow_is_dated_where_it_leaves_the_trend():
    """Log RMS flat (1% noise) on the default schedule, then growing 0.1% per forward
    from forward 500 (too gradual between two samples for a step): a break of kind
    "trend", dated no earlier than forward 500 and before the next sample (570), with
    the new slope and the departure at the latest sample."""
    rng = random.Random(2)
    t = make(warmup=24, k=2.5, h=5.0, log_scale=True, noise_floor=0.02)
    forwards = [f for f in SCHEDULE if f <= 1500]
    for sample, forward in enumerate(forwards):
        growth = 0.001 * max(0, forward - 500)
        t.update(sample, math.exp(growth + rng.gauss(0.0, 0.01)), forward)
    assert t.change_count == 0
    change = t.trend_break()
    assert change is not None and change.kind == "trend" and change.confirmed
    assert 500 <= change.start_forward < 570
    # The onset sample: the first sample at or after the bend (506 or 570 here).
    assert forwards[change.start_sample] == min(f for f in forwards if f >= change.start_forward)
    assert change.alarm_sample == len(forwards) - 1
    assert change.slope_before == pytest.approx(0.0, abs=1e-4)
    assert change.slope_after == pytest.approx(0.001, rel=0.02)
    assert change.step == pytest.approx(0.001 * (forwards[-1] - 500), rel=0.1)
    assert change.step_z > 20 and change.slope_change_t > 10
    assert t.trend_break() is change  # computed once per new value


def test_trend_break_starts_after_the_latest_step():
    """A step is a change of its own: the fit starts after it, so a flat series with one
    step has no break of trend to speak of."""
    t = make(warmup=8, k=2.5, h=5.0, log_scale=True, noise_floor=0.02)
    rng = random.Random(4)
    for sample in range(60):
        t.update(sample, (3.0 if sample >= 30 else 1.0) * math.exp(rng.gauss(0.0, 0.01)))
    assert [c.start_sample for c in t.changes] == [30]
    change = t.trend_break()
    assert change is not None and change.start_sample > 30
    assert abs(change.step) < 0.05


@pytest.mark.parametrize(
    ("level_after", "value_before", "kind", "expected"),
    [
        (0.4, 0.7, "step", -0.3),  # against the trend: measured from the last value
        (1.5, 0.7, "step", 0.5),  # along the trend: measured from the forecast
        (0.85, 0.7, "step", 0.0),  # between the last value and the forecast: no step
        (0.4, math.nan, "step", -0.6),  # no value before: the step itself
        (0.4, 0.7, "trend", -0.6),  # a break of trend keeps its step
    ],
)
def test_step_without_trend_is_the_smaller_departure_in_the_same_direction(
    level_after: float, value_before: float, kind: str, expected: float
) -> None:
    change = ChangePoint(
        start_sample=10,
        alarm_sample=10,
        level_before=1.0,  # the forecast carried a rising slope across the gap
        std_before=0.1,
        level_after=level_after,
        value_before=value_before,
        kind=kind,
        spread_after=0.2,
    )
    assert change.step_without_trend == pytest.approx(expected, abs=1e-12)
    assert change.step_without_trend_z == pytest.approx(expected / 0.2, abs=1e-12)


def test_a_change_records_the_last_value_before_it() -> None:
    tracker = SeriesTracker(TrackConfig(warmup_samples=4), log_scale=False, noise_floor=0.1)
    for sample, value in enumerate([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]):
        tracker.update(sample, value)
    (change,) = tracker.changes
    assert (change.start_sample, change.value_before, change.level_after) == (6, 1.0, 5.0)


# ---------------------------------------------------------------- sustained shifts

SHIFT_XS = [float(x) for x in range(13)]
SHIFT_BEFORE = [0.0, 0.1, -0.1, 0.0, 0.1, -0.1, 0.0, 0.1]


def test_sustained_shift_by_hand():
    ys = [*SHIFT_BEFORE, 2.0, 2.1, 1.9, 2.0, 2.1]
    shift = find_sustained_shift(SHIFT_XS, ys, least_step=1.0)
    assert shift is not None
    # Window before: the median of its 28 pairwise slopes is 0, its median 0, so the
    # residuals are the values; their median absolute deviation is 0.1. The window after
    # has median 2.0, against the median before (0.0) and the flat line alike.
    assert (shift.index, shift.onset) == (8, 8)
    assert shift.slope_before == 0.0
    assert shift.reference == 0.0
    assert shift.level_after == 2.0
    assert shift.spread == pytest.approx(1.4826 * 0.1, abs=EXACT)
    assert shift.error == pytest.approx(1.4826 * 0.1 * math.sqrt(1 / 8 + 1 / 5), abs=EXACT)
    assert shift.z == pytest.approx(2.0 / shift.error, abs=EXACT)
    # Past the largest step, nothing is considered.
    assert find_sustained_shift(SHIFT_XS, ys, least_step=2.5) is None


def test_sustained_shift_onset_is_the_first_value_past_halfway():
    # The first value of the window after dips the other way: the new level begins at
    # the next one.
    ys = [*SHIFT_BEFORE, 2.0, -0.5, 2.0, 2.1, 1.9, 2.0, 2.1]
    xs = [float(x) for x in range(len(ys))]
    shift = find_sustained_shift(xs, ys, least_step=1.0, points_after=5)
    assert shift is not None
    assert shift.onset >= shift.index
    dipped = [*SHIFT_BEFORE, -0.5, 2.0, 2.1, 1.9, 2.0]
    start = find_sustained_shift(SHIFT_XS, dipped, least_step=1.0, points_after=5)
    assert start is not None
    assert (start.index, start.onset) == (8, 9)


def test_a_line_or_a_series_that_stops_rising_is_not_a_sustained_shift():
    rising = [0.5 * x for x in SHIFT_XS]  # along its own line: no departure from it
    assert find_sustained_shift(SHIFT_XS, rising, least_step=0.1) is None
    stopped = [0.5 * x for x in range(8)] + [3.5] * 5  # above the old median, below the line
    assert find_sustained_shift(SHIFT_XS, stopped, least_step=0.1) is None


def test_sustained_shift_rejects_bad_input():
    with pytest.raises(ValueError, match="xs has 2 points, ys 3"):
        find_sustained_shift([0.0, 1.0], [0.0, 1.0, 2.0], least_step=0.0)
    with pytest.raises(ValueError, match="points_before must be >= 3"):
        find_sustained_shift(SHIFT_XS, SHIFT_XS, least_step=0.0, points_before=2)


def test_tracker_sustained_shift_is_a_change_point_from_the_history():
    tracker = make(warmup=4, log_scale=True, noise_floor=0.01)
    rng = random.Random(3)
    values = [math.exp(rng.gauss(0.0, 0.6)) * (30.0 if i >= 20 else 1.0) for i in range(30)]
    for sample, value in enumerate(values):
        tracker.update(sample, value, 8 * sample)  # a sample every 8 training forwards
    change = tracker.sustained_shift(math.log(4.0))
    assert change is not None
    assert change.kind == "sustained_shift"
    assert change.start_sample == 20
    assert change.start_forward == 20 * 8
    # The best window after began at sample 19 (still the old level: the onset moved to
    # the first value past halfway); the alarm is that window's last value.
    assert change.alarm_sample == 19 + 4
    assert change.confirmed and not change.transient
    assert change.step == pytest.approx(change.level_after - change.level_before, abs=EXACT)
    assert math.exp(change.step) > 10.0
    assert change.step_z == pytest.approx(change.step / change.std_before, abs=EXACT)
    assert tracker.sustained_shift(math.log(4.0)) is change  # cached until a new value
    assert tracker.sustained_shift(math.log(100.0)) is None
