"""A module that returns what a submodule returned (a container, the root) shares that
submodule's measured rows: same values, measured once, unless changed in place."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from torchinstruments import inject_observer, remove_observer
from torchinstruments.observer import Observer
from torchinstruments.series import ACTIVATION, GRAD_OUTPUT


class Doubling(nn.Module):
    """Returns its child's output after doubling it in place (a new version)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x)
        y.mul_(2.0)
        return y


def train(model: nn.Module, tmp_path: Path, **options: Any) -> tuple[Observer, list[Any]]:
    handle = inject_observer(model, output_dir=tmp_path, sampling=1, **options)
    observer = handle._observer
    assert observer is not None
    measured: list[Any] = []
    original = observer.buffer.measure

    def spy(key: Any, sample: int, position: int, tensor: Tensor) -> None:
        measured.append((key, sample))
        original(key, sample, position, tensor)

    observer.buffer.measure = spy  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(8, 4, generator=generator)
        model(x).pow(2).mean().backward()
    handle.flush()
    return observer, measured


def latest(observer: Observer, name: str, signal: str, metric: str = "rms") -> float:
    index = observer.names.index(name)
    tracker = observer.store.series[(index, 0, signal, "output")].trackers[metric]
    assert tracker.latest is not None and tracker.count == 3
    return tracker.latest.value


def test_the_root_and_a_container_share_their_last_childs_rows(tmp_path: Path) -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    model = nn.Sequential(inner)  # the root returns inner's output, which is inner.2's
    observer, measured = train(model, tmp_path, include="*")  # the container "0" too
    assert observer.names == ["", "0", "0.0", "0.1", "0.2"]
    # Per sample: 3 distinct activations and their 3 output gradients, not 5 + 5.
    assert len(measured) == 3 * 6
    assert {observer.names[key[0]] for key, _ in measured} == {"0.0", "0.1", "0.2"}
    for signal in (ACTIVATION, GRAD_OUTPUT):
        for metric in ("rms", "max_abs", "excess_kurtosis", "zero_fraction"):
            value = latest(observer, "0.2", signal, metric)
            assert latest(observer, "0", signal, metric) == value
            assert latest(observer, "", signal, metric) == value
    # Each keeps its own forward position (the root closes last).
    positions = {
        name: observer.store.series[(observer.names.index(name), 0, ACTIVATION, "output")]
        for name in ("0.2", "0", "")
    }
    assert (
        positions["0.2"].forward_position
        < positions["0"].forward_position
        < positions[""].forward_position
    )
    # The root's gradient net of itself is 1 for the shared tensor too.
    index = observer.names.index("0.2")
    ratio = observer.store.series[(index, 0, GRAD_OUTPUT, "output")].trackers["rms_to_root"]
    assert ratio.latest is not None and ratio.latest.value == pytest.approx(1.0)
    remove_observer(model)


def test_an_output_changed_in_place_is_measured_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Doubling()
    observer, measured = train(model, tmp_path)
    # lin's output and the root's (the same tensor, doubled in place) are both measured.
    assert len(measured) == 3 * 4
    assert latest(observer, "", ACTIVATION) == pytest.approx(
        2.0 * latest(observer, "lin", ACTIVATION), rel=1e-6
    )
    remove_observer(model)


def test_no_module_output_is_kept_after_its_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    handle = inject_observer(model, output_dir=tmp_path, sampling=1)
    observer = handle._observer
    assert observer is not None
    model(torch.randn(2, 4)).sum().backward()
    assert observer.context.sample_outputs == {}
    remove_observer(model)


class Expand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 64)
        self.down = nn.Linear(64, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Checkpointed(nn.Module):
    """Blocks under activation checkpointing: their inner outputs are not kept."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Expand() for _ in range(4))
        self.reentrant = reentrant
        self.alive: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        refs = []
        for block in self.blocks:
            assert isinstance(block, Expand)
            handle = block.up.register_forward_hook(
                lambda module, args, out: refs.append(weakref.ref(out))
            )
            x = checkpoint(block, x, use_reentrant=self.reentrant)
            handle.remove()
        gc.collect()
        self.alive.append(sum(ref() is not None for ref in refs))
        return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_sampled_forward_keeps_no_output_that_checkpointing_frees(
    tmp_path: Path, reentrant: bool
) -> None:
    torch.manual_seed(0)
    plain, observed = Checkpointed(reentrant), Checkpointed(reentrant)
    observed.load_state_dict(plain.state_dict())
    inject_observer(observed, output_dir=tmp_path, sampling=1)
    for model in (plain, observed):
        model(torch.randn(3, 8, requires_grad=True)).sum().backward()
    remove_observer(observed)
    assert plain.alive == [0]
    assert observed.alive == plain.alive
