"""Models and training scenarios that several test files run: on the CPU, on a device
(``tests/end_to_end/test_cuda.py``) or under another compiler backend
(``tests/test_compiled_inductor.py``), each with the same checks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.harness import (
    act,
    attach,
    event_of,
    finish,
    grad,
    load_example,
    make_batches,
    read_report,
    rms64,
    value,
)
from torchinstruments import inject_observer, remove_observer


# ------------------------------------------------------- statistics of every float dtype
class Cast(nn.Module):
    """Casts its input to ``dtype`` and multiplies by ``scale``."""

    def __init__(self, dtype: torch.dtype, scale: float) -> None:
        super().__init__()
        self.dtype = dtype
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.dtype) * self.scale


class CastNet(nn.Module):
    """Linear(6, 32) -> tanh -> :class:`Cast`, summed in float32 (float64 for float64)
    times ``loss_scale``: the loss, a scalar."""

    def __init__(self, dtype: torch.dtype, scale: float, loss_scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 32)
        self.cast = Cast(dtype, scale)
        self.loss_scale = loss_scale

    def forward(self, x: Tensor) -> Tensor:
        out = self.cast(torch.tanh(self.fc(x)))
        wide = torch.float64 if out.dtype == torch.float64 else torch.float32
        return (out.to(wide) * self.loss_scale).sum()


def check_cast_statistics(
    directory: Path,
    dtype: torch.dtype,
    scale: float,
    loss_scale: float,
    device: torch.device | None = None,
    guard: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> None:
    """Train ``CastNet`` 3 steps on ``device``, ``guard`` around the training; the first
    and latest RMS of ``cast``'s activation and output gradient match float64 values."""
    torch.manual_seed(0)
    model = CastNet(dtype, scale, loss_scale).to(device)
    outputs: list[Tensor] = []
    gradients: list[Tensor] = []

    def keep(module: nn.Module, args: Any, output: Tensor) -> None:
        outputs.append(output)
        output.register_hook(lambda g: gradients.append(g) and None)

    handle = model.cast.register_forward_hook(keep)
    attach(model, directory)
    data = [(x.to(device), y.to(device)) for x, y in make_batches(3, features=6)]
    with guard():
        for x, _ in data:
            model(x).backward()
    report = finish(model, directory)
    handle.remove()
    assert report["coverage"]["errors_total"] == 0
    assert torch.isfinite(outputs[-1]).all(), "test premise: finite activations"
    for point, index in (("first", 0), ("latest", 2)):
        assert value(report, act("cast"), point=point) == pytest.approx(
            rms64(outputs[index]), rel=1e-4
        )
        assert value(report, grad("cast"), point=point) == pytest.approx(
            rms64(gradients[index]), rel=1e-4
        )
    assert not [f for f in report["findings"] if f["category"] == "non_finite"]


# ---------------------------------------------------------------------- checkpointing
class Block(nn.Module):
    """Linear(12, 12) -> Tanh -> Linear(12, 12): the block :class:`CheckpointNet`
    checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 12)
        self.act = nn.Tanh()
        self.out = nn.Linear(12, 12)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.act(self.lin(x)))


class CheckpointNet(nn.Module):
    """Linear(6, 12) -> :class:`Block` -> Linear(12, 1); with ``mode`` ``"reentrant"`` or
    ``"non_reentrant"`` the block runs under ``torch.utils.checkpoint``."""

    def __init__(self, mode: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.block = Block()
        self.head = nn.Linear(12, 1)
        self.mode = mode  # None, "reentrant" or "non_reentrant"

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        if self.mode is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


# ------------------------------------------------------------------------ torch.compile
class CompileNet(nn.Module):
    """A class of its own: Dynamo caches compiled code per code object."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(12, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


# --------------------------------------------------------------- non-finite, sentinels
def inject(model: nn.Module, directory: Path, accelerator: bool, **options: Any) -> None:
    """``inject_observer``; with ``accelerator`` the CPU takes the path CUDA takes
    (sentinel sums read at the next flush, small tensors reduced in device batches)."""
    handle = inject_observer(model, output_dir=directory, **options)
    if accelerator:
        observer = handle._observer
        assert observer is not None
        observer.buffer.device_path_types = frozenset({"cpu"})


class Poison(nn.Module):
    """Multiplies by a gate buffer; setting the gate to NaN starts a fault here."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gate", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate


class PoisonNet(nn.Module):
    """Linear(32, 64) -> :class:`Poison` -> Linear(64, 64) -> ReLU -> Linear(64, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.poison = Poison()
        self.fc2 = nn.Linear(64, 64)
        self.act = nn.ReLU()
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc2(self.poison(self.fc1(x)))))


#: Training forward at which ``Poison`` turns NaN: unsampled by the default schedule
#: (its third stage samples every 4th forward, 18 to 38) and checked by the root
#: sentinel (forwards 7, 8, 17, 26, 35, ...), so the values reach every module's
#: parameters through the optimizer step before the next sample (sample 17, forward 38).
POISONED_FORWARD = 35


def train_poisoned(
    directory: Path,
    device: torch.device,
    guard: Callable[[], AbstractContextManager[None]],
    accelerator: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Train ``PoisonNet`` 60 steps with SGD, poisoned from ``POISONED_FORWARD`` on."""
    torch.manual_seed(0)
    model = PoisonNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(60, 16, 32, device=device)
    targets = torch.randn(60, 16, 1, device=device)
    inject(model, directory, accelerator, **options)
    with guard():
        for step in range(60):
            if step == POISONED_FORWARD:
                model.poison.gate.fill_(float("nan"))  # a kernel launch on CUDA, no sync
            loss = nn.functional.mse_loss(model(inputs[step]), targets[step])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    remove_observer(model)
    return read_report(directory)


def check_poisoned_report(report: dict[str, Any], full_sentinel: bool, accelerator: bool) -> None:
    """The non-finite finding names ``poison`` with the full sentinel; with the root
    sentinel alone it says the origin is not located and how to locate it. On the CPU
    path the hit forces the very next forward (36) to be sampled; on the accelerator
    path the sentinel sum is read at the next flush, so the first sample after the hit
    is the scheduled one (forward 38)."""
    assert report["coverage"]["errors_total"] == 0
    first = report["findings"][0]
    assert first["category"] == "non_finite" and first["notable"]
    earlier = first["evidence"]["earlier_between_samples"]
    assert earlier["forward_index"] == POISONED_FORWARD
    assert first["evidence"]["first_nonfinite_sample"] == 17
    assert (first["change_sample"], first["change_forward"]) == (17, 38 if accelerator else 36)
    if full_sentinel:
        assert (first["module"], first["signal"]) == ("poison", "activation")
        assert earlier == {
            "source": "full_sentinel",
            "forward_index": POISONED_FORWARD,
            "module": "poison",
            "call_index": 0,
            "tensor_path": "output",
            "this_series": True,
        }
        event = event_of(report, first)
        assert "full sentinel saw them here first" in event["interpretation"]
        # poison multiplies fc1's output by 1 at every sample: one series, named by both.
        assert event["also_named"] == ["fc1"]
    else:
        # Every module is non-finite at the next sample (fc1 through its NaN weights);
        # forward order cannot tell, and the report says so.
        assert (first["module"], first["signal"]) == ("fc1", "activation")
        assert earlier["source"] == "root_sentinel" and earlier["module"] == "<root>"
        event = event_of(report, first)
        assert "need not show where they started" in event["interpretation"]
        assert "full_sentinel=True" in event["next_experiment"]


# ----------------------------------------------- the example's model, compiled or eager
def example_model() -> nn.Module:
    """The example's ResidualMLP, small: 2 blocks of width 16 (13 leaf modules), built
    after ``torch.manual_seed(0)``."""
    module = load_example("basic_training.py", "_ti_example_for_compile")
    torch.manual_seed(0)
    return module.ResidualMLP(inputs=16, width=16, depth=2, classes=4)


def example_batches(count: int) -> list[tuple[Tensor, Tensor]]:
    """``count`` seeded classification batches: ``x`` of shape ``(8, 16)``, labels in
    ``0..3``."""
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
        for _ in range(count)
    ]


def fit_classifier(model: nn.Module, data: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """SGD with momentum (lr 0.1, momentum 0.9) on the cross-entropy; the losses, as
    tensors (compared bit for bit)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses


Series = dict[tuple[str, int, str, str, str], list[list[Any]]]


def written_series(directory: Path) -> Series:
    """Every series of series.json: (module, call, signal, path, metric) -> points."""
    data = json.loads((directory / "series.json").read_text(encoding="utf-8"))
    return {
        (e["module"], e["call_index"], e["signal"], e["tensor_path"], e["metric"]): e["points"]
        for e in data["series"]
    }


def assert_same_telemetry(eager: Series, compiled: Series, rel: float = 1e-5) -> None:
    """The same series, samples and values; values to ``rel`` (series.json keeps 6
    significant digits, and float32 sums in another order differ in the last bits)."""
    assert sorted(compiled) == sorted(eager)
    for key, points in eager.items():
        other = compiled[key]
        assert [p[0] for p in other] == [p[0] for p in points], key
        for (_, a), (_, b) in zip(points, other, strict=True):
            if a is None or b is None:
                assert a is b, key
            else:
                assert b == pytest.approx(a, rel=rel, abs=1e-9), key


def assert_identical_training(
    observed: nn.Module, twin: nn.Module, losses: list[Tensor], twin_losses: list[Tensor]
) -> None:
    """Identical means bit for bit: every loss and every parameter and buffer after
    training equal (``torch.equal``) to those of the same compiled model without the
    observer, trained on the same batches from the same initial state."""
    assert all(torch.equal(a, b) for a, b in zip(losses, twin_losses, strict=True))
    mine, theirs = observed.state_dict(), twin.state_dict()
    assert list(mine) == list(theirs)
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
