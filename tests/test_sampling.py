"""Sampling policies: exact sampled indices, descriptions and argument errors."""

from __future__ import annotations

import itertools
import re

import pytest

from torchinstruments.errors import ConfigError
from torchinstruments.sampling import (
    DefaultSampling,
    EveryNSampling,
    SamplingPolicy,
    TimeBudgetSampling,
    policy_from_description,
    resolve_sampling,
)


def sampled(policy, n: int) -> list[int]:
    return [i for i in range(n) if policy.should_sample(i)]


# ---------------------------------------------------------------- EveryNSampling


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (1, list(range(10))),
        (3, [0, 3, 6, 9]),
        (4, [0, 4, 8]),
        (10, [0]),
        (11, [0]),
    ],
)
def test_every_n_indices(n, expected):
    assert sampled(EveryNSampling(n), 10) == expected


def test_every_n_describe_and_repr():
    policy = EveryNSampling(7)
    assert policy.n == 7
    assert policy.describe() == {"policy": "every_n", "interval_forwards": 7}
    assert repr(policy) == "EveryNSampling(7)"
    assert isinstance(policy, SamplingPolicy)


@pytest.mark.parametrize("bad", [0, -1, True, False, 2.0, "3", None])
def test_every_n_rejects(bad):
    message = f"EveryNSampling.n must be an int >= 1, got {bad!r}"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        EveryNSampling(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- DefaultSampling


def test_default_small_schedule():
    policy = DefaultSampling(samples_per_stage=2, max_interval_forwards=4)
    # Stages: from 0 every 1 (0, 1), from 2 every 2 (2, 4), from 6 every 4 (6, 10, ...).
    assert sampled(policy, 16) == [0, 1, 2, 4, 6, 10, 14]
    assert sampled(policy, 40) == [0, 1, 2, 4, 6, 10, 14, 18, 22, 26, 30, 34, 38]


def test_default_cap_not_a_power_of_two():
    policy = DefaultSampling(samples_per_stage=3, max_interval_forwards=3)
    # from 0 every 1 (3 samples), from 3 every 2 (3 samples), from 9 every 3.
    assert sampled(policy, 20) == [0, 1, 2, 3, 5, 7, 9, 12, 15, 18]
    assert policy.describe()["stages"] == [
        {"from_forward": 0, "interval_forwards": 1},
        {"from_forward": 3, "interval_forwards": 2},
        {"from_forward": 9, "interval_forwards": 3},
    ]


def test_default_interval_one_samples_every_forward():
    policy = DefaultSampling(samples_per_stage=5, max_interval_forwards=1)
    assert sampled(policy, 12) == list(range(12))
    assert policy.describe()["stages"] == [{"from_forward": 0, "interval_forwards": 1}]


def test_default_schedule_with_defaults():
    policy = DefaultSampling()
    assert (policy.samples_per_stage, policy.max_interval_forwards) == (6, 256)
    indices = sampled(policy, 6000)
    # The first 6 forwards, then every 2nd, every 4th, every 8th: the 24th sample (the
    # end of warm-up) is forward 82.
    assert indices[:6] == list(range(6))
    assert indices[6:14] == [6, 8, 10, 12, 14, 16, 18, 22]
    assert indices[18:24] == [42, 50, 58, 66, 74, 82]
    # Stages start at 0, 6, 18, 42, 90, 186, 378, 762 and 1530; 6 samples each until
    # the cap.
    stage_starts = [0, 6, 18, 42, 90, 186, 378, 762, 1530]
    for start, next_start in itertools.pairwise(stage_starts):
        assert len([i for i in indices if start <= i < next_start]) == 6
    assert [i for i in indices if i >= 762][:4] == [762, 890, 1018, 1146]
    assert [i for i in indices if i >= 1530][:4] == [1530, 1786, 2042, 2298]
    assert len(indices) == 8 * 6 + len(range(1530, 6000, 256))
    assert len([i for i in indices if i < 300]) == 34
    assert len([i for i in indices if i < 1000]) == 44
    assert len([i for i in indices if 100 <= i < 200]) == 6


def test_default_interval_at():
    policy = DefaultSampling()
    expected = {0: 1, 5: 1, 6: 2, 17: 2, 18: 4, 41: 4, 42: 8, 89: 8, 90: 16}
    expected |= {185: 16, 186: 32, 377: 32, 378: 64, 761: 64, 762: 128, 1529: 128}
    expected |= {1530: 256, 10**9: 256}
    for index, interval in expected.items():
        assert policy.interval_at(index) == interval, index


def test_default_describe_and_repr():
    policy = DefaultSampling()
    assert policy.describe() == {
        "policy": "default",
        "samples_per_stage": 6,
        "max_interval_forwards": 256,
        "stages": [
            {"from_forward": 0, "interval_forwards": 1},
            {"from_forward": 6, "interval_forwards": 2},
            {"from_forward": 18, "interval_forwards": 4},
            {"from_forward": 42, "interval_forwards": 8},
            {"from_forward": 90, "interval_forwards": 16},
            {"from_forward": 186, "interval_forwards": 32},
            {"from_forward": 378, "interval_forwards": 64},
            {"from_forward": 762, "interval_forwards": 128},
            {"from_forward": 1530, "interval_forwards": 256},
        ],
    }
    assert repr(policy) == "DefaultSampling(samples_per_stage=6, max_interval_forwards=256)"
    assert isinstance(policy, SamplingPolicy)


def test_policies_are_deterministic():
    a = DefaultSampling(samples_per_stage=5, max_interval_forwards=8)
    b = DefaultSampling(samples_per_stage=5, max_interval_forwards=8)
    first = sampled(a, 500)
    assert sampled(a, 500) == first
    assert sampled(b, 500) == first
    # Order of queries does not matter: the decision is a function of the index only.
    assert [i for i in reversed(range(500)) if a.should_sample(i)] == first[::-1]
    every = EveryNSampling(6)
    assert sampled(every, 100) == sampled(EveryNSampling(6), 100)


@pytest.mark.parametrize(
    "policy",
    [
        DefaultSampling(),
        DefaultSampling(samples_per_stage=2, max_interval_forwards=4),
        DefaultSampling(samples_per_stage=3, max_interval_forwards=100),  # cap not a power
        DefaultSampling(samples_per_stage=1, max_interval_forwards=1),
        EveryNSampling(1),
        EveryNSampling(7),
    ],
    ids=repr,
)
def test_next_sampled_is_the_first_sampled_forward_at_or_after(policy) -> None:
    indices = sampled(policy, 4_000)
    for forward in range(indices[-1] + 1):
        expected = next(i for i in indices if i >= forward)
        assert policy.next_sampled(forward) == expected, forward


def test_next_sampled_of_the_default_schedule_by_hand() -> None:
    policy = DefaultSampling(samples_per_stage=2, max_interval_forwards=4)  # 0 1 2 4 6 10 14
    assert [policy.next_sampled(i) for i in range(16)] == [
        0, 1, 2, 4, 4, 6, 6, 10, 10, 10, 10, 14, 14, 14, 14, 18
    ]  # fmt: skip
    assert EveryNSampling(5).next_sampled(11) == 15


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"samples_per_stage": 0},
            "DefaultSampling.samples_per_stage must be an int >= 1, got 0",
        ),
        (
            {"samples_per_stage": 2.5},
            "DefaultSampling.samples_per_stage must be an int >= 1, got 2.5",
        ),
        (
            {"max_interval_forwards": 0},
            "DefaultSampling.max_interval_forwards must be an int >= 1, got 0",
        ),
        (
            {"max_interval_forwards": True},
            "DefaultSampling.max_interval_forwards must be an int >= 1, got True",
        ),
    ],
)
def test_default_rejects(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        DefaultSampling(**kwargs)


def test_default_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        DefaultSampling(64, 32)  # type: ignore[misc]


# ---------------------------------------------------------------- resolve_sampling


def test_resolve_none_is_default_schedule():
    policy = resolve_sampling(None)
    assert isinstance(policy, DefaultSampling)
    assert policy.describe() == DefaultSampling().describe()


@pytest.mark.parametrize("n", [1, 2, 32])
def test_resolve_int_is_every_n(n):
    policy = resolve_sampling(n)
    assert isinstance(policy, EveryNSampling)
    assert policy.describe() == {"policy": "every_n", "interval_forwards": n}


def test_resolve_one_samples_every_forward():
    assert sampled(resolve_sampling(1), 9) == list(range(9))


def test_resolve_passes_policy_objects_through():
    class Odd:
        def should_sample(self, forward_index: int) -> bool:
            return forward_index % 2 == 1

        def describe(self) -> dict[str, object]:
            return {"policy": "odd"}

    policy = Odd()
    assert resolve_sampling(policy) is policy
    every = EveryNSampling(3)
    assert resolve_sampling(every) is every


@pytest.mark.parametrize("bad", [0, -4, True, False])
def test_resolve_rejects_bad_ints(bad):
    message = (
        "inject_observer: sampling must be None, an int >= 1 (at most 2**62) or a "
        f"SamplingPolicy, got {bad!r}"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        resolve_sampling(bad)


class _OnlyShouldSample:
    def should_sample(self, forward_index: int) -> bool:
        return True


@pytest.mark.parametrize(
    ("bad", "type_name"),
    [(2.0, "float"), ("every", "str"), ([1], "list"), (_OnlyShouldSample(), "_OnlyShouldSample")],
)
def test_resolve_rejects_other_objects(bad, type_name):
    message = (
        "inject_observer: sampling must be None, an int >= 1 or an object with "
        f"should_sample(forward_index) and describe(), got {type_name} {bad!r}"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        resolve_sampling(bad)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        resolve_sampling("every")


@pytest.mark.parametrize(
    "policy",
    [
        EveryNSampling(3),
        DefaultSampling(),
        DefaultSampling(samples_per_stage=2, max_interval_forwards=5),
    ],
)
def test_policies_rebuild_from_their_description(policy: EveryNSampling | DefaultSampling) -> None:
    rebuilt = policy_from_description(policy.describe())
    assert rebuilt is not None and rebuilt.describe() == policy.describe()
    sampled = [f for f in range(2_000) if policy.should_sample(f)]
    assert [rebuilt.forward_of(k) for k in range(len(sampled))] == sampled
    assert [rebuilt.sample_at(f) for f in sampled] == list(range(len(sampled)))
    assert all(rebuilt.sample_at(f) is None for f in range(2_000) if f not in set(sampled))
    assert rebuilt.samples_in(2_000) == len(sampled)
    assert rebuilt.samples_in(0) == 0


def test_default_sampling_maps_samples_exactly() -> None:
    policy = DefaultSampling.from_description(
        DefaultSampling(samples_per_stage=2, max_interval_forwards=4).describe()
    )
    assert policy is not None
    # [0, 1, 2, 4, 6, 10, 14] as in the class's example, then every 4th.
    assert [policy.forward_of(k) for k in range(8)] == [0, 1, 2, 4, 6, 10, 14, 18]
    assert policy.sample_at(10) == 5 and policy.sample_at(12) is None
    assert policy.samples_in(15) == 7


def test_time_budget_rebuilds_with_only_its_dense_start_mapped() -> None:
    described = TimeBudgetSampling(0.05, dense_forwards=4).describe()
    policy = policy_from_description(described)
    assert isinstance(policy, TimeBudgetSampling)
    assert (policy.max_fraction, policy.dense_forwards, policy.max_interval_forwards) == (
        0.05,
        4,
        1_000,
    )
    assert [policy.forward_of(k) for k in range(6)] == [0, 1, 2, 3, None, None]
    assert policy.sample_at(3) == 3 and policy.sample_at(4) is None
    assert policy.samples_in(100) is None


@pytest.mark.parametrize(
    "description",
    [
        None,
        "every_n",
        {"policy": "custom"},
        {"policy": "every_n", "interval_forwards": 0},
        {"policy": "every_n", "interval_forwards": True},
        {"policy": "every_n", "interval_forwards": "3"},
        {"policy": "default", "samples_per_stage": 6, "max_interval_forwards": 256},
        {**DefaultSampling().describe(), "samples_per_stage": 5},  # stages of another
        {**DefaultSampling().describe(), "stages": [{"from_forward": 0}]},
        {"policy": "time_budget", "dense_forwards": 4},  # no max_fraction
        {**TimeBudgetSampling().describe(), "dense_forwards": -1},
    ],
)
def test_descriptions_no_policy_gives_rebuild_as_none(description: object) -> None:
    assert policy_from_description(description) is None
