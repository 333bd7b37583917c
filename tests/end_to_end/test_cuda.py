"""CUDA: exact statistics on the device and no host synchronisation inside hooks.

These tests run only where CUDA is present. ``TI_CUDA_TESTS_DEVICE=cpu`` runs their bodies
on the CPU (with the synchronisation guard switched off), to check the tests themselves on
a machine without a GPU.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.harness import (
    MLP,
    act,
    attach,
    finish,
    fit,
    grad,
    make_batches,
    observations,
    read_report,
    reference_metrics,
    rms64,
    value,
)
from tests.harness.scenarios import (
    CompileNet,
    assert_identical_training,
    assert_same_telemetry,
    check_cast_statistics,
    check_poisoned_report,
    example_batches,
    example_model,
    train_poisoned,
    written_series,
)
from torchinstruments import inject_observer, remove_observer
from torchinstruments.reduce import finish_statistics, tensor_statistics

DEVICE = torch.device(os.environ.get("TI_CUDA_TESTS_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"

pytestmark = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA device"
)


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Make any host synchronisation on CUDA an error inside the block."""
    if not ON_CUDA:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def on_device(data: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    return [(x.to(DEVICE), y.to(DEVICE)) for x, y in data]


# ---------------------------------------------------------------- statistics values
def _pattern(numel: int, nan_at: int | None) -> Tensor:
    base = torch.tensor([1.0, -1.0, 3.0, -3.0]).repeat(numel // 4)
    if nan_at is not None:
        base[nan_at] = float("nan")
    return base


def _with_non_finite(x: Tensor) -> Tensor:
    x = x.clone()
    x[0, 0], x[1, 1], x[2, 2], x[3, :5] = float("inf"), float("nan"), float("-inf"), 0.0
    return x


STATISTICS_CASES = {
    "f32-randn": lambda g: torch.randn(1000, 37, generator=g),
    "f32-relu-300k": lambda g: torch.relu(torch.randn(300_000, generator=g)),
    "f32-tiny": lambda g: torch.randn(2049, generator=g) * 1e-30,
    "f16-inf-nan-zeros": lambda g: _with_non_finite(torch.randn(64, 129, generator=g)).half(),
    "bf16-near-max": lambda g: (torch.rand(4096, generator=g) * 2 - 1).mul(3.3e38).bfloat16(),
    "f64-1e300": lambda g: torch.randn(513, dtype=torch.float64, generator=g) * 1e300,
    "all-zeros": lambda g: torch.zeros(100),
    "all-nan": lambda g: torch.full((7,), float("nan")),
    "f32-3x2^24-one-nan": lambda g: _pattern(3 * 2**24, nan_at=7),
}


@pytest.mark.parametrize("case", list(STATISTICS_CASES))
def test_tensor_statistics_on_the_device_match_a_float64_reference(case: str) -> None:
    x = STATISTICS_CASES[case](torch.Generator().manual_seed(0)).to(DEVICE)
    with no_host_sync():
        row = tensor_statistics(x)
    assert row.device == x.device and row.dtype == torch.float64
    got = finish_statistics(row.cpu().tolist())
    expected = reference_metrics(x)
    for metric, want in expected.items():
        have = got[metric]
        if want is None:
            assert have is None, (metric, have)
        elif metric in ("max_abs", "zero_fraction", "nonfinite_fraction"):
            assert have == want, (metric, have, want)  # counts and extremes are exact
        elif metric == "excess_kurtosis":
            assert have == pytest.approx(want, abs=1e-3), (metric, have, want)
        else:
            assert have == pytest.approx(want, rel=1e-4), (metric, have, want)
    if case == "all-nan":
        assert got["rms"] is None and got["nonfinite_fraction"] == 1.0


@pytest.mark.parametrize(
    ("dtype", "scale", "loss_scale"),
    [
        (torch.float16, 65000.0, 1e-4),
        (torch.bfloat16, 3.3e38, 1e-38),
        (torch.float32, 1e-30, 1e30),
    ],
    ids=["f16-max", "bf16-max", "f32-1e-30"],
)
def test_report_values_on_the_device_match_the_tensors(
    tmp_path: Path, dtype: torch.dtype, scale: float, loss_scale: float
) -> None:
    check_cast_statistics(tmp_path, dtype, scale, loss_scale, DEVICE, no_host_sync)


# ---------------------------------------------------------------- no host sync
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.norm(self.fc(x)))


@pytest.mark.parametrize(
    "options",
    [{"sampling": 1}, {"sampling": 3}, {"sampling": 3, "full_sentinel": True}, {}],
    ids=["every", "every-3-root-sentinel", "every-3-full-sentinel", "default"],
)
def test_sampled_steps_never_synchronise(tmp_path: Path, options: dict[str, object]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(256, 10)).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(40, 64, 256, device=DEVICE)
    targets = torch.randint(0, 10, (40, 64), device=DEVICE)
    inject_observer(model, output_dir=tmp_path, **options)  # type: ignore[arg-type]
    with no_host_sync():
        for step in range(40):
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(inputs[step]), targets[step])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    remove_observer(model)
    report = read_report(tmp_path)
    assert report["errors"] == []
    assert report["coverage"]["samples_observed"] >= 13
    assert report["coverage"]["backward_samples_observed"] == report["coverage"]["samples_observed"]


@pytest.mark.parametrize("full_sentinel", [False, True], ids=["root", "full"])
def test_fault_between_samples_is_located_on_the_device_without_sync(
    tmp_path: Path, full_sentinel: bool
) -> None:
    report = train_poisoned(tmp_path, DEVICE, no_host_sync, full_sentinel=full_sentinel)
    check_poisoned_report(report, full_sentinel, accelerator=DEVICE.type == "cuda")


# ---------------------------------------------------------------- training features
class CheckpointNet(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 256)
        self.block1, self.block2 = Block(), Block()
        self.head = nn.Linear(256, 1)
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in (self.block1, self.block2):
            h = cast(Tensor, checkpoint(block, h, use_reentrant=self.reentrant))
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_with_float16_autocast_and_grad_scaler(
    tmp_path: Path, reentrant: bool
) -> None:
    """Checkpointed blocks under float16 autocast and a GradScaler (which itself syncs in
    ``step``/``update``, so only forward and backward are guarded)."""
    steps = 8
    torch.manual_seed(0)
    model = CheckpointNet(reentrant).to(DEVICE)
    twin = copy.deepcopy(model)
    data = [
        (torch.randn(16, 32, device=DEVICE), torch.randn(16, 1, device=DEVICE))
        for _ in range(steps)
    ]
    amp_dtype = torch.float16 if ON_CUDA else torch.bfloat16

    def run(m: nn.Module, guard: bool) -> list[float]:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10)
        losses = []
        for x, y in data:
            optimizer.zero_grad(set_to_none=True)
            with no_host_sync() if guard else _nothing():
                with torch.autocast(DEVICE.type, dtype=amp_dtype):
                    loss = nn.functional.mse_loss(m(x).float(), y)
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(float(loss.detach()))
        return losses

    attach(model, tmp_path)
    losses = run(model, guard=True)
    report = finish(model, tmp_path)
    assert losses == run(twin, guard=False)
    assert report["coverage"]["errors_total"] == 0
    seen = observations(report)
    for name in ("inp", "block1.fc", "block1.norm", "block2.fc", "head"):
        assert seen.get(act(name)) == steps, (name, sorted(seen))
        assert seen.get(grad(name)) == steps, (name, sorted(seen))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@pytest.mark.parametrize("order", ["inject_then_compile", "compile_then_inject"])
def test_torch_compile_with_inductor(tmp_path: Path, order: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = CompileNet().to(DEVICE)
    twin = copy.deepcopy(model)
    data = on_device(make_batches(5, features=6))
    if order == "inject_then_compile":
        attach(model, tmp_path)
    compiled = cast(nn.Module, torch.compile(model, backend="inductor"))
    twin_compiled = cast(nn.Module, torch.compile(twin, backend="inductor"))

    if order == "compile_then_inject":
        fit(compiled, data[:1])
        fit(twin_compiled, data[:1])
        attach(model, tmp_path)
    losses = fit(compiled, data[1:])
    report = finish(model, tmp_path)
    assert losses == pytest.approx(fit(twin_compiled, data[1:]), rel=1e-5)
    torch._dynamo.reset()
    seen = observations(report)
    for name in ("fc1", "act", "fc2"):
        assert seen.get(act(name)) == 4 and seen.get(grad(name)) == 4, (name, sorted(seen))
    assert report["coverage"]["errors_total"] == 0


def _fit_example(
    model: nn.Module, data: list[tuple[Tensor, Tensor]], guard_from: int | None = None
) -> tuple[list[Tensor], int]:
    """SGD with momentum on the cross-entropy, as ``fit_classifier``; steps from
    ``guard_from`` on (forward, backward and optimizer step) run under
    :func:`no_host_sync`. Returns the losses and Dynamo's count of graphs compiled
    before step ``guard_from``."""
    from torch._dynamo.utils import counters

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, graphs = [], -1
    for step, (x, y) in enumerate(data):
        guarded = guard_from is not None and step >= guard_from
        if step == guard_from:
            graphs = counters["stats"]["unique_graphs"]
        with no_host_sync() if guarded else _nothing():
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        losses.append(loss.detach().clone())
    return losses, graphs


def test_capture_inside_inductor_graphs_on_the_device(tmp_path: Path) -> None:
    """The example's model on the device, compiled whole by inductor with
    ``fullgraph=True`` and observed with ``sampling=2`` (sampled and unsampled forwards
    alternate, so both graph variants and the root sentinel run). Once the first two
    steps compiled both variants: no host synchronisation in any step, no graph
    compiled and no graph break. Training is bit-identical to the same model compiled
    without the observer (every loss and parameter ``torch.equal``); every series equals
    the eager path's on the same batches and device (relative 1e-4 on CUDA, where
    inductor's fused kernels may round activations differently from eager kernels;
    1e-5 on the CPU)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    base = example_model().to(DEVICE)
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    data = on_device(example_batches(10))
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=2)
    _fit_example(eager, data)
    remove_observer(eager)

    inject_observer(observed, output_dir=tmp_path / "compiled", sampling=2)
    breaks = sum(counters["graph_break"].values())
    compiled = cast(nn.Module, torch.compile(observed, backend="inductor", fullgraph=True))
    losses, graphs = _fit_example(compiled, data, guard_from=2)
    assert counters["stats"]["unique_graphs"] == graphs > 0
    assert sum(counters["graph_break"].values()) == breaks
    remove_observer(observed)
    report = read_report(tmp_path / "compiled")
    plain = cast(nn.Module, torch.compile(twin, backend="inductor", fullgraph=True))
    twin_losses, _ = _fit_example(plain, data)
    torch._dynamo.reset()
    assert_identical_training(observed, twin, losses, twin_losses)
    assert report["errors"] == []
    capture = report["coverage"]["compiled_capture"]
    assert capture["mode"] == "in_graph" and capture["slots_dropped"] == 0, capture
    assert report["coverage"]["samples_observed"] == 5
    eager_series = written_series(tmp_path / "eager")
    assert len({key[:4] for key in eager_series}) == 2 * 14  # 13 leaves and the root
    assert_same_telemetry(
        eager_series, written_series(tmp_path / "compiled"), rel=1e-4 if ON_CUDA else 1e-5
    )


def test_distributed_data_parallel_world_size_one(tmp_path: Path) -> None:
    import torch.distributed as dist

    backend = "nccl" if ON_CUDA else "gloo"
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    if ON_CUDA and not dist.is_nccl_available():
        pytest.skip("NCCL unavailable")
    dist.init_process_group(
        backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(1)
        model = MLP().to(DEVICE)
        twin = copy.deepcopy(model)
        ids = [DEVICE.index or 0] if ON_CUDA else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        twin_wrapped = nn.parallel.DistributedDataParallel(twin, device_ids=ids)
        data = on_device(make_batches(6, features=6))

        attach(wrapped, tmp_path / "stats")
        losses = fit(wrapped, data)
        report = finish(wrapped, tmp_path / "stats")
        assert losses == fit(twin_wrapped, data)
        seen = observations(report)
        for name in ("fc1", "act", "fc2"):
            assert seen[act(name)] == 6 and seen[grad(name)] == 6, (name, sorted(seen))
        assert report["coverage"]["errors_total"] == 0
        assert report["run"]["world_size"] == 1
    finally:
        dist.destroy_process_group()


class InplaceAfter(nn.Module):
    """``fc``'s output is changed in place right after its hooks ran."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 48)
        self.head = nn.Linear(48, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        h.mul_(-1.0).relu_()  # half the values become zeros after the hook
        return self.head(h)


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_staged_copies_keep_the_values_seen_by_the_hook(tmp_path: Path, side_stream: bool) -> None:
    """Small CUDA tensors are copied and reduced later in batches: the values must be
    those at hook time (not after the in-place ops), also when the forward and backward
    run on a side stream and the batch is reduced on another one."""
    torch.manual_seed(0)
    model = InplaceAfter().to(DEVICE)
    seen: list[Tensor] = []
    model.fc.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    attach(model, tmp_path)
    data = on_device(make_batches(6, features=32))
    stream = torch.cuda.Stream() if ON_CUDA and side_stream else None
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        for x, y in data:
            nn.functional.mse_loss(model(x), y).backward()
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
    report = finish(model, tmp_path)
    assert report["coverage"]["errors_total"] == 0
    for point, index in (("first", 0), ("latest", 5)):
        assert value(report, act("fc"), point=point) == pytest.approx(rms64(seen[index]), rel=1e-5)
