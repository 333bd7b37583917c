"""Shared fixtures: small seeded models and a training loop."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn


class ResidualNet(nn.Module):
    """Linear -> (LayerNorm, Linear, in-place ReLU) residual block -> head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.act(self.fc(self.norm(h)))
        return self.head(h)


def make_batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator))
        for _ in range(count)
    ]


def train(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 0.05,
    on_step: Callable[[int], None] | None = None,
) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step, (x, y) in enumerate(batches):
        if on_step is not None:
            on_step(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def read_report(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "report.json").read_text(encoding="utf-8"))


@pytest.fixture
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches(30)


@pytest.fixture
def fresh_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's compile counters at zero for the test: hook parking (and what builds on
    it) stops for good once anything was compiled in the process, as other tests do."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    monkeypatch.setitem(torch._dynamo.utils.counters["frames"], "total", 0)
    monkeypatch.setitem(torch._dynamo.utils.counters["stats"], "unique_graphs", 0)


def read_series(directory: Path) -> list[dict[str, Any]]:
    """The rows of ``series.json`` (every series, unlike the report's few compact rows),
    each with ``observations``, ``history`` (its points) and ``first`` / ``latest``
    (its first and last points) added, for tests that read per-series values."""
    data = json.loads((directory / "series.json").read_text(encoding="utf-8"))
    rows = []
    for row in data["series"]:
        points = row["points"]
        rows.append(
            {
                **row,
                "observations": row["count"],
                "history": points,
                "first": {"sample": points[0][0], "value": points[0][1]},
                "latest": {"sample": points[-1][0], "value": points[-1][1]},
            }
        )
    return rows


def event_of(report: dict[str, Any], finding: dict[str, Any]) -> dict[str, Any]:
    """The event a notable finding of ``report`` refers to."""
    return next(e for e in report["events"] if e["id"] == finding["event"])
