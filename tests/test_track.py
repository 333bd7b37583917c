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
from torchinstruments.track import LOG_FLOOR, ChangePoint, SeriesPoint, SeriesTracker

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


def test_volatility_and_baseline_volatility():
    values = [1.0, 3.0, 2.0, 2.0, 6.0]
    t = make(fast=0.5, warmup=3, h=1e9)
    feed(t, values)
    # squared diffs 4, 1, 0, 16; EMA from 0 with alpha 0.5: 2 -> 1.5 -> 0.75 -> 8.375.
    assert t.volatility == pytest.approx(math.sqrt(8.375), rel=EXACT)
    # Warm-up (first 3 values): sqrt((4 + 1) / 2).
    assert t.baseline_volatility == pytest.approx(math.sqrt(2.5), rel=EXACT)


def test_volatility_in_log_units_for_log_scale():
    t = make(log_scale=True, fast=1.0)
    feed(t, [1.0, 2.0, 8.0])
    assert t.volatility == pytest.approx(math.log(4.0), rel=EXACT)  # alpha 1: latest |diff|


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


# ---------------------------------------------------------------- CUSUM change points

WARM = [1.0, 1.1, 1.0, 1.1]
WARM_MEAN = statistics.fmean(WARM)  # 1.05
WARM_STD = statistics.stdev(WARM)  # sqrt(0.01 / 3) = 0.0577


def test_cusum_statistics_by_hand():
    t = make(warmup=4, k=0.5, h=5.0)
    feed(t, [*WARM, 1.0, 1.1])
    z = (1.0 - WARM_MEAN) / WARM_STD  # -0.866
    # Sample 4 (1.0): S+ = max(0, z - k) = 0, S- = max(0, -z - k) = 0.366.
    # Sample 5 (1.1): S+ = max(0, -z - k) = 0.366, S- = max(0, 0.366 + z - k) = 0.
    assert t.cusum_positive == pytest.approx(-z - 0.5, rel=1e-9)
    assert t.cusum_negative == 0.0
    assert t.cusum_peak == pytest.approx(-z - 0.5, rel=1e-9)
    assert t.change_count == 0


def test_step_of_ten_std_alarms_at_the_step():
    t = make(warmup=4, k=0.5, h=5.0)
    jump = WARM_MEAN + 10 * WARM_STD
    feed(t, [*WARM, 1.0, jump, jump, jump])
    # Sample 5: S+ = 0 + 10 - 0.5 = 9.5 > 5: alarm at once.
    assert t.change_count == 1
    change = t.latest_change
    assert change is not None
    assert change.alarm_sample == 5
    assert change.start_sample == 5
    assert change.level_before == pytest.approx(WARM_MEAN, rel=EXACT)
    assert change.std_before == pytest.approx(WARM_STD, rel=EXACT)
    assert change.level_after == pytest.approx(jump, rel=EXACT)
    assert change.step == pytest.approx(10 * WARM_STD, rel=1e-9)
    assert change.step_z == pytest.approx(10.0, rel=1e-9)
    # The new segment learns over max(4, 4 // 3) = 4 values: 3 seen so far.
    assert not change.confirmed
    assert t.strongest_change is change
    assert t.largest_change is None
    assert t.cusum_peak == pytest.approx(9.5, rel=1e-9)


def test_step_of_two_std_accumulates_to_alarm():
    t = make(warmup=4, k=0.5, h=5.0)
    up = WARM_MEAN + 2 * WARM_STD
    feed(t, [*WARM, 1.0, up, up, up, up, up])
    # z = 2 from sample 5: S+ = 1.5, 3.0, 4.5, 6.0: alarm at sample 8, started at 5.
    change = t.latest_change
    assert change is not None
    assert (change.start_sample, change.alarm_sample) == (5, 8)
    assert change.level_before == pytest.approx(WARM_MEAN, rel=EXACT)
    assert change.level_after == pytest.approx(up, rel=EXACT)
    assert t.change_count == 1


def test_downward_step():
    t = make(warmup=4, k=0.5, h=5.0)
    down = WARM_MEAN - 3 * WARM_STD
    feed(t, [*WARM, 1.1, down, down, down])
    # z = -3 from sample 5: S- = 2.5, 5.0 (not > 5), 7.5: alarm at sample 7.
    # Sample 4 (1.1) left S- at 0, so the start is sample 5.
    change = t.latest_change
    assert change is not None
    assert (change.start_sample, change.alarm_sample) == (5, 7)
    assert change.step == pytest.approx(-3 * WARM_STD, rel=1e-9)
    assert change.step_z == pytest.approx(-3.0, rel=1e-9)


def test_change_point_confirmed_after_new_segment_warmup():
    t = make(warmup=4)
    feed(t, [*WARM, 1.0, 2.0, 2.1, 2.0])
    change = t.latest_change
    assert change is not None and change.alarm_sample == 5
    assert not change.confirmed
    assert change.level_after == pytest.approx(statistics.fmean([2.0, 2.1, 2.0]), rel=EXACT)
    t.update(8, 2.1)
    assert change.confirmed
    assert change.level_after == pytest.approx(2.05, rel=EXACT)
    assert change.step == pytest.approx(1.0, rel=1e-9)
    assert t.largest_change is change
    assert t.strongest_change is change
    # level_after stays at the confirmed segment mean.
    t.update(9, 2.0)
    assert change.level_after == pytest.approx(2.05, rel=EXACT)


def test_rearms_after_alarm_and_records_second_change():
    t = make(warmup=12)  # a new segment learns over max(4, 12 // 3) = 4 values
    warm = [1.0, 1.1] * 6
    feed(t, warm)
    std0 = statistics.stdev(warm)
    feed(t, [1.0, 2.0, 2.1, 2.0, 2.1, 2.0], first_sample=12)
    first = t.latest_change
    assert first is not None
    assert first.alarm_sample == 13
    assert first.confirmed
    assert first.level_before == pytest.approx(1.05, rel=EXACT)
    assert first.std_before == pytest.approx(std0, rel=EXACT)
    assert first.level_after == pytest.approx(2.05, rel=EXACT)
    # The second segment's reference: mean 2.05, sample std of [2, 2.1, 2, 2.1].
    feed(t, [4.0, 4.1, 4.0], first_sample=18)
    second = t.latest_change
    assert second is not None and second is not first
    assert t.change_count == 2
    assert second.alarm_sample == 18
    assert second.start_sample == 18
    assert second.level_before == pytest.approx(2.05, rel=EXACT)
    assert second.std_before == pytest.approx(statistics.stdev([2.0, 2.1, 2.0, 2.1]), rel=EXACT)
    # Unconfirmed but already larger than the first: it is the strongest.
    assert not second.confirmed
    assert t.largest_change is first
    assert t.strongest_change is second
    t.update(21, 4.1)
    assert second.confirmed
    assert second.level_after == pytest.approx(4.05, rel=EXACT)
    assert t.largest_change is second
    # The baseline of the run is still the warm-up's.
    assert t.baseline_mean == pytest.approx(1.05, rel=EXACT)


def test_no_alarm_during_new_segment_warmup():
    t = make(warmup=4)
    feed(t, [*WARM, 1.0, 2.0])
    assert t.change_count == 1
    # The detector is blind while the new segment learns (3 more values).
    feed(t, [50.0, -50.0, 50.0], first_sample=6)
    assert t.change_count == 1


def test_large_jump_while_a_new_segment_learns_is_a_change_of_its_own():
    """Log scale: a 10% rise alarms at sample 6; zeros from sample 7, inside the new
    segment's learning window, are a second change at sample 7 (not averaged into the
    level learnt after the first); a 2x wobble in the window is not (below 4x)."""
    t = make(warmup=12, log_scale=True, noise_floor=0.02)
    warm = [1.0, 1.01] * 6
    feed(t, warm)  # samples 0..11
    feed(t, [1.1, 1.1], first_sample=12)
    first = t.latest_change
    assert first is not None and first.alarm_sample == 13 and t.change_count == 1
    t.update(14, 0.0)
    second = t.latest_change
    assert second is not None and second is not first and t.change_count == 2
    assert (second.start_sample, second.alarm_sample) == (14, 14)
    assert second.level_before == pytest.approx(math.log(1.1), rel=EXACT)
    assert second.level_after == math.log(LOG_FLOOR)
    assert second.std_before == first.std_before
    assert not first.confirmed  # its level was never learnt in full
    assert first.level_after == pytest.approx(math.log(1.1), rel=EXACT)
    # A 2x move while learning is averaged in, as before.
    u = make(warmup=12, log_scale=True, noise_floor=0.02)
    feed(u, warm)
    feed(u, [1.1, 1.1, 2.2], first_sample=12)
    assert u.change_count == 1
    # Linear-scale series keep the blind window (no fixed yardstick for a jump).
    v = make(warmup=4)
    feed(v, [*WARM, 1.0, 2.0, 50.0])
    assert v.change_count == 1


@pytest.mark.parametrize(
    "tail",
    [[5.0, 1.0] * 500, [5.0, 1.0, 1.0] * 333, [0.0, 1.0] * 500],
    ids=["oscillation-5x", "spike-every-3rd", "zero-and-back"],
)
def test_oscillation_after_a_change_keeps_change_points_few_and_bounded(tail):
    """An output that keeps jumping 5x up and down (or to 0 and back) after a change
    must not start a change point at every sample: a return to the level before the
    change is not a jump, jumps restart learning once per segment, and the list of
    change points stays bounded even when none is confirmed."""
    t = make(warmup=12, log_scale=True, noise_floor=0.02)
    feed(t, [1.0, 1.01] * 25)
    feed(t, tail, first_sample=50)
    assert 1 <= t.change_count <= 3, t.change_count
    assert len(t.changes) <= 8
    assert t.strongest_change is not None and t.strongest_change.alarm_sample == 50


def test_change_points_stay_bounded_when_none_is_confirmed():
    t = make(warmup=4)
    for index in range(40):  # steps every other sample: each segment learns too briefly
        t._start_change(index, index, float(index), 0.1)
    assert t.change_count == 40
    assert len(t.changes) == 8 and t.changes[-1].alarm_sample == 39


def test_seeded_noisy_stream_alarms_at_known_step():
    rng = random.Random(1234)
    noise = 0.01
    step_at = 40
    values = [1.0 + rng.gauss(0.0, noise) for _ in range(step_at)]
    values += [1.0 + 10 * noise + rng.gauss(0.0, noise) for _ in range(20)]
    t = make(warmup=16, fast=0.3, slow=0.05, noise_floor=0.001)
    feed(t, values)
    assert t.change_count == 1  # the step, and no false alarm before it
    change = t.latest_change
    assert change is not None
    assert change.alarm_sample == step_at
    assert change.start_sample == step_at
    assert change.confirmed
    assert change.level_before == pytest.approx(statistics.fmean(values[:16]), rel=EXACT)
    assert change.std_before == pytest.approx(statistics.stdev(values[:16]), rel=EXACT)
    # New segment: the first max(4, 16 // 3) = 5 values after the alarm.
    assert change.level_after == pytest.approx(
        statistics.fmean(values[step_at : step_at + 5]), rel=EXACT
    )
    assert change.step == pytest.approx(10 * noise, rel=0.3)


def test_seeded_log_scale_step():
    rng = random.Random(99)
    values = [2.0 * math.exp(rng.gauss(0.0, 0.01)) for _ in range(30)]
    values += [8.0 * math.exp(rng.gauss(0.0, 0.01)) for _ in range(10)]
    t = make(warmup=10, log_scale=True, noise_floor=0.02)
    feed(t, values)
    assert t.change_count == 1
    change = t.strongest_change
    assert change is not None
    assert change.alarm_sample == 30
    logs = [math.log(v) for v in values]
    assert change.level_before == pytest.approx(statistics.fmean(logs[:10]), rel=EXACT)
    # std of 1% noise is below the 2% floor.
    assert change.std_before == 0.02
    assert change.step == pytest.approx(math.log(4.0), rel=0.05)
    assert t.level(change.level_after) == pytest.approx(8.0, rel=0.05)


def test_change_point_step_properties():
    change = ChangePoint(
        start_sample=3, alarm_sample=5, level_before=1.0, std_before=0.5, level_after=2.5
    )
    assert change.step == 1.5
    assert change.step_z == 3.0
    assert not change.confirmed


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
        if name not in ("_constant", "_config")
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
