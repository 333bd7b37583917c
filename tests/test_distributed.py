"""Distributed training on real two-process gloo groups on the CPU.

Each test forks its ranks with ``tests.harness.ranks.run_ranks`` (``torch._dynamo`` is
imported first, so DDP's constructor does not import it in every child), joins them
through a ``file://`` store and collects one JSON result per rank. A rank that hangs
fails the test after ``GROUP_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.harness import (
    MLP,
    act,
    assert_same_model,
    attach,
    finish,
    fit,
    grad,
    hook_counts,
    hook_total,
    make_batches,
    observations,
    pair,
    parameters_equal,
    read_report,
    train,
)
from tests.harness.ranks import STEPS, rank_batches, run_ranks, seeded_net
from torchinstruments import (
    ConfigError,
    inject_observer,
    remove_observer,
)
from torchinstruments.distributed import detect_rank, parse_rank_directory, rank_directory_name

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not sys.platform.startswith("linux"),
    reason="needs torch.distributed with gloo and fork (Linux)",
)

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)


@contextmanager
def count_collectives() -> Generator[dict[str, int]]:
    """Count calls of the Python collectives of ``torch.distributed`` inside the block."""
    counts: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return function(*args, **kwargs)

        return wrapper

    for name, function in originals.items():
        setattr(dist, name, counting(name, function))
    try:
        yield counts
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def module_names(report_path: Path) -> set[str]:
    report = json.loads(report_path.read_text(encoding="utf-8"))
    return {finding["module"] for finding in report["findings"]}


# ---------------------------------------------------------------------- workers
def ddp_worker(
    rank: int, world: int, out_dir: str, policy: str, inject_into: str
) -> dict[str, Any]:
    """Train an observed DDP model and an unobserved DDP twin on the same batches."""
    model, twin = seeded_net(), seeded_net()
    baseline_hooks = hook_total(model)
    info = detect_rank()
    with count_collectives() as collectives:
        if inject_into == "ddp":
            wrapped = DistributedDataParallel(model)
            handle = inject_observer(wrapped, output_dir=out_dir, sampling=1, rank_policy=policy)
        else:  # inject into the plain model, then wrap it
            handle = inject_observer(model, output_dir=out_dir, sampling=1, rank_policy=policy)
            wrapped = DistributedDataParallel(model)
        hooks = hook_total(model) - baseline_hooks
        collectives_after_ddp = dict(collectives)
        losses = train(wrapped, rank_batches(rank))
        remove_observer(wrapped)
        hooks_after_remove = hook_total(model) - baseline_hooks
    added = {k: v - collectives_after_ddp.get(k, 0) for k, v in collectives.items()}
    twin_losses = train(DistributedDataParallel(twin), rank_batches(rank))
    return {
        "rank_info": [info.rank, info.world_size, info.local_rank, info.source],
        "active": handle.active,
        "output_dir": str(handle.output_dir) if handle.output_dir is not None else None,
        "hooks": hooks,
        "hooks_after_remove": hooks_after_remove,
        "collectives_added": {k: v for k, v in added.items() if v},
        "identical": losses == twin_losses and parameters_equal(model, twin),
        "checksum": [float(p.double().sum()) for p in model.parameters()],
    }


def fsdp_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Train an observed ``fully_shard`` model and an unobserved twin."""
    from torch.distributed.fsdp import fully_shard

    def build() -> nn.Module:
        model = seeded_net()
        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
        return model

    def full(model: nn.Module) -> list[torch.Tensor]:
        return [
            p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # type: ignore[operator]
            for p in model.parameters()
        ]

    model, twin = build(), build()
    handle = inject_observer(model, output_dir=out_dir, sampling=1, rank_policy="all")
    losses = train(model, rank_batches(rank))
    remove_observer(model)
    twin_losses = train(twin, rank_batches(rank))
    mine, theirs = full(model), full(twin)
    return {
        "output_dir": str(handle.output_dir),
        "identical": losses == twin_losses
        and all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
    }


# ---------------------------------------------------------------------- tests
def test_rank0_policy_leaves_rank1_without_hooks_or_files(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    results = run_ranks(ddp_worker, 2, tmp_path, str(out), "rank0", "ddp")
    zero, one = results
    assert zero["rank_info"] == [0, 2, 0, "process_group"]
    assert one["rank_info"] == [1, 2, 1, "process_group"]
    assert zero["active"] is True and zero["output_dir"] == str(out)
    assert zero["hooks"] == 5  # root pre + post hook, three leaves
    assert one["active"] is False and one["output_dir"] is None
    assert one["hooks"] == 0
    assert zero["hooks_after_remove"] == 0 and one["hooks_after_remove"] == 0
    generation = os.readlink(out / ".current")  # the files, linked (see DirectorySink)
    assert sorted(p.name for p in out.iterdir()) == [
        ".current",
        generation,
        "index.md",
        "report.json",
        "series.json",
    ]
    report = read_report(out)
    assert (report["run"]["rank"], report["run"]["world_size"]) == (0, 2)
    assert report["run"]["rank_source"] == "process_group"
    assert report["coverage"]["samples_observed"] == STEPS
    for result in results:
        assert result["identical"] is True
        assert result["collectives_added"] == {}
    assert zero["checksum"] == one["checksum"]


@pytest.mark.parametrize("inject_into", ["ddp", "plain_then_wrap"])
def test_all_policy_writes_rank_directories_bit_identically(
    tmp_path: Path, inject_into: str
) -> None:
    out = tmp_path / "stats"
    results = run_ranks(ddp_worker, 2, tmp_path, str(out), "all", inject_into)
    assert sorted(p.name for p in out.iterdir()) == ["rank-000", "rank-001"]
    for rank, result in enumerate(results):
        directory = out / f"rank-{rank:03d}"
        assert result["active"] is True
        assert result["output_dir"] == str(directory)
        assert result["hooks"] == 5
        assert result["identical"] is True
        assert result["collectives_added"] == {}
        assert sorted(p.name for p in directory.iterdir()) == [
            ".current",
            os.readlink(directory / ".current"),
            "index.md",
            "report.json",
            "series.json",
        ]
        report = read_report(directory)
        assert (report["run"]["rank"], report["run"]["world_size"]) == (rank, 2)
        assert report["coverage"]["samples_observed"] == STEPS
        assert report["coverage"]["backward_samples_observed"] == STEPS
        # Names without the DDP wrapper prefix, whichever side of the wrapper we injected.
        assert module_names(directory / "report.json") == {"<root>", "fc1", "act", "fc2"}
    assert results[0]["checksum"] == results[1]["checksum"]


def test_fully_shard_all_policy_trains_bit_identically(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP in this torch")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    out = tmp_path / "stats"
    results = run_ranks(fsdp_worker, 2, tmp_path, str(out))
    for rank, result in enumerate(results):
        assert result["identical"] is True
        assert result["output_dir"] == str(out / f"rank-{rank:03d}")
        names = module_names(out / f"rank-{rank:03d}" / "report.json")
        assert names == {"<root>", "fc1", "act", "fc2"}


def test_rank_detection_from_environment_before_init(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = detect_rank()
    assert (info.rank, info.world_size, info.local_rank, info.source) == (3, 4, 1, "environment")
    model = MLP()
    handle = inject_observer(model, output_dir=tmp_path, sampling=1, rank_policy="all")
    assert handle.output_dir == tmp_path / "rank-003"
    train(model, rank_batches(3)[:2])
    remove_observer(model)
    report = read_report(tmp_path / "rank-003")
    assert (report["run"]["rank"], report["run"]["world_size"]) == (3, 4)
    assert report["run"]["rank_source"] == "environment"

    monkeypatch.setenv("RANK", "1")
    unobserved = MLP()
    handle = inject_observer(unobserved, output_dir=tmp_path / "rank0-policy", sampling=1)
    assert handle.active is False and handle.output_dir is None
    assert hook_total(unobserved) == 0
    train(unobserved, rank_batches(1)[:2])
    remove_observer(unobserved)
    assert not (tmp_path / "rank0-policy").exists()


def test_rank_detection_without_distribution_and_bad_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = detect_rank()
    assert (info.rank, info.world_size, info.local_rank, info.source) == (0, 1, 0, "single_process")
    monkeypatch.setenv("RANK", "one")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"environment variable RANK must be an int, got 'one'"):
        detect_rank()


def test_rank_directory_names_round_trip() -> None:
    assert rank_directory_name(0) == "rank-000"
    assert rank_directory_name(1234) == "rank-1234"
    assert parse_rank_directory("rank-007") == 7
    assert parse_rank_directory("rank-1234") == 1234
    assert parse_rank_directory("rank-7") is None
    assert parse_rank_directory("rank-007.tmp") is None
    assert parse_rank_directory("stats") is None
    with pytest.raises(ConfigError, match=r"rank must be an int >= 0, got -1"):
        rank_directory_name(-1)


# ------------------------------------------------------------- single-process wrappers
def test_data_parallel_wrapper_on_cpu(tmp_path: Path) -> None:
    """nn.DataParallel without GPUs runs the module directly: observed, names unprefixed."""
    model, twin = pair(MLP)
    wrapped, twin_wrapped = nn.DataParallel(model), nn.DataParallel(twin)
    data = make_batches(4, features=6)
    hooks = hook_counts(wrapped)
    attach(wrapped, tmp_path)
    losses = fit(wrapped, data)
    report = finish(wrapped, tmp_path)
    assert losses == fit(twin_wrapped, data)
    assert_same_model(wrapped, twin_wrapped)
    seen = observations(report)
    for name in ("fc1", "act", "fc2"):
        assert seen[act(name)] == 4 and seen[grad(name)] == 4
    assert not any(key[0].startswith("module.") for key in seen)
    assert hook_counts(wrapped) == hooks


def test_distributed_data_parallel_single_process(tmp_path: Path) -> None:
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model, twin = pair(MLP)
        wrapped = nn.parallel.DistributedDataParallel(model)
        twin_wrapped = nn.parallel.DistributedDataParallel(twin)
        data = make_batches(4, features=6)
        attach(wrapped, tmp_path / "stats")
        losses = fit(wrapped, data)
        report = finish(wrapped, tmp_path / "stats")
        assert losses == fit(twin_wrapped, data)
        assert_same_model(model, twin)
        seen = observations(report)
        for name in ("fc1", "fc2"):
            assert seen[act(name)] == 4 and seen[grad(name)] == 4
        assert report["coverage"]["errors_total"] == 0
    finally:
        dist.destroy_process_group()


def compiled_ddp_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """``torch.compile(DDP(model))`` (aot_eager), observed on every rank, against the
    same unobserved; a fresh Dynamo state in each rank."""
    torch._dynamo.reset()
    model, twin = seeded_net(), seeded_net()
    inject_observer(model, output_dir=out_dir, sampling=2, rank_policy="all")
    compiled = cast(nn.Module, torch.compile(DistributedDataParallel(model), backend="aot_eager"))
    losses = train(compiled, rank_batches(rank))
    remove_observer(model)
    twin_compiled = cast(
        nn.Module, torch.compile(DistributedDataParallel(twin), backend="aot_eager")
    )
    twin_losses = train(twin_compiled, rank_batches(rank))
    return {
        "identical": losses == twin_losses and parameters_equal(model, twin),
        "checksum": [float(p.double().sum()) for p in model.parameters()],
    }


def test_compiled_ddp_is_observed_inside_the_graphs_and_trains_bit_identically(
    tmp_path: Path,
) -> None:
    """DDP compiled by Dynamo (its DDP optimizer splits the graph at gradient buckets):
    on both ranks training equals the unobserved compiled DDP's, and every module's
    statistics come from inside the compiled graphs, in every sample."""
    out = tmp_path / "stats"
    results = run_ranks(compiled_ddp_worker, 2, tmp_path, str(out))
    for rank, result in enumerate(results):
        assert result["identical"] is True
        report = read_report(out / f"rank-{rank:03d}")
        assert report["errors"] == []
        capture = report["coverage"]["compiled_capture"]
        assert capture["mode"] == "in_graph"
        assert capture["slots"] == 6  # fc1, act and fc2, activation and output gradient
        assert report["coverage"]["backward_samples_observed"] == STEPS // 2
        assert module_names(out / f"rank-{rank:03d}" / "report.json") == {
            "<root>",
            "fc1",
            "act",
            "fc2",
        }
    assert results[0]["checksum"] == results[1]["checksum"]
