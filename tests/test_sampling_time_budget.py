"""TimeBudgetSampling: samples while measured telemetry cost stays under its budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchinstruments.sampling as sampling_module
from tests.harness import ResidualNet, make_batches, read_report, train
from torchinstruments import ConfigError, TimeBudgetSampling, inject_observer, remove_observer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_budget_decisions_follow_the_measured_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(sampling_module.time, "perf_counter", clock)
    policy = TimeBudgetSampling(0.1, dense_forwards=2, max_interval_forwards=5)
    assert policy.should_sample(0) and policy.should_sample(1)  # dense start
    policy.note_cost(1.0)  # 1 s of telemetry after 0 s of wall time: over budget
    clock.now += 5.0  # 1.0 > 0.1 * 5.0
    assert not policy.should_sample(2)
    clock.now += 5.0  # 1.0 <= 0.1 * 10.0
    assert policy.should_sample(3)
    policy.note_cost(10.0)
    decisions = [policy.should_sample(i) for i in range(4, 10)]
    # Over budget, so only the interval bound samples: 5 forwards after forward 3.
    assert decisions == [False, False, False, False, True, False]
    assert policy.describe()["telemetry_seconds"] == 11.0


def test_bad_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"TimeBudgetSampling\.max_fraction must be"):
        TimeBudgetSampling(0.0)
    with pytest.raises(ConfigError, match=r"TimeBudgetSampling\.max_interval_forwards"):
        TimeBudgetSampling(0.1, max_interval_forwards=0)


def test_observer_reports_its_cost_to_the_policy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    policy = TimeBudgetSampling(0.5, dense_forwards=5)
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=policy)
    train(model, make_batches(20))
    remove_observer(model)
    report = read_report(tmp_path)
    assert policy.cost_s > 0
    assert report["run"]["telemetry_seconds"] > 0
    assert report["config"]["sampling"]["policy"] == "time_budget"
    assert report["coverage"]["samples_observed"] >= 5
