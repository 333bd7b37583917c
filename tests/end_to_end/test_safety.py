"""Passive means passive: training with the observer is bit-identical to training without."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.harness import ResidualNet, hook_counts, make_batches, read_report
from torchinstruments import inject_observer, remove_observer


def run_steps(model: nn.Module, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train ``steps`` SGD steps; return outputs and output gradients per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    outputs, output_grads = [], []
    for x, y in make_batches(steps, seed=3):
        optimizer.zero_grad()
        out = model(x)
        out.retain_grad()
        nn.functional.mse_loss(out, y).backward()
        optimizer.step()
        outputs.append(out.detach().clone())
        assert out.grad is not None
        output_grads.append(out.grad.clone())
    return outputs, output_grads


@pytest.mark.parametrize("sampling", [1, None, 3])
def test_fifty_steps_are_bit_identical(tmp_path: Path, sampling: int | None) -> None:
    torch.manual_seed(0)
    model = ResidualNet()
    twin = copy.deepcopy(model)
    inject_observer(model, output_dir=tmp_path, sampling=sampling)
    observed = run_steps(model, 50)
    remove_observer(model)
    plain = run_steps(twin, 50)
    for a, b in zip(observed[0] + observed[1], plain[0] + plain[1], strict=True):
        assert torch.equal(a, b)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert read_report(tmp_path)["coverage"]["samples_observed"] > 0


def test_nothing_is_added_to_the_model(tmp_path: Path) -> None:
    model = ResidualNet()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    parameters = [name for name, _ in model.named_parameters()]
    buffers = [name for name, _ in model.named_buffers()]
    modules = [name for name, _ in model.named_modules()]
    inject_observer(model, output_dir=tmp_path, sampling=1)
    run_steps(model, 2)
    assert [name for name, _ in model.named_parameters()] == parameters
    assert [name for name, _ in model.named_buffers()] == buffers
    assert [name for name, _ in model.named_modules()] == modules
    assert list(model.state_dict()) == list(state)
    remove_observer(model)


def test_after_removal_no_hook_remains_and_model_copies_and_pickles(tmp_path: Path) -> None:
    model = ResidualNet()
    before = hook_counts(model)
    inject_observer(model, output_dir=tmp_path, sampling=1)
    run_steps(model, 2)
    remove_observer(model)
    assert hook_counts(model) == before
    clone = copy.deepcopy(model)
    restored = pickle.loads(pickle.dumps(model))
    x = torch.randn(4, 8)
    assert torch.equal(clone(x), model(x))
    assert torch.equal(restored(x), model(x))


def test_attached_model_deep_copies_pickles_and_saves_without_feeding_the_observer(
    tmp_path: Path,
) -> None:
    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    ema = copy.deepcopy(model)  # an EMA copy of an observed model
    restored = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    x = torch.randn(4, 8)
    ema(x).sum().backward()
    restored(x).sum().backward()
    model(x).sum().backward()
    remove_observer(model)
    assert read_report(tmp_path)["coverage"]["samples_observed"] == 1
    assert torch.equal(ema(x), model(x))


def test_forward_without_backward_keeps_no_graph_alive(tmp_path: Path) -> None:
    import gc
    import weakref

    model = ResidualNet()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    refs = []
    for _ in range(3):
        out = model(torch.randn(4, 8))
        refs.append(weakref.ref(out))
        del out
    gc.collect()
    assert all(ref() is None for ref in refs)
    remove_observer(model)
