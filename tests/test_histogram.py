"""Fixed-edge histograms: exact counts, exact merge, reporting and TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from tests.harness import ResidualNet, make_batches, read_report, train
from torchinstruments import (
    ConfigError,
    DirectorySink,
    TensorBoardSink,
    histogram,
    inject_observer,
    remove_observer,
)
from torchinstruments.histogram import Histogram, histogram_counts


def numpy_counts(values: np.ndarray, bins: int, low: float, high: float) -> list[float]:
    finite = values[np.isfinite(values)]
    inside, _ = np.histogram(
        finite[(finite >= low) & (finite <= high)], bins=bins, range=(low, high)
    )
    return [
        *inside.astype(float).tolist(),
        float((finite < low).sum()),
        float((finite > high).sum()),
        float((~np.isfinite(values)).sum()),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_counts_match_numpy_including_out_of_range_and_non_finite(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(4_000, generator=generator) * 3).to(dtype)
    x[:5] = float("nan")
    x[5:8] = float("inf")
    x[8] = float("-inf")
    spec = histogram(bins=16, value_range=(-4.0, 4.0))
    counts = histogram_counts(x, spec).tolist()
    expected = numpy_counts(x.double().numpy(), 16, -4.0, 4.0)
    assert counts == expected
    assert sum(counts) == 4_000


def test_hand_computed_counts() -> None:
    spec = histogram(bins=4, value_range=(-1.0, 1.0))
    x = torch.tensor([-2.0, -1.0, -0.25, 0.0, 0.5, 1.0, 3.0, float("nan")])
    # bins [-1,-0.5) [-0.5,0) [0,0.5) [0.5,1]: -1 | -0.25 | 0 | 0.5, 1 ; under -2 ; over 3 ; nan
    assert histogram_counts(x, spec).tolist() == [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0]


def test_merge_of_two_equals_one_built_over_both_inputs() -> None:
    spec = histogram(bins=10, value_range=(-2.0, 2.0))
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(500, generator=generator), torch.randn(700, generator=generator) * 2
    first, second, both = Histogram(spec), Histogram(spec), Histogram(spec)
    first.add(0, histogram_counts(a, spec).tolist())
    second.add(1, histogram_counts(b, spec).tolist())
    both.add(0, histogram_counts(torch.cat([a, b]), spec).tolist())
    first.merge(second)
    assert first.counts == both.counts
    assert first.samples == 2


def test_merge_refuses_other_edges() -> None:
    first = Histogram(histogram(bins=4))
    with pytest.raises(ValueError, match="edges differ"):
        first.merge(Histogram(histogram(bins=8)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bins": 0}, r"histogram\.bins must be an int >= 1, got 0"),
        ({"value_range": (1.0, 1.0)}, r"value_range must have low < high"),
        ({"value_range": (0.0,)}, r"value_range must be a \(low, high\) pair"),
        ({"every_n_samples": 0}, r"every_n_samples must be an int >= 1"),
        ({"signals": ("weights",)}, r"signals must be a non-empty selection"),
    ],
)
def test_bad_histogram_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        histogram(**kwargs)  # type: ignore[arg-type]


def test_inject_refuses_non_specs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="each histograms entry must come from histogram"):
        inject_observer(ResidualNet(), output_dir=tmp_path, histograms=[(-1, 1)])  # type: ignore[list-item]


def test_observed_histograms_reach_report_details_and_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    model = ResidualNet()
    spec = histogram(bins=8, value_range=(-3.0, 3.0), every_n_samples=2, include="fc")
    inject_observer(
        model,
        output_dir=tmp_path / "stats",
        sampling=1,
        histograms=[spec],
        sinks=[DirectorySink(tmp_path / "stats", write_full_details=True), TensorBoardSink(writer)],
    )
    train(model, make_batches(6))
    remove_observer(model)
    writer.close()
    report = read_report(tmp_path / "stats")
    assert report["coverage"]["histograms"] == 1  # fc activation only
    summary = report["coverage"]["histogram_summary"][0]
    assert (summary["module"], summary["samples"], summary["elements"]) == ("fc", 3, 3 * 16 * 16)
    details = json.loads((tmp_path / "stats" / "details.json").read_text(encoding="utf-8"))
    assert details["histograms"][0]["edges"] == spec.edges
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    events.Reload()
    tag = "torchinstruments/fc/activation/histogram"
    tags = events.Tags()["histograms"]
    assert isinstance(tags, list) and tag in tags
    assert [event.step for event in events.Histograms(tag)] == [0, 2, 4]
