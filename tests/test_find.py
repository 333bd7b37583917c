"""The find stage on hand-built series: exact orderings, echoes and determinism.

Each test builds :class:`TensorSeries` objects directly and feeds them seeded synthetic
values (multiplicative noise of about 1%, well inside the 2% noise floor of scale metrics),
then runs :func:`torchinstruments.find.run_rules`. Module names are chosen so that
alphabetical order is the reverse of forward order: a ranking that fell back on names
instead of forward positions would fail.
"""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from torchinstruments.config import TrackConfig
from torchinstruments.find import CATEGORIES, RULES, Candidate, model_wide_texts, run_rules
from torchinstruments.find.base import ORIGIN_SHARE, UPSTREAM_DEPARTURE_SPREADS, is_early
from torchinstruments.reduce import cpu_statistics, finish_statistics
from torchinstruments.series import ACTIVATION, GRAD_OUTPUT, RMS_TO_ROOT, TensorSeries

CONFIG = TrackConfig()  # warm-up 24 samples
SAMPLES = 60
STEP_AT = 40
NOISE = 0.01  # relative, per sample


def new_series(module: str, position: int, signal: str = ACTIVATION) -> TensorSeries:
    return TensorSeries(
        module=module,
        call_index=0,
        signal=signal,
        tensor_path="output",
        forward_position=position,
        trackers={},
    )


def noisy(rng: random.Random, level: float) -> float:
    return level * math.exp(rng.gauss(0.0, NOISE))


def stepped_activation(
    module: str, position: int, factor: float, seed: int, step_at: int = STEP_AT
) -> TensorSeries:
    """Activation RMS around 1.0 that is multiplied by ``factor`` from ``step_at`` on."""
    rng = random.Random(seed)
    series = new_series(module, position)
    for sample in range(SAMPLES):
        level = factor if sample >= step_at else 1.0
        series.update(CONFIG, sample, {"rms": noisy(rng, level)})
    return series


def quiet_activation(module: str, position: int, seed: int) -> TensorSeries:
    return stepped_activation(module, position, 1.0, seed)


def root_gradient(seed: int) -> TensorSeries:
    """The loss gradient: the root's output gradient, quiet, falling slowly."""
    rng = random.Random(seed)
    series = new_series("", 0, GRAD_OUTPUT)
    for sample in range(SAMPLES):
        series.update(CONFIG, sample, {"rms": noisy(rng, 1e-3 * 0.99**sample)})
    return series


def stepped_gradient(module: str, factor: float, seed: int) -> TensorSeries:
    """Output-gradient RMS whose ratio to the loss gradient steps by ``factor``."""
    rng = random.Random(seed)
    series = new_series(module, -1, GRAD_OUTPUT)  # positions come from the activations
    for sample in range(SAMPLES):
        ratio = noisy(rng, factor if sample >= STEP_AT else 1.0)
        root = 1e-3 * 0.99**sample
        series.update(CONFIG, sample, {"rms": ratio * root, RMS_TO_ROOT: ratio})
    return series


def non_finite_series(
    module: str, position: int, first_bad: int | None, signal: str = ACTIVATION
) -> TensorSeries:
    series = new_series(module, position, signal)
    for sample in range(SAMPLES):
        bad = first_bad is not None and sample >= first_bad
        series.update(CONFIG, sample, {"nonfinite_fraction": 0.25 if bad else 0.0})
    return series


def names(candidates: list[Candidate]) -> list[str]:
    return [c.series.module for c in candidates]


def echo_names(candidate: Candidate) -> list[str]:
    return [e.series.module for e in candidate.echoes]


def notable(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.notable]


# ---------------------------------------------------------------- (a) activations


def activation_fault() -> list[TensorSeries]:
    # Forward positions 1, 2, 3; the step grows downstream, so the loudest is last.
    return [
        stepped_activation("z_first", 1, 4.0, seed=1),
        stepped_activation("m_second", 2, 8.0, seed=2),
        stepped_activation("a_third", 3, 16.0, seed=3),
    ]


def test_activation_step_origin_is_earliest_in_forward_order():
    found = run_rules(activation_fault())
    drift = notable(found["activation_scale_drift"])
    assert names(drift) == ["z_first"]
    origin = drift[0]
    assert origin.onset == STEP_AT
    assert origin.position == 1
    assert origin.direction == 1
    # The louder downstream modules are echoes, strongest first.
    assert echo_names(origin) == ["a_third", "m_second"]
    assert [e.onset for e in origin.echoes] == [STEP_AT, STEP_AT]
    assert origin.echoes[0].score > origin.echoes[1].score > origin.score
    assert origin.group_score == origin.echoes[0].score
    # Echoes are folded: not returned as findings of their own.
    assert "a_third" not in names(found["activation_scale_drift"])
    assert "m_second" not in names(found["activation_scale_drift"])
    # Scores are |ln(level after / trend forecast)| of the step: about ln 4 for the origin.
    assert origin.change is not None
    assert origin.score == abs(origin.change.step)
    assert abs(origin.score - math.log(4.0)) < 0.05


def bulk_stepped_activation(
    module: str,
    position: int,
    rms_factor: float,
    bulk_factor: float,
    seed: int,
    step_at: int = STEP_AT,
) -> TensorSeries:
    """RMS and mean absolute value around 1.0 and 0.8 that step by their own factors from
    ``step_at`` on (an activation function swapped: the bulk moves, the largest stay)."""
    rng = random.Random(seed)
    series = new_series(module, position)
    for sample in range(SAMPLES):
        after = sample >= step_at
        values: dict[str, float | None] = {
            "rms": noisy(rng, rms_factor if after else 1.0),
            "mean_abs": noisy(rng, 0.8 * (bulk_factor if after else 1.0)),
        }
        series.update(CONFIG, sample, values)
    return series


def test_a_step_of_the_bulk_alone_is_judged_on_the_mean_absolute_value():
    # RMS 1.1x (below the 1.3x step), mean absolute value 1.6x: the mean_abs candidate.
    found = run_rules([bulk_stepped_activation("act", 1, 1.1, 1.6, seed=4)])
    (drift,) = found["activation_scale_drift"]
    assert (drift.metric, drift.notable, drift.onset) == ("mean_abs", True, STEP_AT)
    assert abs(drift.score - math.log(1.6)) < 0.05
    assert "activation.mean_abs" in RULES["activation_scale_drift"].interpretation(drift)
    # Both stepped notably: the RMS candidate, one per series.
    found = run_rules([bulk_stepped_activation("act", 1, 2.0, 1.6, seed=4)])
    (drift,) = found["activation_scale_drift"]
    assert (drift.metric, drift.notable) == ("rms", True)
    assert abs(drift.score - math.log(2.0)) < 0.05
    # Neither: the RMS candidate, not notable.
    (drift,) = run_rules([bulk_stepped_activation("act", 1, 1.05, 1.1, seed=4)])[
        "activation_scale_drift"
    ]
    assert (drift.metric, drift.notable) == ("rms", False)


def test_a_step_of_the_bulk_alone_ranks_after_an_rms_step_of_its_category():
    # The bulk of "early" steps at sample 32, the RMS of "late" at 48: the RMS step first.
    found = run_rules(
        [
            bulk_stepped_activation("early", 1, 1.0, 1.6, seed=5, step_at=32),
            bulk_stepped_activation("late", 2, 2.0, 2.0, seed=6, step_at=48),
        ]
    )
    drift = notable(found["activation_scale_drift"])
    assert [(c.series.module, c.metric, c.onset, c.secondary) for c in drift] == [
        ("late", "rms", 48, False),
        ("early", "mean_abs", 32, True),
    ]


def test_activation_step_regime_change_names_same_origin():
    found = run_rules(activation_fault())
    regime = notable(found["regime_change"])
    assert names(regime) == ["z_first"]
    origin = regime[0]
    change = origin.tracker.strongest_change
    assert change is not None
    assert change.alarm_sample == STEP_AT
    assert change.start_sample == STEP_AT
    assert echo_names(origin) == ["a_third", "m_second"]


def test_separate_events_are_separate_groups_ranked_by_strongest_score():
    series = [
        *activation_fault(),
        stepped_activation("y_late", 4, 2.5, seed=4, step_at=50),
        stepped_activation("b_later", 5, 3.0, seed=5, step_at=50),
        quiet_activation("quiet", 6, seed=6),
    ]
    drift = notable(run_rules(series)["activation_scale_drift"])
    # Group at sample 40 (strongest score ln 16) first, then the group at sample 50,
    # whose origin is the earlier module even though b_later stepped more.
    assert names(drift) == ["z_first", "y_late"]
    assert [c.onset for c in drift] == [STEP_AT, 50]
    assert echo_names(drift[1]) == ["b_later"]


# ---------------------------------------------------------------- (b) gradients


def gradient_fault() -> list[TensorSeries]:
    # Activations give the forward positions (quiet); gradients step at STEP_AT, the
    # loudest being the earliest module (gradients flow backwards).
    return [
        quiet_activation("z_first", 1, seed=11),
        quiet_activation("m_second", 2, seed=12),
        quiet_activation("a_third", 3, seed=13),
        root_gradient(seed=10),
        stepped_gradient("z_first", 16.0, seed=21),
        stepped_gradient("m_second", 8.0, seed=22),
        stepped_gradient("a_third", 4.0, seed=23),
    ]


def test_gradient_step_origin_is_latest_in_forward_order():
    found = run_rules(gradient_fault())
    change = notable(found["gradient_scale_change"])
    assert names(change) == ["a_third"]
    origin = change[0]
    assert origin.position == 3
    assert origin.onset == STEP_AT
    assert origin.basis == "abs_log_step_net_of_loss_gradient"
    assert origin.judged is origin.series.trackers[RMS_TO_ROOT]
    assert echo_names(origin) == ["z_first", "m_second"]
    assert origin.group_score == origin.echoes[0].score
    # The text names the judged measure wherever it is not the raw gradient RMS.
    text = RULES["gradient_scale_change"].interpretation(origin)
    assert "stepped up (net of the loss gradient) from sample 40" in text, text
    assert "its rms_to_root (its RMS over the loss gradient's) was 4." in text, text
    # The loss gradient itself is the reference: listed last, never notable.
    ranked = found["gradient_scale_change"]
    assert ranked[-1].series.module == ""
    assert ranked[-1].score == 0.0
    assert not ranked[-1].notable


def test_gradient_step_regime_change_names_latest_module():
    regime = notable(run_rules(gradient_fault())["regime_change"])
    assert names(regime) == ["a_third"]
    assert regime[0].series.signal == GRAD_OUTPUT
    assert echo_names(regime[0]) == ["z_first", "m_second"]


def test_gradient_fault_leaves_activation_categories_quiet():
    found = run_rules(gradient_fault())
    assert notable(found["activation_scale_drift"]) == []


# ---------------------------------------------------------------- (c) non-finite


def test_non_finite_same_sample_ties_broken_by_forward_order():
    found = run_rules(
        [
            non_finite_series("c_third", 3, 10),
            non_finite_series("a_second", 2, 10),
            non_finite_series("b_first", 1, 10),
            non_finite_series("clean", 4, None),
        ]
    )["non_finite"]
    assert names(found) == ["b_first"]
    origin = found[0]
    assert origin.onset == 10
    assert origin.score == -10.0
    assert origin.evidence["first_nonfinite_sample"] == 10
    assert origin.evidence["samples_with_nonfinite"] == SAMPLES - 10
    assert origin.evidence["samples_observed"] == SAMPLES
    assert echo_names(origin) == ["a_second", "c_third"]


def test_non_finite_earliest_sample_wins_over_forward_order():
    found = run_rules(
        [
            non_finite_series("a_first", 1, 30),
            non_finite_series("b_second", 2, 12),
            non_finite_series("c_third", 3, 10),
        ]
    )["non_finite"]
    # The module at forward position 3 went non-finite first: it is the origin, and the
    # modules that went non-finite later are not its echoes.
    assert names(found) == ["c_third", "b_second", "a_first"]
    assert [c.onset for c in found] == [10, 12, 30]
    assert [c.score for c in found] == [-10.0, -12.0, -30.0]
    assert all(c.echoes == [] for c in found)


def test_non_finite_within_a_few_samples_is_not_folded_into_a_later_upstream_module():
    # Module at position 2 is non-finite from sample 10; position 1 only from sample 12.
    # Position 1 was finite at sample 10, so it cannot be the origin.
    found = run_rules(
        [
            non_finite_series("a_first", 1, 12),
            non_finite_series("b_second", 2, 10),
            non_finite_series("c_third", 3, 10),
        ]
    )["non_finite"]
    assert names(found) == ["b_second", "a_first"]
    assert echo_names(found[0]) == ["c_third"]


def test_non_finite_gradients_origin_is_latest_module():
    found = run_rules(
        [
            quiet_activation("z_first", 1, seed=1),
            quiet_activation("a_second", 2, seed=2),
            non_finite_series("z_first", 1, 20, GRAD_OUTPUT),
            non_finite_series("a_second", 2, 20, GRAD_OUTPUT),
        ]
    )["non_finite"]
    assert names(found) == ["a_second"]
    assert echo_names(found[0]) == ["z_first"]


def test_non_finite_activation_and_gradient_are_separate_groups():
    found = run_rules(
        [
            non_finite_series("a_first", 1, 20),
            non_finite_series("a_first", 1, 20, GRAD_OUTPUT),
        ]
    )["non_finite"]
    assert [(c.series.module, c.series.signal) for c in found] == [
        ("a_first", ACTIVATION),
        ("a_first", GRAD_OUTPUT),
    ]


# ---------------------------------------------------------------- (d) quiet noise


def quiet_model(seed: int) -> list[TensorSeries]:
    """Three modules and the root, with metrics reduced from seeded random tensors."""
    generator = torch.Generator().manual_seed(seed)
    modules = [("", 0), ("encoder", 1), ("encoder.relu", 2), ("head", 3)]
    activations = {name: new_series(name, position) for name, position in modules}
    gradients = {name: new_series(name, -1, GRAD_OUTPUT) for name, _ in modules}
    for sample in range(SAMPLES):
        values = {}
        for name, _ in modules:
            x = torch.randn(512, generator=generator)
            if name == "encoder.relu":
                x = x.relu()
            activations[name].update(CONFIG, sample, finish_statistics(cpu_statistics(x)))
            g = torch.randn(512, generator=generator) * 1e-3
            values[name] = finish_statistics(cpu_statistics(g))
        root_rms = values[""]["rms"]
        assert root_rms is not None
        for name, _ in modules:
            row = dict(values[name])
            rms = row["rms"]
            if name and rms is not None:
                row[RMS_TO_ROOT] = rms / root_rms
            gradients[name].update(CONFIG, sample, row)
    return [*activations.values(), *gradients.values()]


def test_quiet_noise_has_no_notable_candidate():
    found = run_rules(quiet_model(seed=0))
    assert set(found) == set(CATEGORIES)
    for category, candidates in found.items():
        assert notable(candidates) == [], category
        for candidate in candidates:
            assert candidate.echoes == []


def test_quiet_model_trackers_are_warm():
    # Warm-up is complete everywhere, so "nothing notable" above is not for lack of data.
    for series in quiet_model(seed=0):
        assert series.observations == SAMPLES
        for tracker in series.trackers.values():
            assert tracker.count == SAMPLES
            assert tracker.warmup_complete


# ---------------------------------------------------------------- (e) determinism


def summary(found: dict[str, list[Candidate]]) -> list[tuple[object, ...]]:
    return [
        (
            category,
            rank,
            c.series.module,
            c.series.call_index,
            c.series.signal,
            c.series.tensor_path,
            c.metric,
            c.score,
            c.notable,
            c.onset,
            tuple(echo_names(c)),
        )
        for category, candidates in found.items()
        for rank, c in enumerate(candidates, start=1)
    ]


def mixed_run() -> list[TensorSeries]:
    return [
        *gradient_fault(),
        stepped_activation("n_act", 4, 4.0, seed=31),
        stepped_activation("o_act", 5, 4.0, seed=32),
        non_finite_series("p_nan", 6, 45),
        non_finite_series("q_nan", 7, 45),
    ]


def test_same_input_gives_same_order():
    first = summary(run_rules(mixed_run()))
    second = summary(run_rules(mixed_run()))
    assert first == second
    assert any(row[8] for row in first)  # something notable was ranked


def test_rerunning_on_the_same_series_gives_same_order():
    series = mixed_run()
    assert summary(run_rules(series)) == summary(run_rules(series))


def test_order_does_not_depend_on_input_order():
    series = mixed_run()
    assert summary(run_rules(series)) == summary(run_rules(list(reversed(series))))
    shuffled = list(series)
    random.Random(5).shuffle(shuffled)
    assert summary(run_rules(series)) == summary(run_rules(shuffled))


# ---------------------------------------------------------------- (f) profile, model-wide


def test_origin_is_where_the_profile_of_change_begins():
    """A small move upstream at the same sample (the optimizer carried the fault back
    between samples) is an echo: the origin is the first module whose step is at least
    ORIGIN_SHARE of the group's largest, in residual spreads."""
    series = [
        stepped_activation("z_attention", 1, 1.35, seed=41),  # about 15 spreads
        stepped_activation("m_fc", 2, 8.0, seed=42),  # about 100 spreads
        stepped_activation("a_after", 3, 8.0, seed=43),
    ]
    drift = notable(run_rules(series)["activation_scale_drift"])
    assert names(drift) == ["m_fc"]
    steps = {e.series.module: abs(e.change.step_z) for e in drift[0].echoes if e.change}
    assert set(steps) == {"z_attention", "a_after"}
    change = drift[0].change
    assert change is not None
    assert steps["z_attention"] < ORIGIN_SHARE * abs(change.step_z)


def test_most_modules_moving_at_once_is_one_model_wide_event():
    series = [stepped_activation(f"block{i}", i, 3.0, seed=50 + i) for i in range(8)]
    series.append(quiet_activation("head", 9, seed=60))
    series.append(root_gradient(seed=61))
    series.append(stepped_gradient("block7", 3.0, seed=62))
    found = run_rules(series)
    drift = notable(found["activation_scale_drift"])
    assert len(drift) == 1
    event = drift[0]
    assert event.model_wide == 8 / 9
    assert event.model_wide_modules == (8, 9)
    assert len(event.echoes) == 7
    assert event.series.module == "block0"  # first in forward order, values shown
    # The gradient step at the same samples is a member, not a finding of its own.
    gradient = next(c for c in found["gradient_scale_change"] if c.series.module == "block7")
    assert not gradient.notable
    assert gradient.evidence["part_of_model_wide_event"] == {"onset_sample": STEP_AT}
    # One module out of nine is a module finding, not model-wide.
    quiet = [quiet_activation(f"block{i}", i, seed=50 + i) for i in range(1, 9)]
    alone = run_rules([stepped_activation("block0", 0, 3.0, seed=50), *quiet])
    assert [c.model_wide for c in notable(alone["activation_scale_drift"])] == [None]


def test_zero_fraction_counts_in_both_directions():
    """An activation that stops rectifying loses its zeros: a step down is notable."""
    rng = random.Random(70)
    falling = new_series("act", 1)
    for sample in range(SAMPLES):
        level = 0.0 if sample >= STEP_AT else 0.5
        falling.update(CONFIG, sample, {"zero_fraction": max(0.0, level + rng.gauss(0, 0.002))})
    found = notable(run_rules([falling])["zero_fraction_growth"])
    assert names(found) == ["act"]
    assert found[0].direction == -1 and found[0].onset == STEP_AT
    assert found[0].score == pytest.approx(0.5, abs=0.01)
    assert "fell abruptly from sample 40" in RULES["zero_fraction_growth"].interpretation(found[0])


def test_an_early_change_never_heads_its_category():
    """A change while the reference is young (fewer than 1.5 warm-ups of values) is
    listed after a later one."""
    early = stepped_activation("a_early", 1, 4.0, seed=80, step_at=26)
    late = stepped_activation("z_late", 2, 4.0, seed=81, step_at=50)
    drift = notable(run_rules([early, late])["activation_scale_drift"])
    assert names(drift) == ["z_late", "a_early"]
    assert [is_early(c) for c in drift] == [False, True]


def test_a_scale_series_between_zero_and_huge_values_is_judged_without_overflow():
    # Exact zeros (the log floor, -69) and values near the float maximum (+690) make the
    # trend's slope extrapolate far past anything representable; the rules still run and
    # report finite or saturated numbers instead of raising OverflowError.
    series = new_series("dead.or.exploding", 0)
    for sample in range(SAMPLES):
        value = 0.0 if sample % 3 else 1e300
        series.update(CONFIG, sample, {"rms": value, "max_abs": value})
    ranked = run_rules([series])
    assert set(ranked) == set(CATEGORIES)
    tracker = series.trackers["rms"]
    assert tracker.level(1000.0) == sys.float_info.max
    assert tracker.level(math.log(1e-30)) == 0.0


def test_a_change_that_began_later_is_not_the_origin_however_early_its_module():
    # The downstream module steps 8x at sample 40; an upstream one steps 2.5x three
    # samples later (an update the optimizer made after the fault). Both are large in
    # their own noise and one group, but the later change is a consequence.
    downstream = stepped_activation("later_in_forward", 5, 8.0, seed=1, step_at=40)
    upstream = stepped_activation("earlier_in_forward", 0, 2.5, seed=2, step_at=43)
    ranked = run_rules([upstream, downstream])
    first = ranked["activation_scale_drift"][0]
    assert first.notable and first.series.module == "later_in_forward"
    assert first.onset == 40
    assert [e.series.module for e in first.echoes] == ["earlier_in_forward"]


@pytest.mark.parametrize(
    ("moved_before", "origin"), [(False, "later_in_forward"), (True, "earlier_in_forward")]
)
def test_a_step_one_sample_later_is_the_origin_only_if_it_had_moved_already(
    moved_before: bool, origin: str
) -> None:
    """The downstream module steps 8x at sample 40, the upstream one 3x at sample 41
    (within the one sample of slack). Where the upstream series held at sample 40 (a
    Linear before a weight scaled between samples, stepping at the next sample through
    the larger gradients of its update), the downstream step is the origin; where it had
    already moved 1.05x at sample 40 (about 5 spreads of its 1% noise, under a quarter
    of the step that follows, so its change is dated at sample 41), the upstream module
    is."""
    downstream = stepped_activation("later_in_forward", 5, 8.0, seed=1, step_at=40)
    rng = random.Random(2)
    upstream = new_series("earlier_in_forward", 0)
    for sample in range(SAMPLES):
        level = 3.0 if sample >= 41 else (1.05 if sample == 40 and moved_before else 1.0)
        upstream.update(CONFIG, sample, {"rms": noisy(rng, level)})
    first = run_rules([upstream, downstream])["activation_scale_drift"][0]
    assert first.notable and first.series.module == origin
    assert {first.onset, *(e.onset for e in first.echoes)} == {40, 41}
    others = {"later_in_forward", "earlier_in_forward"} - {origin}
    assert [e.series.module for e in first.echoes] == sorted(others)
    held = first if origin == "earlier_in_forward" else first.echoes[0]
    departure = held.judged.departure_at(40)
    assert departure is not None
    assert (abs(departure.z) >= UPSTREAM_DEPARTURE_SPREADS) == moved_before


def _drifting_activation(module: str, position: int, seed: int, rate_of) -> TensorSeries:
    """Activation RMS ``exp(rate_of(sample))`` with 1% noise."""
    rng = random.Random(seed)
    series = new_series(module, position)
    for sample in range(SAMPLES):
        series.update(CONFIG, sample, {"rms": noisy(rng, math.exp(rate_of(sample)))})
    return series


def test_a_series_that_leaves_a_settled_course_is_a_notable_break_of_trend():
    """Flat for 36 samples, then growing 4% a sample (never a step between two samples):
    the module heads activation_scale_drift with a change of kind "trend", dated at the
    bend or just after it, never before; its neighbours stay quiet."""
    series = [
        quiet_activation("z_first", 0, seed=1),
        _drifting_activation("m_grows", 1, seed=2, rate_of=lambda s: 0.04 * max(0, s - 36)),
        quiet_activation("a_last", 2, seed=3),
    ]
    head = run_rules(series)["activation_scale_drift"][0]
    assert head.series.module == "m_grows" and head.notable
    assert head.change is not None and head.change.kind == "trend"
    assert head.change.step_z > 6 and head.change.slope_change_t > 6
    assert head.onset is not None and 36 <= head.onset <= 40
    evidence = head.evidence["first_notable_step"]
    assert isinstance(evidence, dict) and evidence["change_kind"] == "trend"
    text = RULES["activation_scale_drift"].interpretation(head)
    assert text.startswith("m_grows (call 0, output) activation.rms began to rise from sample")
    assert not any(c.notable for c in run_rules(series)["activation_scale_drift"][1:])


@pytest.mark.parametrize(
    "rate_of",
    [
        # Early training that settles: x5 over the first samples, then flat.
        lambda s: 1.6 * (1.0 - math.exp(-s / 12.0)),
        # Steady drift from the first sample: x11 over the run, no change of course.
        lambda s: 0.04 * s,
    ],
    ids=["settles", "steady"],
)
def test_settling_or_steady_drift_is_not_a_break_of_trend(rate_of):
    series = [_drifting_activation("m", 0, seed=5, rate_of=rate_of)]
    assert not any(c.notable for c in run_rules(series)["activation_scale_drift"])


@pytest.mark.parametrize(("drop", "notable_step"), [(0.4, False), (0.55, True)])
def test_a_steep_series_that_falls_back_is_judged_from_its_last_value(drop, notable_step):
    """A series rising 15% a sample (ln units) falls by ``drop`` below its course at
    sample 40 and rises on from there. Against the forecast that carried the slope
    across the gap it fell 0.38 (1.46x, 19 spreads); against its last value it fell
    0.23 (1.25x, under the least factor 1.3x) or 0.38 (1.46x)."""
    series = [_drifting_activation("m", 0, seed=5, rate_of=lambda s: 0.15 * s - drop * (s >= 40))]
    (candidate,) = run_rules(series)["activation_scale_drift"]
    assert candidate.change is not None and candidate.change.start_sample == STEP_AT
    assert candidate.change.step_z < -18  # from the forecast, notable either way
    assert candidate.notable is notable_step
    assert candidate.onset == (STEP_AT if notable_step else None)


def test_breaks_of_trend_spread_over_many_samples_are_one_model_wide_event():
    """A learning rate raised at sample 30 bends every block's course, each at its own
    sample (corners from 30 to 38): one model-wide event, no module finding."""
    bends = [30, 36, 32, 38, 34, 31, 37, 33]
    series = [
        _drifting_activation(
            f"block{i}", i, seed=70 + i, rate_of=lambda s, b=bend: 0.06 * max(0, s - b)
        )
        for i, bend in enumerate(bends)
    ]
    found = run_rules(series)
    drift = notable(found["activation_scale_drift"])
    assert [(c.model_wide, c.change.kind if c.change else None) for c in drift] == [(1.0, "trend")]
    assert len(drift[0].echoes) == len(bends) - 1
    # One module that bends while the others hold their course is a module finding.
    alone = [
        _drifting_activation("block0", 0, seed=70, rate_of=lambda s: 0.06 * max(0, s - 30)),
        *(quiet_activation(f"block{i}", i, seed=70 + i) for i in range(1, 8)),
    ]
    drift = notable(run_rules(alone)["activation_scale_drift"])
    assert [(c.series.module, c.model_wide) for c in drift] == [("block0", None)]


def test_a_step_that_the_next_sample_partly_undoes_is_dated_at_the_step():
    """Activation RMS 1.0, then 0.14 at sample 30 (a weight scaled down 7x) and 0.57 from
    sample 31 on (the optimizer and the normalization after it take back part of it).
    The step's spread after holds the rebound, and at sample 30 the reference is young
    (a notable step needs twice the spreads): the change began at sample 30, down, not
    at the rebound."""
    rng = random.Random(9)
    step_at = 30
    series = new_series("m", 0)
    for sample in range(SAMPLES):
        level = 1.0 if sample < step_at else 0.14 if sample == step_at else 0.57
        series.update(CONFIG, sample, {"rms": noisy(rng, level)})
    (candidate,) = run_rules([series])["activation_scale_drift"]
    assert candidate.notable and candidate.onset == step_at
    assert candidate.change is not None and candidate.change.step < math.log(0.2)


def noisy_gradient(module: str, factor: float, seed: int) -> TensorSeries:
    """Output-gradient RMS whose ratio to the loss gradient scatters 1.8x (0.6 in log)
    from sample to sample and is multiplied by ``factor`` from ``STEP_AT`` on."""
    rng = random.Random(seed)
    series = new_series(module, -1, GRAD_OUTPUT)
    for sample in range(SAMPLES):
        ratio = math.exp(rng.gauss(0.0, 0.6)) * (factor if sample >= STEP_AT else 1.0)
        root = 1e-3 * 0.99**sample
        series.update(CONFIG, sample, {"rms": ratio * root, RMS_TO_ROOT: ratio})
    return series


def noisy_gradient_run(factor: float) -> list[TensorSeries]:
    return [
        quiet_activation("a_first", 1, seed=31),
        quiet_activation("b_second", 2, seed=32),
        root_gradient(seed=30),
        noisy_gradient("a_first", factor, seed=41),
        noisy_gradient("b_second", 1.0, seed=42),
    ]


def test_a_large_shift_in_a_noisy_series_is_notable_where_it_began():
    # A 30x step is about four of the series' own spreads: the trend follows it within
    # two samples and no CUSUM step is notable; the level after it held, which the
    # windows tell.
    found = run_rules(noisy_gradient_run(30.0))
    change = notable(found["gradient_scale_change"])
    assert names(change) == ["a_first"]
    shift = change[0].change
    assert shift is not None and shift.kind == "sustained_shift"
    assert change[0].onset == STEP_AT
    assert abs(shift.step_z) >= 6.0
    assert math.exp(shift.step) >= 4.0
    text = RULES["gradient_scale_change"].interpretation(change[0])
    assert f"moved up (net of the loss gradient) from sample {STEP_AT}" in text, text
    assert "and stayed there through sample" in text, text
    assert "standard errors" in text, text


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_noise_or_a_modest_shift_in_a_noisy_series_is_not_notable(factor):
    # 3x is below SHIFT_FACTOR_NOTABLE: shifts between windows of ordinary training
    # reach 2.2x in the real-model benchmark's clean runs.
    found = run_rules(noisy_gradient_run(factor))
    assert notable(found["gradient_scale_change"]) == []
    assert notable(found["regime_change"]) == []


def zero_fraction_gradient(module: str, before: float, noise: float, seed: int) -> TensorSeries:
    """Output-gradient zero fraction around ``before`` that becomes exactly 1 (a gradient
    cut to zero) from ``STEP_AT`` on."""
    rng = random.Random(seed)
    series = new_series(module, -1, GRAD_OUTPUT)
    for sample in range(SAMPLES):
        noisy_value = min(1.0, max(0.0, before + rng.gauss(0.0, noise)))
        value = 1.0 if sample >= STEP_AT else noisy_value
        series.update(CONFIG, sample, {"zero_fraction": value})
    return series


def test_the_origin_share_is_measured_in_the_metric_not_in_each_series_spreads():
    """A gradient cut to zero at a normalization whose output gradient was half zeros
    (behind a ReLU) also zeroes the dense gradient of the convolution before it. The
    convolution's zero fraction, exactly 0 until then, steps by hundreds of its floor's
    spreads, the normalization's by about 13 of its own; in the metric both moved a lot
    (0.5 and 1.0), so the change begins at the normalization, first in propagation order
    for gradients."""
    series = [
        quiet_activation("conv", 1, seed=81),
        quiet_activation("norm", 2, seed=82),
        root_gradient(seed=80),
        zero_fraction_gradient("conv", 0.0, 0.0, seed=83),
        zero_fraction_gradient("norm", 0.5, 0.03, seed=84),
    ]
    found = notable(run_rules(series)["zero_fraction_growth"])
    assert names(found) == ["norm"]
    origin = found[0]
    assert origin.onset == STEP_AT
    assert echo_names(origin) == ["conv"]
    echo = origin.echoes[0]
    assert echo.change is not None and origin.change is not None
    # In spreads the echo is far larger: the old rule named it.
    assert abs(echo.change.step_z) * ORIGIN_SHARE > abs(origin.change.step_z)


def test_a_series_that_falls_back_across_a_longer_gap_is_no_regime_change():
    # 20% a sample every 16 forwards, then samples 64 forwards apart (as the default
    # schedule doubles its interval), where the series falls back by 1.25x (to about
    # where it was a sample before) and stays: the trend carried its slope across the
    # longer gap, so against its forecast the fall is 1.52x and 21 spreads (past the
    # drift tolerance); measured from the last value it is 1.28x, below both rules'
    # least step.
    rng = random.Random(7)
    series = new_series("a_first", 1)
    level = 1.0
    for sample in range(SAMPLES):
        if sample < STEP_AT:
            level *= 1.2
            forward = 16 * sample
        else:
            forward = 16 * STEP_AT + 64 * (sample - STEP_AT)
        if sample == STEP_AT:
            level /= 1.25
        series.update(CONFIG, sample, {"rms": noisy(rng, level)}, forward)
    found = run_rules([series])
    regime = found["regime_change"]
    assert regime and regime[0].change is not None
    change = regime[0].change
    assert change.start_sample == STEP_AT
    assert math.exp(-change.step) >= 1.5 and -change.step_z >= 8.0
    assert math.exp(-change.step_without_trend) < 1.3
    assert notable(regime) == []
    assert notable(found["activation_scale_drift"]) == []


def test_a_model_wide_event_counts_the_modules_that_moved_not_only_its_members():
    """Most modules moving at once by less than a finding's step, one of them by a
    notable step: the event says how many moved (a departure of 3 residual spreads or
    more at the onset) out of how many observed, and how many of those are notable on
    their own."""
    series = [stepped_activation("block0", 0, 3.0, seed=80)]
    series += [stepped_activation(f"block{i}", i, 1.1, seed=80 + i) for i in range(1, 6)]
    series += [quiet_activation(f"block{i}", i, seed=80 + i) for i in range(6, 9)]
    drift = notable(run_rules(series)["activation_scale_drift"])
    assert names(drift) == ["block0"]
    event = drift[0]

    def departure(single: TensorSeries) -> float:
        alone = next(iter(run_rules([single])["activation_scale_drift"]))
        found = alone.judged.departure_at(STEP_AT)
        return 0.0 if found is None else abs(found.z)

    moved = [s.module for s in series if departure(s) >= 3.0]
    assert moved == [f"block{i}" for i in range(6)]
    assert event.model_wide_modules == (6, 9)
    assert event.model_wide == 6 / 9
    interpretation, _ = model_wide_texts(event, None)
    assert interpretation.startswith(
        f"Model-wide: 6 of the 9 observed modules besides the root (66.67%) moved their "
        f"activation.rms at "
        f"about sample {STEP_AT}, 1 of them notably; the first of those in propagation "
        "order is block0 ("
    )


def test_a_change_just_before_a_module_stops_being_called_is_not_notable():
    """A series that ends (its module stopped being called) 3 samples after a step: the
    step rests on those samples alone, and the stop is what the report names."""
    rng = random.Random(90)
    ending = new_series("block0", 0)
    for sample in range(STEP_AT + 4):
        level = 3.0 if sample >= STEP_AT else 1.0
        ending.update(CONFIG, sample, {"rms": noisy(rng, level)})
    assert names(notable(run_rules([ending])["activation_scale_drift"])) == ["block0"]
    found = run_rules([ending], stopped={("block0", 0): STEP_AT + 3})["activation_scale_drift"]
    assert notable(found) == []
    assert found[0].evidence["series_ended"] == {"last_sample": STEP_AT + 3}
    # Five samples or more after the onset, the step stands.
    later = run_rules([ending], stopped={("block0", 0): STEP_AT + 5})["activation_scale_drift"]
    assert names(notable(later)) == ["block0"]
