"""Issue 5, item by item: the hard cases of hook instrumentation, beyond ../shared/cases.

Every test uses a small seeded model. Where training runs, it is compared with an
uninstrumented twin (same seed, same data) and must be bit-identical. Reported values are
checked against a hand-computed reference: forward hooks and tensor hooks on the twin,
reduced in float64.

Behaviours that do not work yet are kept as ``xfail(strict=True)`` with the reason.
"""

from __future__ import annotations

import copy
import errno
import gc
import io
import math
import os
import pickle
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.harness import (
    MLP,
    MLP_NAMES,
    Batch,
    Reference,
    Report,
    Step,
    act,
    assert_same_model,
    attach,
    check_against_reference,
    finish,
    fit,
    grad,
    hook_counts,
    instance_attributes,
    live,
    live_tensors,
    make_batches,
    mse_step,
    observations,
    pair,
    read,
    referenced_step,
    series,
    value,
)
from tests.harness.scenarios import CompileNet, check_cast_statistics
from torchinstruments import (
    ConfigError,
    DefaultSampling,
    EveryNSampling,
    ObserverStateError,
    ReportConfig,
    TrackConfig,
    inject_observer,
    observer_of,
    remove_observer,
)
from torchinstruments.reduce import cpu_statistics, finish_statistics


# ============================================================== 1. capture semantics
class InplaceNet(nn.Module):
    """fc1's output is rewritten by ReLU(inplace=True); fc2's by an in-place ``mul_``."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.act = nn.ReLU(inplace=inplace)
        self.fc2 = nn.Linear(12, 12)
        self.fc3 = nn.Linear(12, 1)
        self.inplace = inplace

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.fc1(x))
        g = self.fc2(h)
        g = g.mul_(3.0) if self.inplace else g * 3.0
        return self.fc3(torch.tanh(g))


def test_inplace_ops_after_a_module_keep_its_own_output_gradient(tmp_path: Path) -> None:
    model, twin = pair(InplaceNet)
    plain = copy.deepcopy(model)
    plain.act.inplace = False
    plain.inplace = False  # the same function without in-place ops, for the reference
    reference = Reference(plain, ["fc1", "act", "fc2", "fc3"])
    data = make_batches(4, features=6)

    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))
    assert check_against_reference(report, reference) == 2 * 8
    # The module's own gradient, not its successor's: fc1 (pre-ReLU) differs from act,
    # fc2's output gradient is 3x the gradient of the tensor that mul_ left behind.
    assert value(report, grad("fc1")) != value(report, grad("act"))
    assert value(report, act("fc1")) != value(report, act("act"))
    assert report["coverage"]["errors_total"] == 0


class FrozenPrefixNet(nn.Module):
    """A frozen embedding and backbone (outputs without grad), an argmax, a side call."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.backbone = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)
        self.pick = ArgMax()
        for parameter in [*self.embed.parameters(), *self.backbone.parameters()]:
            parameter.requires_grad_(False)

    def forward(self, tokens: Tensor) -> Tensor:
        features = torch.tanh(self.backbone(self.embed(tokens))).mean(dim=1)
        self.pick(features)  # integer output
        side = self.head(features.detach() * 2)  # call 0 of head: never reaches the loss
        del side
        return self.head(features)


class ArgMax(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.argmax(dim=-1)


def test_outputs_without_grad_and_calls_that_never_get_a_gradient(tmp_path: Path) -> None:
    model, twin = pair(FrozenPrefixNet)
    generator = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(0, 10, (8, 5), generator=generator), torch.randn(8, 1, generator=generator))
        for _ in range(5)
    ]
    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)

    seen = observations(report)
    for name in ("embed", "backbone", "head"):
        assert seen[act(name)] == 5
    # head's call 0 (the side computation) never reaches the loss; call 1 does.
    assert seen[act("head", 1)] == 5
    assert grad("embed") not in seen and grad("backbone") not in seen
    assert grad("head", 0) not in seen, "the side call that never got a gradient has one"
    assert seen[grad("head", 1)] == 5
    coverage = report["coverage"]
    assert coverage["backward_samples_observed"] == 5
    assert sum(coverage["tensors_skipped"].values()) == 5  # the argmax, once per forward
    assert coverage["errors_total"] == 0 and report["errors"] == []


class Token(nn.Module):
    """Returns its own Parameter: the module output is a leaf tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 6))

    def forward(self) -> Tensor:
        return self.token


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = Token()
        self.fc = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x + self.token())


def test_module_returning_its_parameter_gets_one_gradient_per_sample(tmp_path: Path) -> None:
    model, twin = pair(TokenNet)
    data = make_batches(20, features=6)
    attach(model, tmp_path)
    losses = fit(model, data)
    hooks_during = len(model.token.token._backward_hooks or {})
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    coverage = report["coverage"]
    assert coverage["backward_samples_observed"] == 20
    assert observations(report)[grad("token")] == 20
    assert coverage["repeated_backward_gradients"] == 0
    assert hooks_during <= 1
    assert not model.token.token._backward_hooks, "hooks left on the Parameter after removal"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 12)
        self.act = nn.Tanh()
        self.out = nn.Linear(12, 12)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.act(self.lin(x)))


class CheckpointNet(nn.Module):
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


CKPT_NAMES = ("", "inp", "block.lin", "block.act", "block.out", "head")


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_blocks_are_one_call_with_their_gradients(tmp_path: Path, mode: str) -> None:
    model, twin = pair(lambda: CheckpointNet(mode))
    plain = copy.deepcopy(model)
    plain.mode = None
    reference = Reference(plain, CKPT_NAMES)
    data = make_batches(5, features=6)

    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))

    coverage = report["coverage"]
    assert coverage["samples_observed"] == 5
    assert coverage["backward_samples_observed"] == 5
    # Reentrant: every recomputed call (block, lin, act, out) carries the gradients of
    # its sample, none is ignored. Non-reentrant: PyTorch stops recomputing once the
    # saved tensors are back (lin's input, tanh's output), so lin and act are recomputed
    # and ignored at each of the 5 backwards.
    assert coverage["recompute_calls_ignored"] == (0 if mode == "reentrant" else 10)
    seen = observations(report)
    assert all(key[1] == 0 for key in seen), "a recomputation became a second call"
    assert all(count == 5 for count in seen.values()), seen
    for name in ("block.lin", "block.act", "block.out"):
        assert grad(name) in seen, f"no gradient telemetry inside the checkpoint: {name}"
    check_against_reference(report, reference)
    assert coverage["errors_total"] == 0


def root_checkpoint_step(reentrant: bool) -> Step:
    def step(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        prediction = checkpoint(model, x.requires_grad_(), use_reentrant=reentrant)
        loss = nn.functional.mse_loss(prediction, y)
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize(
    "reentrant",
    [
        pytest.param(
            True,
        ),
        False,
    ],
    ids=["reentrant", "non_reentrant"],
)
def test_checkpointed_root_is_one_sample_per_step(tmp_path: Path, reentrant: bool) -> None:
    model, twin = pair(MLP)
    plain = copy.deepcopy(model)
    reference = Reference(plain, MLP_NAMES)
    data = make_batches(4, features=6)
    step = root_checkpoint_step(reentrant)

    attach(model, tmp_path)
    losses = fit(model, data, step)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data, step)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))

    coverage = report["coverage"]
    assert coverage["samples_observed"] == 4
    assert coverage["backward_samples_observed"] == 4
    assert coverage["eval_forwards_skipped"] == 0
    seen = observations(report)
    assert all(key[1] == 0 for key in seen) and all(n == 4 for n in seen.values()), seen
    check_against_reference(report, reference)


class ReusedInCheckpoint(nn.Module):
    """One Linear called three times inside a checkpointed function."""

    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.cell = nn.Linear(12, 12)
        self.head = nn.Linear(12, 1)
        self.mode = mode

    def unrolled(self, h: Tensor) -> Tensor:
        for _ in range(3):
            h = torch.tanh(self.cell(h))
        return h

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        if self.mode is None:
            h = self.unrolled(h)
        else:
            h = checkpoint(self.unrolled, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(
            "reentrant",
        ),
        "non_reentrant",
    ],
)
def test_module_reused_inside_a_checkpoint_keeps_per_call_gradients(
    tmp_path: Path, mode: str
) -> None:
    model, twin = pair(lambda: ReusedInCheckpoint(mode))
    plain = copy.deepcopy(model)
    plain.mode = None
    reference = Reference(plain, ["inp", "cell", "head"])
    data = make_batches(3, features=6)

    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))
    assert {key[1] for key in observations(report) if key[0] == "cell"} == {0, 1, 2}
    check_against_reference(report, reference)


class Recurrent(nn.Module):
    """A cell reused four times per forward, and an aux module whose 2nd call is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.cell = nn.Linear(8, 8)
        self.aux = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for _ in range(4):
            h = torch.tanh(self.cell(h))
        h = h + self.aux(h)
        self.aux(h.detach())  # a probe whose result is dropped
        return self.head(h)


def test_reused_module_gets_call_indices_and_its_own_gradients(tmp_path: Path) -> None:
    model, twin = pair(Recurrent)
    plain = copy.deepcopy(model)
    reference = Reference(plain, ["inp", "cell", "aux", "head"])
    data = make_batches(6, features=6)

    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))

    seen = observations(report)
    for signal in ("activation", "grad_output"):
        calls = {key[1] for key in seen if key[0] == "cell" and key[2] == signal}
        assert calls == {0, 1, 2, 3}, (signal, calls)
    assert act("aux", 1) in seen and grad("aux", 1) not in seen
    assert all(count == 6 for count in seen.values()), seen
    check_against_reference(report, reference)
    cells = {value(report, grad("cell", call)) for call in range(4)}
    assert len(cells) == 4, "the calls of the reused cell share one gradient series"


def twice_backward_step(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    (loss * 0.5).backward()  # a second backward over the same graph
    return loss


def test_several_backward_passes_over_one_graph(tmp_path: Path) -> None:
    """Expected: the sample's output gradient is the total over the backward passes
    (1.5 times the first pass's here); later passes are counted as
    ``repeated_backward_gradients`` (one per observed output tensor) and summed."""
    model, twin = pair(MLP)
    plain = copy.deepcopy(model)
    reference = Reference(plain, MLP_NAMES, total_gradients=True)
    data = make_batches(4, features=6)

    attach(model, tmp_path)
    losses = fit(model, data, twice_backward_step)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data, twice_backward_step)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference, twice_backward_step))

    coverage = report["coverage"]
    assert coverage["samples_observed"] == 4
    assert coverage["backward_samples_observed"] == 4
    # One per measured output gradient and sample: the root's is fc2's (the same tensor,
    # measured once and shared), so 3 of the 4 modules have a hook that fires again.
    assert coverage["repeated_backward_gradients"] == 4 * (len(MLP_NAMES) - 1)
    assert coverage["backward_gradients_summed"] == coverage["repeated_backward_gradients"]
    assert all(count == 4 for count in observations(report).values())
    check_against_reference(report, reference)


class Fragile(nn.Module):
    """Raises half-way through the forward (after fc1 and two cell calls) when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.cell = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 1)
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        for call in range(3):
            h = torch.tanh(self.cell(h))
            if self.fail and call == 1:
                raise RuntimeError("data error half-way through the forward")
        return self.fc2(h)


@pytest.mark.parametrize("direct", [False, True], ids=["hooks", "capture_direct_forwards"])
def test_forward_that_raises_half_way_leaves_no_stuck_state(tmp_path: Path, direct: bool) -> None:
    model, twin = pair(Fragile)
    data = make_batches(6, features=6)
    failing = {2, 4}

    calls: dict[int, int] = {}  # per model: steps run so far

    def step(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        assert isinstance(m, Fragile)
        index = calls[id(m)] = calls.get(id(m), -1) + 1
        if index in failing:
            m.fail = True
            with pytest.raises(RuntimeError, match="half-way"):
                m(x)
            m.fail = False
            m.eval()  # an eval forward right after the failure must be skipped
            with torch.no_grad():
                m(x)
            m.train()
        return mse_step(m, x, y)

    attach(model, tmp_path, capture_direct_forwards=direct)
    losses = fit(model, data, step)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data, step)
    assert_same_model(model, twin)

    seen = observations(report)
    assert {key[1] for key in seen if key[0] == "cell"} == {0, 1, 2}, sorted(seen)
    assert {key[1] for key in seen if key[0] != "cell"} == {0}, sorted(seen)
    coverage = report["coverage"]
    assert coverage["eval_forwards_skipped"] == len(failing)
    assert coverage["backward_samples_observed"] == 6
    for key in (act("<root>"), grad("<root>"), act("fc2"), grad("fc2"), grad("fc1")):
        assert seen[key] == 6, key
    assert 6 <= seen[act("fc1")] <= 6 + len(failing)
    assert coverage["errors_total"] == 0


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 12), nn.Tanh())
        self.head = nn.Linear(12, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x))


WRAPPER_NAMES = ("encoder.0", "encoder.1", "head")


def styled_step(style: str) -> Step:
    def step(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        assert isinstance(model, Wrapper)
        if style == "call":
            prediction = model(x)
        elif style == "forward":
            prediction = model.forward(x)
        elif style == "submodules":
            prediction = model.head(model.encoder(x))
        else:  # "submodule_forwards": every module's forward called directly
            prediction = model.head.forward(model.encoder.forward(x))
        loss = nn.functional.mse_loss(prediction, y)
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize("style", ["forward", "submodules"])
def test_direct_calls_without_wrappers_are_observed_once(tmp_path: Path, style: str) -> None:
    model, twin = pair(Wrapper)
    plain = copy.deepcopy(model)
    reference = Reference(plain, ["encoder.0", "head"])
    data = make_batches(5, features=6)

    attach(model, tmp_path)
    losses = fit(model, data, styled_step(style))
    report = finish(model, tmp_path)
    assert losses == fit(twin, data, styled_step(style))
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))
    seen = observations(report)
    assert {key[1] for key in seen} == {0}
    for name in ("encoder.0", "head"):
        assert seen[act(name)] == 5 and seen[grad(name)] == 5
    check_against_reference(report, reference)


def test_capture_direct_forwards_observes_each_call_exactly_once(tmp_path: Path) -> None:
    model, twin = pair(Wrapper)
    plain = copy.deepcopy(model)
    reference = Reference(plain, WRAPPER_NAMES)
    styles = ["call", "forward", "submodules", "submodule_forwards"] * 2
    data = make_batches(len(styles), features=6)
    # Instance attributes that must come back as they were.
    previous = nn.Tanh.forward.__get__(model.encoder[1])
    model.encoder[1].forward = previous  # type: ignore[method-assign]
    before = instance_attributes(model)
    hooks_before = hook_counts(model)

    calls: dict[int, int] = {}  # per model: steps run so far

    def step(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        index = calls[id(m)] = calls.get(id(m), -1) + 1
        return styled_step(styles[index])(m, x, y)

    attach(model, tmp_path, capture_direct_forwards=True)
    losses = fit(model, data, step)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data, step)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))

    seen = observations(report)
    assert {key[1] for key in seen} == {0}, "a call was observed twice within one forward"
    for name in WRAPPER_NAMES:
        assert seen[act(name)] == len(styles), name
        assert seen[grad(name)] == len(styles), name
    through_root = styles.count("call") + styles.count("forward")
    assert seen[act("<root>")] == through_root
    assert report["coverage"]["samples_observed"] == len(styles)
    check_against_reference(report, reference)
    assert instance_attributes(model) == before
    assert model.encoder[1].__dict__["forward"] is previous
    assert hook_counts(model) == hooks_before


def test_stale_wrapped_forward_does_not_feed_a_removed_observer(tmp_path: Path) -> None:
    model = MLP()
    handle = attach(model, tmp_path, capture_direct_forwards=True)
    forward = model.forward
    forward(torch.randn(4, 6)).sum().backward()
    remove_observer(model)
    before = handle.report()["coverage"]["forwards_seen"]
    forward(torch.randn(4, 6)).sum().backward()
    assert handle.report()["coverage"]["forwards_seen"] == before


def test_removal_keeps_a_forward_assigned_after_injection(tmp_path: Path) -> None:
    model = MLP()
    attach(model, tmp_path, capture_direct_forwards=True)
    inner = model.forward

    def patched(x: Tensor) -> Tensor:
        return inner(x) * 1.0

    model.forward = patched  # type: ignore[method-assign]
    remove_observer(model)
    assert model.__dict__.get("forward") is patched


class Threaded(nn.Module):
    """Runs two branches in worker threads, then a third alone in one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)
        self.merge = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        with ThreadPoolExecutor(max_workers=2) as pool:
            left, right = pool.map(lambda branch: torch.tanh(branch(h)), [self.left, self.right])
            merged = pool.submit(self.merge, left + right).result()
        return merged


def test_worker_threads_inside_a_root_forward_are_attributed(tmp_path: Path) -> None:
    model, twin = pair(Threaded)
    plain = copy.deepcopy(model)
    reference = Reference(plain, ["inp", "left", "right", "merge"])
    data = make_batches(5, features=6)

    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))
    seen = observations(report)
    assert {key[1] for key in seen} == {0}
    for name in ("left", "right", "merge"):
        assert seen[act(name)] == 5 and seen[grad(name)] == 5, name
    assert report["coverage"]["samples_observed"] == 5
    assert report["coverage"]["errors_total"] == 0
    check_against_reference(report, reference)


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_evaluation_is_kept_out_of_the_training_series(tmp_path: Path) -> None:
    model, twin = pair(DropNet)
    data = make_batches(6, features=6)
    probe = torch.randn(8, 6, generator=torch.Generator().manual_seed(9))
    evaluations: dict[int, list[Tensor]] = {id(model): [], id(twin): []}

    def step(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        assert isinstance(m, DropNet)
        loss = mse_step(m, x, y)
        outputs = evaluations[id(m)]
        with torch.no_grad():  # no_grad, training mode
            outputs.append(m(probe))
        m.eval()
        with torch.no_grad():
            outputs.append(m(probe))
        with torch.inference_mode():
            outputs.append(m(probe).clone())
        saliency = probe.clone().requires_grad_()
        m(saliency).sum().backward()  # model.eval() with gradients (a saliency map)
        assert saliency.grad is not None
        outputs.append(saliency.grad)
        with torch.no_grad():
            outputs.append(m.fc1(probe))  # a submodule called directly
        m.train()
        with torch.inference_mode():  # inference_mode, training mode
            outputs.append(m(probe).clone())
        return loss

    torch.manual_seed(5)
    attach(model, tmp_path)
    losses = fit(model, data, step)
    report = finish(model, tmp_path)
    torch.manual_seed(5)
    assert losses == fit(twin, data, step)
    assert_same_model(model, twin)
    assert all(
        torch.equal(a, b)
        for a, b in zip(evaluations[id(model)], evaluations[id(twin)], strict=True)
    )
    coverage = report["coverage"]
    assert coverage["eval_forwards_skipped"] == 5 * len(data)
    assert coverage["samples_observed"] == len(data)
    assert coverage["backward_samples_observed"] == len(data)
    assert all(count == len(data) for count in observations(report).values())
    assert coverage["errors_total"] == 0


# ============================================================================ 2. values
@pytest.mark.parametrize(
    ("dtype", "scale", "loss_scale"),
    [
        (torch.float16, 65000.0, 1e-4),  # near float16's maximum
        (torch.float16, 1e-4, 1e3),  # float16 subnormals
        (torch.bfloat16, 3.3e38, 1e-38),  # near bfloat16's maximum
        (torch.float64, 1e300, 1e-300),
        (torch.float64, 1e-300, 1e300),
        (torch.float32, 1e30, 1e-30),
        (torch.float32, 1e-30, 1e30),
    ],
    ids=["f16-max", "f16-tiny", "bf16-max", "f64-1e300", "f64-1e-300", "f32-1e30", "f32-1e-30"],
)
def test_statistics_are_finite_and_exact_in_every_dtype(
    tmp_path: Path, dtype: torch.dtype, scale: float, loss_scale: float
) -> None:
    check_cast_statistics(tmp_path, dtype, scale, loss_scale)


class ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.spectrum = Spectrum()
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.spectrum(self.fc(x)).abs())


class Spectrum(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.fft.fft(x, dim=-1)


def test_complex_outputs_are_reduced_by_magnitude_or_skipped_and_counted(tmp_path: Path) -> None:
    model, twin = pair(ComplexNet)
    plain = copy.deepcopy(model)
    reference = Reference(plain, ["spectrum"])
    data = make_batches(4, features=6)
    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    fit(plain, data, referenced_step(reference))
    assert report["coverage"]["errors_total"] == 0
    if act("spectrum") in series(report):
        check_against_reference(report, reference)  # by magnitude
    else:
        assert any("complex" in reason for reason in report["coverage"]["tensors_skipped"])


class Huge(nn.Module):
    """``numel`` values repeating 1, -1, 3, -3: rms sqrt(5), mean_abs 2, kurtosis -1.36."""

    def __init__(self, numel: int, nan: bool = False) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        base = torch.tensor([1.0, -1.0, 3.0, -3.0]).repeat(numel // 4)
        if nan:
            base[7] = float("nan")
        self.register_buffer("base", base)

    def forward(self) -> Tensor:
        return self.base * self.gain


class HugeNet(nn.Module):
    def __init__(self, numel: int, nan: bool = False) -> None:
        super().__init__()
        self.big = Huge(numel, nan)

    def forward(self, x: Tensor) -> Tensor:
        return self.big().nan_to_num().mean() * x.sum()


HUGE_RMS, HUGE_MEAN_ABS, HUGE_KURTOSIS = math.sqrt(5.0), 2.0, 41.0 / 25.0 - 3.0


def test_activation_of_more_than_2_pow_24_elements(tmp_path: Path) -> None:
    numel = 2**24 + 4
    model = HugeNet(numel)
    attach(model, tmp_path)
    model(torch.ones(1)).backward()
    report = finish(model, tmp_path)
    assert value(report, act("big")) == pytest.approx(HUGE_RMS, rel=1e-4)
    assert value(report, grad("big")) == pytest.approx(1.0 / numel, rel=1e-4)
    assert report["coverage"]["errors_total"] == 0


def test_huge_activation_with_a_non_finite_value(tmp_path: Path) -> None:
    """Past 2**25 elements, with one NaN (the masked reduction path)."""
    numel = 3 * 2**24
    model = HugeNet(numel, nan=True)
    attach(model, tmp_path)
    model(torch.ones(1))  # a training forward; the activation is what is checked here
    report = finish(model, tmp_path)
    assert value(report, act("big")) == pytest.approx(HUGE_RMS, rel=1e-4)
    assert value(report, act("big"), metric="nonfinite_fraction") == pytest.approx(
        1 / numel, rel=1e-4
    )
    assert report["coverage"]["errors_total"] == 0
    # Only rms reaches the report for every series: check the other metrics directly.
    metrics = finish_statistics(cpu_statistics(model.big.base))
    assert metrics["rms"] == pytest.approx(HUGE_RMS, rel=1e-4)
    assert metrics["mean_abs"] == pytest.approx(HUGE_MEAN_ABS, rel=1e-4)
    assert metrics["max_abs"] == 3.0
    assert metrics["excess_kurtosis"] == pytest.approx(HUGE_KURTOSIS, abs=1e-3)
    assert metrics["zero_fraction"] == 0.0


class ManyKinds(nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {
            "float": x * 2,
            "empty": x[:0],
            "integer": x.long(),
            "bool": x > 0,
            "sparse": x.detach().to_sparse(),
            "meta": torch.empty(3, device="meta"),
        }


class KindsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.kinds = ManyKinds()
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.kinds(self.fc(x))["float"])


def test_empty_integer_bool_sparse_and_meta_tensors_are_skipped_and_counted(
    tmp_path: Path,
) -> None:
    model, twin = pair(KindsNet)
    data = make_batches(3, features=6)
    attach(model, tmp_path)
    losses = fit(model, data)
    report = finish(model, tmp_path)
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    skipped = report["coverage"]["tensors_skipped"]
    assert sum(skipped.values()) == 5 * len(data), skipped
    for kind in ("empty", "sparse", "meta"):
        assert any(kind in reason for reason in skipped), (kind, skipped)
    paths = {key[3] for key in series(report) if key[0] == "kinds"}
    assert paths == {"output['float']"}
    assert report["coverage"]["errors_total"] == 0


# ========================================================================= 3. lifecycle
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


@pytest.mark.parametrize(
    "order",
    [
        "inject_then_compile",
        "compile_then_inject",
        pytest.param(
            "compile_train_then_inject",
        ),
    ],
)
def test_torch_compile_before_and_after_injection(tmp_path: Path, order: str) -> None:
    torch._dynamo.reset()
    model, twin = pair(CompileNet)
    data = make_batches(7, features=6)
    twin_compiled = cast(nn.Module, torch.compile(twin, backend="eager"))
    if order == "inject_then_compile":
        attach(model, tmp_path)
    compiled = cast(nn.Module, torch.compile(model, backend="eager"))
    if order == "compile_train_then_inject":
        fit(compiled, data[:1])
        fit(twin_compiled, data[:1])
    if order != "inject_then_compile":
        attach(model, tmp_path)
    losses = fit(compiled, data[1:5])
    report = finish(model, tmp_path)
    assert losses == fit(twin_compiled, data[1:5])
    assert_same_model(model, twin)
    assert fit(compiled, data[5:]) == fit(twin_compiled, data[5:])  # after removal
    assert_same_model(model, twin)
    torch._dynamo.reset()
    seen = observations(report)
    for name in ("fc1", "act", "fc2"):
        assert seen.get(act(name)) == 4 and seen.get(grad(name)) == 4, (name, sorted(seen))
    assert report["coverage"]["errors_total"] == 0


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


# ================================================== 4. mixed precision and accumulation
AMP_STEPS = 36


def amp_run(model: nn.Module, data: Sequence[Batch], *, scaled: bool) -> tuple[list[float], float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**6, growth_factor=4.0, growth_interval=9, enabled=scaled
    )
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss.detach()))
    return losses, scaler.get_scale() if scaled else 1.0


def test_grad_scaler_with_bf16_autocast_reports_unscaled_gradients(tmp_path: Path) -> None:
    data = make_batches(AMP_STEPS, features=6)
    track = TrackConfig(warmup_samples=6)
    torch.manual_seed(1)
    unscaled = MLP()
    scaled, twin = copy.deepcopy(unscaled), copy.deepcopy(unscaled)
    attach(unscaled, tmp_path / "plain", track_config=track)
    amp_run(unscaled, data, scaled=False)
    plain_report = finish(unscaled, tmp_path / "plain")
    attach(scaled, tmp_path / "scaled", track_config=track)
    losses, final_scale = amp_run(scaled, data, scaled=True)
    scaled_report = finish(scaled, tmp_path / "scaled")
    assert final_scale == 2.0**6 * 4.0**4, "test premise: the loss scale grew four times"
    assert losses == amp_run(twin, data, scaled=True)[0]
    assert_same_model(scaled, twin)
    assert_same_model(scaled, unscaled)  # power-of-two scaling is exact

    assert scaled_report["coverage"]["loss_scaled_samples"] == AMP_STEPS
    assert scaled_report["coverage"]["backward_samples_observed"] == AMP_STEPS
    compared = 0
    scaled_series = series(scaled_report)
    for key, finding in series(plain_report).items():
        if key[2] != "grad_output" or key[0] == "<model>":
            continue
        for point in ("first", "latest", "min", "max"):
            expected = finding[point]["value"]
            got = scaled_series[key][point]["value"]
            assert got == pytest.approx(expected, rel=1e-3), (key, point, got, expected)
            compared += 1
    assert compared == 4 * len(MLP_NAMES)  # every output-gradient series

    def notable(report: Report) -> set[tuple[str, str, int, str, str]]:
        return {
            (f["category"], f["module"], f["call_index"], f["signal"], f["metric"])
            for f in report["findings"]
            if f["notable"] and f["module"] != "<model>"
        }

    assert notable(scaled_report) == notable(plain_report), "loss scaling shows as a finding"
    # The loss scale itself is reported once, as a model-wide <model> event (docs/report.md).
    assert [f["notable"] for f in scaled_report["findings"] if f["module"] == "<model>"] == [False]


def scaled_accumulation(style: str, scaled: bool) -> Callable[[nn.Module], list[float]]:
    """4 micro-batches per optimizer step under GradScaler.

    ``interleaved``: forward, scaled backward, forward, ...; ``forwards_first``: 4 forwards,
    then a scaled backward of each loss; ``summed``: one scaled backward of the summed loss.
    """

    def run(model: nn.Module) -> list[float]:
        data = make_batches(8, features=6)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
        losses = []
        for start in range(0, len(data), 4):
            optimizer.zero_grad()
            chunk: list[Tensor] = []
            for x, y in data[start : start + 4]:
                chunk.append(nn.functional.mse_loss(model(x), y) / 4)
                if style == "interleaved":
                    scaler.scale(chunk[-1]).backward()
            if style == "forwards_first":
                for loss in chunk:
                    scaler.scale(loss).backward()
            elif style == "summed":
                scaler.scale(torch.stack(chunk).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            losses += [float(loss.detach()) for loss in chunk]
        return losses

    return run


LATEST_SAMPLE_ONLY = ()  # fixed; kept so the parametrisations read the same


@pytest.mark.parametrize(
    "style",
    [
        "interleaved",
        pytest.param("forwards_first", marks=LATEST_SAMPLE_ONLY),
        pytest.param("summed", marks=LATEST_SAMPLE_ONLY),
    ],
)
def test_grad_scaler_with_gradient_accumulation(tmp_path: Path, style: str) -> None:
    torch.manual_seed(1)
    plain = MLP()
    scaled, twin = copy.deepcopy(plain), copy.deepcopy(plain)
    attach(plain, tmp_path / "plain")
    scaled_accumulation(style, scaled=False)(plain)
    plain_report = finish(plain, tmp_path / "plain")
    attach(scaled, tmp_path / "scaled")
    losses = scaled_accumulation(style, scaled=True)(scaled)
    scaled_report = finish(scaled, tmp_path / "scaled")
    assert losses == scaled_accumulation(style, scaled=True)(twin)
    assert_same_model(scaled, twin)
    assert_same_model(scaled, plain)  # power-of-two scaling is exact
    assert scaled_report["coverage"]["backward_samples_observed"] == 8
    scaled_series = series(scaled_report)
    for key, finding in series(plain_report).items():
        if key[2] == "grad_output":
            for point in ("first", "latest", "min", "max"):
                got, expected = scaled_series[key][point]["value"], finding[point]["value"]
                assert got == pytest.approx(expected, rel=1e-4), (key, point, got, expected)


def test_grad_scaler_overflow_and_backoff_is_not_a_module_finding(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = MLP()
    twin = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(16, 6, generator=generator), 100 * torch.randn(16, 1, generator=generator))
        for _ in range(20)
    ]
    finite_activations = []

    def check(module: nn.Module, args: Any, output: Tensor) -> None:
        finite_activations.append(bool(torch.isfinite(output).all()))

    for module in model.modules():
        module.register_forward_hook(check)

    def run(m: nn.Module) -> tuple[list[float], float]:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
        losses = []
        for x, y in data:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(float(loss.detach()))
        return losses, scaler.get_scale()

    attach(model, tmp_path)
    losses, final_scale = run(model)
    report = finish(model, tmp_path)
    assert (losses, final_scale) == run(twin)
    assert_same_model(model, twin)
    assert final_scale < 2.0**127, "test premise: the scale overflowed and backed off"
    assert all(finite_activations), "test premise: only the scaled gradients overflow"
    assert not [
        (f["module"], f["signal"])
        for f in report["findings"]
        if f["category"] == "non_finite" and f["notable"] and f["module"] != "<model>"
    ]


def accumulate_step(micro: int) -> Callable[[nn.Module, Sequence[Batch]], list[float]]:
    """k backward passes per optimizer step."""

    def run(model: nn.Module, data: Sequence[Batch]) -> list[float]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for start in range(0, len(data), micro):
            optimizer.zero_grad()
            for x, y in data[start : start + micro]:
                loss = nn.functional.mse_loss(model(x), y) / micro
                loss.backward()
                losses.append(float(loss.detach()))
            optimizer.step()
        return losses

    return run


def summed_step(micro: int) -> Callable[[nn.Module, Sequence[Batch]], list[float]]:
    """k forwards, one backward of the summed loss, per optimizer step."""

    def run(model: nn.Module, data: Sequence[Batch]) -> list[float]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for start in range(0, len(data), micro):
            optimizer.zero_grad()
            chunk = data[start : start + micro]
            loss = sum(nn.functional.mse_loss(model(x), y) for x, y in chunk) / micro
            assert isinstance(loss, Tensor)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    return run


@pytest.mark.parametrize(
    ("style", "micro"),
    [
        ("backward_per_micro_batch", 4),
        ("backward_per_micro_batch", 12),
        ("one_summed_backward", 4),
        pytest.param(
            "one_summed_backward",
            12,
        ),
    ],
)
def test_gradient_accumulation_is_observed_whole(tmp_path: Path, style: str, micro: int) -> None:
    run = accumulate_step(micro) if style == "backward_per_micro_batch" else summed_step(micro)
    model, twin = pair(MLP)
    plain = copy.deepcopy(model)
    data = make_batches(2 * micro, features=6)
    reference = Reference(plain, MLP_NAMES)
    attach(model, tmp_path)
    losses = run(model, data)
    report = finish(model, tmp_path)
    assert losses == run(twin, data)
    assert_same_model(model, twin)

    reference.start()
    nn.functional.mse_loss(plain(data[0][0]), data[0][1]).backward()
    coverage = report["coverage"]
    assert coverage["samples_observed"] == len(data)
    assert coverage["backward_samples_observed"] == len(data)
    assert coverage["repeated_backward_gradients"] == 0
    assert all(count == len(data) for count in observations(report).values())
    # The first micro-batch's gradients, net of the loss gradient (the 1/k factor cancels).
    first = reference.steps[0]
    ratio = value(report, grad("fc1"), point="first") / value(report, grad("<root>"), point="first")
    assert ratio == pytest.approx(
        first[("fc1", 0)]["grad_output"] / first[("", 0)]["grad_output"], rel=1e-4
    )


# ====================================================== 5. bad input, bad environments
# (argument, given value, what the message must say is expected, how it must show the value)
BAD_ARGUMENTS: list[Any] = [
    ("sampling", -3, "an int >= 1", "-3"),
    ("sampling", True, "an int >= 1", "True"),
    ("rank_policy", "everyone", "one of", "'everyone'"),
    ("rank_policy", None, "one of", "None"),
    ("capture_direct_forwards", "yes", "a bool", "'yes'"),
    ("write_files", 0, "a bool", "0"),
    ("output_dir", None, "a non-empty path", "None"),
    ("output_dir", 42, "a non-empty path", "42"),
    ("include", 7, "glob pattern", "7"),
    ("include", ["ok", 3], "glob pattern", "['ok', 3]"),
    ("exclude", b"fc*", "glob pattern", "b'fc*'"),
    ("module_types", "Linear", "nn.Module subclass", "'Linear'"),
    ("module_types", [], "nn.Module subclass", "[]"),
    ("sinks", [object()], "write", "<object object"),
]
TYPE_NAMES_ONLY = ()  # fixed; kept so the parametrisations read the same
BAD_ARGUMENTS += [
    pytest.param("sampling", 1.5, "an int >= 1", "1.5", marks=TYPE_NAMES_ONLY),
    pytest.param("sampling", "often", "an int >= 1", "'often'", marks=TYPE_NAMES_ONLY),
    pytest.param("report_config", 5, "ReportConfig", "5", marks=TYPE_NAMES_ONLY),
    pytest.param("track_config", "fast", "TrackConfig", "'fast'", marks=TYPE_NAMES_ONLY),
    pytest.param(
        "sinks",
        None,
        "sink",
        "None",
    ),
]


@pytest.mark.parametrize(("name", "given", "expected", "shown"), BAD_ARGUMENTS)
def test_invalid_argument_names_argument_expected_and_given(
    tmp_path: Path, name: str, given: object, expected: str, shown: str
) -> None:
    model = MLP()
    hooks, attributes = hook_counts(model), instance_attributes(model)
    options: dict[str, Any] = {"output_dir": tmp_path, name: given}
    with pytest.raises(ConfigError) as caught:
        inject_observer(model, **options)
    message = str(caught.value)
    named = name if name != "sinks" else "sink"  # "each sink needs ..." names it
    assert named in message and expected in message, message
    assert shown in message, f"given value {given!r} not shown in {message!r}"
    # Nothing was attached and the directory is not taken.
    assert hook_counts(model) == hooks and instance_attributes(model) == attributes
    assert observer_of(model) is None
    inject_observer(model, output_dir=tmp_path).remove()


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ReportConfig(max_bytes=100), "max_bytes"),
        (lambda: ReportConfig(top_k_per_category=0), "top_k_per_category"),
        (lambda: ReportConfig(rewrite_interval_s=float("nan")), "rewrite_interval_s"),
        (lambda: TrackConfig(warmup_samples=1), "warmup_samples"),
        (lambda: TrackConfig(fast_ema_alpha=1.5), "fast_ema_alpha"),
        (lambda: TrackConfig(max_series=0), "max_series"),
        (lambda: DefaultSampling(samples_per_stage=0), "samples_per_stage"),
        (lambda: EveryNSampling(0), "n"),
    ],
)
def test_invalid_config_fields_name_field_expected_and_given(
    build: Callable[[], object], field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"\.{field} must be .*, got "):
        build()


def write_failures(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "could not write its report" in str(w.message)]


def test_unwritable_output_directory_never_stops_training(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be", encoding="utf-8")
    directory = blocker / "stats"  # cannot be created (root can write anywhere else)
    model, twin = pair(MLP)
    data = make_batches(6, features=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = attach(model, directory, report_config=ReportConfig(rewrite_interval_s=1e-6))
        losses = fit(model, data)  # a write is attempted at every forward
        assert handle.flush() is not None
        assert len(write_failures(caught)) == 1, [str(w.message) for w in caught]
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    current = handle.report()
    assert current["coverage"]["errors_total"] >= 7
    assert any(e.get("stage") == "write" for e in current["errors"]), current["errors"]

    blocker.unlink()  # the directory becomes writable: the next write succeeds
    handle.flush()
    report = read(directory)
    assert report["coverage"]["samples_observed"] == 6
    remove_observer(model)
    assert read(directory)["coverage"]["errors_total"] >= 7


def test_full_disk_is_retried_and_warned_once(tmp_path: Path, monkeypatch: Any) -> None:
    real_replace = os.replace
    full = {"on": True}

    def replace(source: Any, target: Any) -> None:
        if full["on"] and str(tmp_path) in str(target):
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    model, twin = pair(MLP)
    data = make_batches(4, features=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = attach(model, tmp_path, report_config=ReportConfig(rewrite_interval_s=1e-6))
        losses = fit(model, data)
        handle.flush()
        full["on"] = False
        handle.flush()
        remove_observer(model)
    assert len(write_failures(caught)) == 1
    assert losses == fit(twin, data)
    assert_same_model(model, twin)
    report = read(tmp_path)
    assert report["coverage"]["errors_total"] >= 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.md", "report.json", "series.json"]


def same_directory_spellings(base: Path) -> Iterator[tuple[str, Path]]:
    yield "dotdot", base / ".." / base.name
    yield "trailing_dot", base / "."
    link = base.parent / f"{base.name}-link"
    link.symlink_to(base, target_is_directory=True)
    yield "symlink", link


def test_shared_report_directory_is_refused_however_spelled(
    tmp_path: Path, monkeypatch: Any
) -> None:
    base = tmp_path / "stats"
    base.mkdir()
    first = MLP()
    inject_observer(first, output_dir=base)
    for label, spelling in same_directory_spellings(base):
        other = MLP()
        with pytest.raises(ObserverStateError, match="already used"):
            inject_observer(other, output_dir=spelling)
        assert observer_of(other) is None, label
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ObserverStateError, match="already used"):
        inject_observer(MLP(), output_dir="stats")  # relative spelling
    # rank_policy="all" writes rank-000/ under it: separated, never interleaved.
    separate = MLP()
    inject_observer(separate, output_dir=base, rank_policy="all")
    first(torch.randn(2, 6)).sum().backward()
    separate(torch.randn(2, 6)).sum().backward()
    remove_observer(separate)
    remove_observer(first)
    assert read(base)["coverage"]["forwards_seen"] == 1
    assert read(base / "rank-000")["coverage"]["forwards_seen"] == 1
