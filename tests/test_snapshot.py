"""The report is built from a frozen snapshot of the observer, whose counters carry the
report's coverage keys; report.py reads nothing of the Observer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.code_shape import import_graphs
from torchinstruments import inject_observer, remove_observer
from torchinstruments._snapshot import Counters, RunSnapshot
from torchinstruments.report import build_report


def test_report_module_imports_nothing_of_the_observer() -> None:
    _, run_time = import_graphs()
    assert "torchinstruments.observer" not in run_time["torchinstruments.report"]
    assert "torchinstruments.api" not in run_time["torchinstruments.report"]


def test_counters_are_the_coverage_keys_with_the_same_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    handle = inject_observer(model, output_dir=tmp_path, sampling=2)
    for _ in range(5):
        model(torch.randn(3, 4)).sum().backward()
    with torch.no_grad():
        model(torch.randn(3, 4))  # an eval forward: skipped and counted
    observer = handle._observer
    assert observer is not None
    observer.flush_statistics()
    snapshot = observer.snapshot()
    assert isinstance(snapshot, RunSnapshot)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.names = ()  # type: ignore[misc]
    counters = dataclasses.asdict(snapshot.counters)
    assert counters["forwards_seen"] == 5
    assert counters["samples_observed"] == 3  # forwards 0, 2 and 4
    assert counters["backward_samples_observed"] == 3
    assert counters["eval_forwards_skipped"] == 1
    coverage = build_report(snapshot)["coverage"]
    assert {name: coverage[name] for name in counters} == counters
    assert [f.name for f in dataclasses.fields(Counters)] == list(counters)
    remove_observer(model)
