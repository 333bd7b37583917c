"""Real multi-process groups for the tests: forked gloo ranks on the loopback interface,
joined through a ``file://`` store, each returning one JSON-able result.

``torch._dynamo`` is imported here before any fork, so DDP's constructor does not import
it in every child. A rank that hangs fails the test after :data:`GROUP_TIMEOUT_S`.
"""

from __future__ import annotations

import json
import os
import time
import traceback
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # imported once here, then inherited by the forked ranks
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.harness import MLP

#: Seconds a whole process group may take before the test fails as hung.
GROUP_TIMEOUT_S = 45.0
#: Gloo's own timeout inside the ranks, so a rank waiting for a dead peer gives up.
GLOO_TIMEOUT_S = 30.0
#: Training steps of :func:`rank_batches`.
STEPS = 10

Worker = Callable[..., dict[str, Any]]


def _rank_entry(
    rank: int, worker: Worker, world: int, init_file: str, result_dir: str, args: tuple[Any, ...]
) -> None:
    """Runs in each forked rank: join the group, run ``worker``, write its result."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # forked children must not reuse the parent's OpenMP pool
    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=GLOO_TIMEOUT_S),
        )
        try:
            result = worker(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except Exception:
        result = {"error": traceback.format_exc(limit=6)}
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w", encoding="utf-8") as stream:
        json.dump(result, stream)


@contextmanager
def _gloo_on_loopback() -> Generator[None]:
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = previous or "lo"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["GLOO_SOCKET_IFNAME"]


def run_ranks(
    worker: Worker,
    world: int,
    work: Path,
    *args: Any,
    timeout_s: float = GROUP_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Run ``worker(rank, world, *args)`` in ``world`` forked gloo ranks; return results.

    Fails the calling test when a rank hangs past ``timeout_s``, exits without a result
    or raised (the rank's traceback is shown).
    """
    result_dir = work / "results"
    result_dir.mkdir(parents=True)
    init_file = work / "init"
    with _gloo_on_loopback():
        context = mp.start_processes(
            _rank_entry,
            args=(worker, world, str(init_file), str(result_dir), args),
            nprocs=world,
            join=False,
            start_method="fork",
        )
        assert context is not None  # join=False returns the context
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=0.25):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the {world} ranks did not finish within {timeout_s} s (hung)")
    results = []
    for rank in range(world):
        path = result_dir / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} exited without writing a result"
        result = json.loads(path.read_text(encoding="utf-8"))
        assert "error" not in result, f"rank {rank} raised:\n{result['error']}"
        results.append(result)
    return results


def rank_batches(rank: int, scale: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s :data:`STEPS` batches (seed ``100 + rank``): ``x`` of shape
    ``(16, 6)`` times ``scale``, ``y`` of shape ``(16, 1)``."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (scale * torch.randn(16, 6, generator=generator), torch.randn(16, 1, generator=generator))
        for _ in range(STEPS)
    ]


def seeded_net() -> MLP:
    """The :class:`~tests.harness.MLP` every rank builds after ``torch.manual_seed(1)``."""
    torch.manual_seed(1)
    return MLP()
