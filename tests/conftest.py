"""Shared fixtures, built on the harness in ``tests/harness`` (models, data, training
loops, readers): import those from there, not from here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.harness import make_batches, older_objects_frozen


@pytest.fixture
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """30 batches of :func:`tests.harness.make_batches` (seed 0)."""
    return make_batches(30)


@pytest.fixture
def fresh_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's compile counters at zero for the test: where compiled code does not
    guard on hooks, hook parking (and what builds on it) stops for good once anything
    was compiled in the process, as other tests do; where it does, a compilation during
    a parked forward still changes what the observer does next."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    monkeypatch.setitem(torch._dynamo.utils.counters["frames"], "total", 0)
    monkeypatch.setitem(torch._dynamo.utils.counters["stats"], "unique_graphs", 0)


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """For leak tests that count live objects: every object alive before the test is
    left out of the collector's passes and of the count
    (:func:`tests.harness.older_objects_frozen`)."""
    with older_objects_frozen():
        yield
