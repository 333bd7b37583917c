"""The observer's life on a model: forwards without backward and repeated inject / remove
leave nothing behind; deep copies, pickles, ``torch.save`` and ``torch.jit`` of an
observed model carry no residue (or say how to); dtype, device and meta moves.

Where training runs, it is compared with an uninstrumented twin (same seed, same data)
and must be bit-identical; reported values are checked against a hand-computed float64
reference on the twin (``tests.harness.Reference``).
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn

from tests.harness import (
    MLP,
    MLP_NAMES,
    Step,
    assert_same_model,
    attach,
    finish,
    fit,
    hook_counts,
    instance_attributes,
    live,
    live_tensors,
    make_batches,
    mse_step,
    observations,
    pair,
    read,
)
from tests.harness.scenarios import CheckpointNet
from torchinstruments import (
    observer_of,
    remove_observer,
)


@pytest.mark.usefixtures("frozen_heap")
@pytest.mark.parametrize("mode", [None, "reentrant", "non_reentrant"])
def test_forwards_without_backward_leak_nothing(tmp_path: Path, mode: str | None) -> None:
    model = CheckpointNet(mode)
    kept: list[weakref.ref[Tensor]] = []
    model.block.lin.register_forward_hook(lambda m, a, o: kept.append(weakref.ref(o)) and None)
    handle = attach(model, tmp_path)
    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(10):
        model(x)
    handle.flush()
    baseline = live_tensors()
    for _ in range(100):
        out = model(x)
        kept.append(weakref.ref(out))
        del out
    # Copies of small observed tensors wait for the next flush, to be reduced in a batch
    # (at most STAGE_MAX_ELEMENTS elements); the flush releases them. The staging slabs
    # (preallocated rows, reused, bounded) and their scratch buffer stay.
    handle.flush()
    gc.collect()
    assert all(ref() is None for ref in kept), "an output (and its graph) is kept alive"
    assert live("GradHook") == 0
    observer = handle._observer
    staging = sum(1 + len(slab.rows) for slab in observer.buffer.slabs.values())
    staging += observer.buffer.slab_scratch is not None
    assert live_tensors() <= baseline + 2 + staging
    remove_observer(model)


@pytest.mark.usefixtures("frozen_heap")
def test_repeated_inject_and_remove_leaves_nothing_behind(tmp_path: Path) -> None:
    model, twin = pair(MLP)
    hooks, attributes = hook_counts(model), instance_attributes(model)
    scale = torch.amp.GradScaler.scale
    exit_callbacks = live("AtExit")
    data = make_batches(2, features=6)
    losses, twin_losses = [], []
    fit(model, data[:1])
    fit(twin, data[:1])
    baseline = live_tensors()
    handles: list[weakref.ref[Any]] = []
    for cycle in range(12):
        handle = attach(model, tmp_path / str(cycle), capture_direct_forwards=cycle % 2 == 1)
        handles.append(weakref.ref(handle))
        handles.append(weakref.ref(getattr(handle, "_observer", handle)))
        del handle
        losses += fit(model, data)
        remove_observer(model)
        twin_losses += fit(twin, data)
        assert hook_counts(model) == hooks, cycle
        assert instance_attributes(model) == attributes, cycle
        assert read(tmp_path / str(cycle))["coverage"]["samples_observed"] == 2
    assert losses == twin_losses
    assert_same_model(model, twin)
    assert torch.amp.GradScaler.scale is scale
    assert observer_of(model) is None
    gc.collect()
    assert all(ref() is None for ref in handles), "a removed observer is kept alive"
    assert live("AtExit") == exit_callbacks, "an interpreter-exit callback stays registered"
    assert live_tensors() <= baseline + 2


def ema_update(ema: nn.Module, model: nn.Module, decay: float = 0.9) -> None:
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.mul_(decay).add_(p, alpha=1 - decay)


@pytest.mark.parametrize("direct", [False, True], ids=["hooks", "capture_direct_forwards"])
def test_deep_copied_ema_model_trains_alongside_and_is_not_observed(
    tmp_path: Path, direct: bool
) -> None:
    model, twin = pair(MLP)
    data = make_batches(5, features=6)
    attach(model, tmp_path, capture_direct_forwards=direct)
    ema = copy.deepcopy(model)
    twin_ema = copy.deepcopy(twin)

    def step_with_ema(ema_model: nn.Module) -> Step:
        def step(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            loss = mse_step(m, x, y)
            ema_update(ema_model, m)
            ema_model(x).sum().backward()  # the copy is used, even with gradients
            return loss

        return step

    losses = fit(model, data, step_with_ema(ema))
    report = finish(model, tmp_path)
    assert losses == fit(twin, data, step_with_ema(twin_ema))
    assert_same_model(model, twin)
    assert_same_model(ema, twin_ema)
    assert report["coverage"]["samples_observed"] == len(data)
    assert all(count == len(data) for count in observations(report).values())
    x = torch.randn(3, 6)
    assert torch.equal(ema(x), twin_ema(x))


@pytest.mark.parametrize("direct", [False, True], ids=["hooks", "capture_direct_forwards"])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_copies_of_an_observed_model_carry_no_residue(tmp_path: Path, direct: bool) -> None:
    model = MLP()
    clean = copy.deepcopy(model)
    attach(model, tmp_path, capture_direct_forwards=direct)
    copies = [copy.deepcopy(model)]
    if not direct:  # with wrappers, pickling is refused with a clear error
        copies.append(pickle.loads(pickle.dumps(model)))
    remove_observer(model)
    x = torch.randn(2, 6)
    for copied in copies:
        # Copies carry inert placeholders that do nothing and remove themselves at the
        # first forward; scripting before that compiles the copy without them.
        scripted = torch.jit.script(copied)
        assert hook_counts(scripted) == hook_counts(clean)
        assert torch.equal(scripted(x), clean(x))
        copied(x)
        assert hook_counts(copied) == hook_counts(clean)
        assert instance_attributes(copied) == instance_attributes(clean)
        torch.jit.script(copied)


@pytest.mark.parametrize("direct", [False, True], ids=["hooks", "capture_direct_forwards"])
def test_observed_model_pickles_and_saves_or_says_how_to(tmp_path: Path, direct: bool) -> None:
    model = MLP()
    attach(model, tmp_path, capture_direct_forwards=direct)
    x = torch.randn(3, 6)
    restored: list[nn.Module] = []
    for dump, load in (
        (pickle.dumps, pickle.loads),
        (
            lambda m: (buffer := io.BytesIO(), torch.save(m, buffer), buffer.getvalue())[2],
            lambda raw: torch.load(io.BytesIO(raw), weights_only=False),
        ),
    ):
        try:
            raw = dump(model)
        except Exception as error:
            assert direct, f"pickling failed without wrappers: {error!r}"
            assert "remove_observer" in str(error) and "state_dict" in str(error), error
            continue
        restored.append(load(raw))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)  # always possible
    with torch.no_grad():
        expected = model(x)  # a no-grad forward: not a sample
    for restored_model in restored:
        restored_model(x).sum().backward()
        assert torch.equal(restored_model(x), expected)
    model(x).sum().backward()
    report = finish(model, tmp_path)
    # The copies were not observed: only the original's training forward counts.
    assert report["coverage"]["forwards_seen"] == 1


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")
def test_jit_trace_of_an_observed_model_works_or_says_how_to(tmp_path: Path) -> None:
    model = MLP()
    attach(model, tmp_path)
    x = torch.randn(3, 6)
    try:
        traced = cast(Callable[[Tensor], Tensor], torch.jit.trace(model, x))
    except Exception as error:
        assert "remove_observer" in str(error), f"unclear error: {type(error).__name__}"
    else:
        assert torch.equal(traced(x), model(x))
    remove_observer(model)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")
def test_jit_script_of_an_observed_model_works_or_says_how_to(tmp_path: Path) -> None:
    model = MLP()
    attach(model, tmp_path)
    x = torch.randn(3, 6)
    try:
        scripted = torch.jit.script(model)
    except Exception as error:
        assert "remove_observer" in str(error), f"unclear error: {type(error).__name__}: {error}"
    else:
        assert torch.equal(scripted(x), model(x))
    remove_observer(model)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")
def test_jit_after_removal_works(tmp_path: Path) -> None:
    model = MLP()
    attach(model, tmp_path)
    model(torch.randn(3, 6)).sum().backward()
    remove_observer(model)
    x = torch.randn(3, 6)
    assert torch.equal(torch.jit.script(model)(x), model(x))
    traced = cast(Callable[[Tensor], Tensor], torch.jit.trace(model, x))
    assert torch.equal(traced(x), model(x))


def test_dtype_and_device_moves_and_replaced_parameters(tmp_path: Path) -> None:
    model, twin = pair(MLP)
    data = make_batches(9, features=6)

    def run(m: MLP) -> list[float]:
        losses = fit(m, data[:3])
        m.double()
        losses += fit(m, [(x.double(), y.double()) for x, y in data[3:6]])
        m.float().to("cpu")
        with torch.no_grad():
            m.fc1.weight = nn.Parameter(m.fc1.weight * 0.5)  # a new Parameter object
            m.fc2.bias = nn.Parameter(torch.zeros(1))
        losses += fit(m, data[6:])
        return losses

    attach(model, tmp_path)
    losses = run(model)
    report = finish(model, tmp_path)
    assert losses == run(twin)
    assert_same_model(model, twin)
    assert all(count == 9 for count in observations(report).values())
    assert report["coverage"]["backward_samples_observed"] == 9
    assert report["coverage"]["errors_total"] == 0


def test_model_moved_to_meta_is_skipped_and_counted(tmp_path: Path) -> None:
    model = MLP()
    attach(model, tmp_path)
    model(torch.randn(3, 6)).sum().backward()
    model.to("meta")
    out = model(torch.randn(3, 6, device="meta"))
    out.sum().backward()
    report = finish(model, tmp_path)
    assert out.device.type == "meta"
    assert report["coverage"]["tensors_skipped"].get("meta", 0) == len(MLP_NAMES)
    assert report["coverage"]["errors_total"] == 0
