"""Records carry their kind as their class: statistics, histogram counts (with the real
signal and the spec number), sentinel sums (with the forward and the next sample) and
loss scales; nothing is told apart by a string."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torchinstruments import histogram, inject_observer, remove_observer
from torchinstruments._records import (
    HistogramCounts,
    LossScale,
    SentinelSum,
    Statistics,
    sample_order,
)


def test_pending_records_are_typed_by_kind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    handle = inject_observer(
        model,
        output_dir=tmp_path,
        sampling=2,
        full_sentinel=True,
        histograms=[
            histogram(8, every_n_samples=1, signals=("activation", "grad_output"), include="0")
        ],
    )
    observer = handle._observer
    assert observer is not None
    buffer = observer.buffer
    buffer.device_path_types = frozenset({"cpu"})  # sentinel sums wait for the flush
    model(torch.randn(2, 4)).sum().backward()  # forward 0: sample 0
    model(torch.randn(2, 4)).sum().backward()  # forward 1: not sampled, full sentinel
    pending = list(buffer.pending)
    histograms = [r for r in pending if type(r) is HistogramCounts]
    assert sorted((r.key, r.sample, r.spec) for r in histograms) == [
        ((1, 0, "activation", "output"), 0, 0),
        ((1, 0, "grad_output", "output"), 0, 0),
    ]
    sentinels = [r for r in pending if type(r) is SentinelSum]
    assert [(r.key, r.forward, r.next_sample) for r in sentinels] == [
        ((1, 0, "activation", "output"), 1, 1),
        ((2, 0, "activation", "output"), 1, 1),
        ((0, 0, "activation", "output"), 1, 1),
    ]
    assert all(type(r) in (HistogramCounts, SentinelSum, Statistics) for r in pending)
    remove_observer(model)


def test_sample_order_puts_rows_without_a_series_first() -> None:
    key = (1, 0, "activation", "output")
    records = [
        Statistics(key, 3, 0, [0.0]),
        SentinelSum(key, 9, 4, [0.0]),
        HistogramCounts(key, 1, 0, [0.0]),
        LossScale(2, [1.0]),
        Statistics(key, 0, 0, [0.0]),
    ]
    ordered = sorted(records, key=sample_order)
    assert [type(r).__name__ for r in ordered] == [
        "SentinelSum",
        "LossScale",
        "Statistics",
        "HistogramCounts",
        "Statistics",
    ]
    assert [r[1] for r in ordered[2:]] == [0, 1, 3]
