"""Capture semantics of hook instrumentation: what one module call, one output gradient
and one sample are under in-place operations, checkpointing, reuse, several backward
passes, forwards that raise, direct calls, threads, evaluation and gradient accumulation.

Where training runs, it is compared with an uninstrumented twin (same seed, same data)
and must be bit-identical; reported values are checked against a hand-computed float64
reference on the twin (``tests.harness.Reference``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.harness import (
    MLP,
    MLP_NAMES,
    Batch,
    Reference,
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
    make_batches,
    mse_step,
    observations,
    observe_against_twin,
    pair,
    referenced_step,
    value,
)
from tests.harness.scenarios import CheckpointNet
from torchinstruments import (
    remove_observer,
)


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
    def for_reference(plain: Any) -> None:
        plain.act.inplace = False
        plain.inplace = False  # the same function without in-place ops, for the reference

    data = make_batches(4, features=6)
    report, reference = observe_against_twin(
        InplaceNet, ["fc1", "act", "fc2", "fc3"], data, tmp_path, plain=for_reference
    )
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


CKPT_NAMES = ("", "inp", "block.lin", "block.act", "block.out", "head")


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_blocks_are_one_call_with_their_gradients(tmp_path: Path, mode: str) -> None:
    def for_reference(plain: Any) -> None:
        plain.mode = None

    data = make_batches(5, features=6)
    report, reference = observe_against_twin(
        lambda: CheckpointNet(mode), CKPT_NAMES, data, tmp_path, plain=for_reference
    )

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
    data = make_batches(4, features=6)
    step = root_checkpoint_step(reentrant)
    report, reference = observe_against_twin(MLP, MLP_NAMES, data, tmp_path, step=step)

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
    def for_reference(plain: Any) -> None:
        plain.mode = None

    data = make_batches(3, features=6)
    report, reference = observe_against_twin(
        lambda: ReusedInCheckpoint(mode),
        ["inp", "cell", "head"],
        data,
        tmp_path,
        plain=for_reference,
    )
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
    data = make_batches(6, features=6)
    report, reference = observe_against_twin(
        Recurrent, ["inp", "cell", "aux", "head"], data, tmp_path
    )

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
    data = make_batches(4, features=6)
    report, reference = observe_against_twin(
        MLP,
        MLP_NAMES,
        data,
        tmp_path,
        step=twice_backward_step,
        plain_step=twice_backward_step,
        total_gradients=True,
    )

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
    data = make_batches(5, features=6)
    report, reference = observe_against_twin(
        Wrapper, ["encoder.0", "head"], data, tmp_path, step=styled_step(style)
    )
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
    data = make_batches(5, features=6)
    report, reference = observe_against_twin(
        Threaded, ["inp", "left", "right", "merge"], data, tmp_path
    )
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
