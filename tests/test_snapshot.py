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


def test_a_snapshot_built_without_an_observer_gives_a_report() -> None:
    from torchinstruments.config import ReportConfig, TrackConfig
    from torchinstruments.distributed import RankInfo
    from torchinstruments.sampling import SampleForwards
    from torchinstruments.track import SeriesTracker

    track = TrackConfig()
    snapshot = RunSnapshot(
        names=("", "0"),
        series={},
        histograms={},
        loss_scale=SeriesTracker(track, log_scale=True, noise_floor=0.02),
        sample_forwards=SampleForwards(),
        counters=Counters(forwards_seen=7, eval_forwards_skipped=2, errors_total=1),
        sentinel_events=(),
        errors=(),
        skipped_tensors={"integer": 3},
        modules_called=frozenset(),
        parents_adopted={},
        modules_replaced=(),
        module_kinds={"0": "Linear"},
        unhooked_compile_wrappers=(),
        root_traces_unobserved_since_injection=0,
        root_forward_seen=True,
        report_config=ReportConfig(),
        track_config=track,
        sampling={"policy": "every_n", "interval_forwards": 1},
        capture_direct_forwards=False,
        full_sentinel=False,
        hook_parking="on",
        rank_info=RankInfo(),
        options={"rank_policy": "rank0"},
        started_at=0.0,
        telemetry_seconds=0.5,
        forked_from_pid=None,
        forwards_at_fork=0,
    )
    report = build_report(snapshot)
    coverage = report["coverage"]
    assert (coverage["forwards_seen"], coverage["samples_observed"]) == (7, 0)
    assert (coverage["eval_forwards_skipped"], coverage["errors_total"]) == (2, 1)
    assert coverage["tensors_skipped"] == {"integer": 3}
    assert coverage["modules_selected"] == 2
    assert report["config"]["sampling"] == {"policy": "every_n", "interval_forwards": 1}
    assert report["run"]["forwards_seen"] == 7
    assert report["run"]["telemetry_seconds"] == 0.5
    assert report["run"]["hook_parking"] == "on"
    assert report["findings"] == []
