"""Hook parking: submodule hooks leave their modules during unsampled eager forwards.

Parking stops for good once ``torch.compile`` has compiled a frame in the process, which
the observer reads from Dynamo's counters. Other tests in the session compile, so each
test here starts those counters at zero (``fresh_dynamo``) and lets them count from there.
"""

from __future__ import annotations

import _thread
import contextlib
import copy
import functools
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest
import torch
import torch._dynamo.utils
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.harness import WIDE, forward_hook_counts, read_report, read_series, train_on_noise
from tests.harness.scenarios import CompileNet
from torchinstruments import EveryNSampling, compiled, inject_observer, remove_observer


class Probe(nn.Module):
    """Records how many forward hooks it carries while it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks_seen: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.hooks_seen.append(len(self._forward_hooks))
        return torch.tanh(x)


class Net(nn.Module):
    def __init__(self, fail_on: int = -1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.probe = Probe()
        self.fc2 = nn.Linear(12, 1)
        self.fail_on = fail_on
        self.calls = 0
        self.root_hooks_seen: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self.root_hooks_seen.append(len(self._forward_hooks))
        if self.calls - 1 == self.fail_on:
            raise RuntimeError("forward failed on purpose")
        return self.fc2(self.probe(self.fc1(x)))


class OddForwards:
    """Samples forwards 1, 3, 5, ...: the first forward is not sampled."""

    def should_sample(self, forward_index: int) -> bool:
        return forward_index % 2 == 1

    def describe(self) -> dict[str, object]:
        return {"policy": "odd_forwards"}


def train(model: nn.Module, steps: int, seed: int = 0) -> list[float]:
    """Backward only, no optimizer: :func:`~tests.harness.train_on_noise` on batches of 4."""
    return train_on_noise(model, steps, seed, rows=4, lr=None)


def findings(rows: list[dict], metric: str) -> dict[tuple[str, str], dict]:
    """``series.json`` rows of ``metric``, call 0, keyed by (module, signal)."""
    found: dict[tuple[str, str], dict] = {}
    for finding in rows:
        if finding["metric"] == metric and finding["call_index"] == 0:
            found.setdefault((finding["module"], finding["signal"]), finding)
    return found


def observations(rows: list[dict]) -> dict[tuple[str, str], int]:
    return {key: finding["observations"] for key, finding in findings(rows, "rms").items()}


def assert_observed_in_each_sample(directory: Path, names: tuple[str, ...], samples: int) -> None:
    """Each module of ``names``: activation and output gradient seen ``samples`` times."""
    seen = observations(read_series(directory))
    for name in names:
        assert seen[(name, "activation")] == samples, (name, seen)
        assert seen[(name, "grad_output")] == samples, (name, seen)


def test_unsampled_forwards_run_without_submodule_hooks(tmp_path: Path, fresh_dynamo) -> None:
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    before = forward_hook_counts(model)
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(3))
    attached = forward_hook_counts(model)
    losses = train(model, 7)
    assert forward_hook_counts(model) == attached  # forward 6 was sampled: every hook in place
    remove_observer(model)
    assert forward_hook_counts(model) == before
    assert losses == train(twin, 7)
    # Forwards 0, 3 and 6 are sampled: only then does the probe carry our hook.
    assert model.probe.hooks_seen == [1, 0, 0, 1, 0, 0, 1]
    report = read_report(tmp_path)
    assert report["run"]["hook_parking"] == "on"
    assert report["coverage"]["samples_observed"] == 3


def test_a_forward_that_raises_leaves_the_hooks_working(tmp_path: Path, fresh_dynamo) -> None:
    model = Net(fail_on=1)
    before = forward_hook_counts(model)
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(3))
    attached = forward_hook_counts(model)
    train(model, 1)
    with pytest.raises(RuntimeError, match="on purpose"):
        train(model, 1)
    train(model, 2)
    assert forward_hook_counts(model) == attached  # forward 3 was sampled: hooks back in place
    remove_observer(model)
    assert forward_hook_counts(model) == before
    # Training forwards 0 and 3 are sampled; forward 1 raised before reaching the probe.
    assert model.probe.hooks_seen == [1, 0, 1]


class RaisesOnForward:
    """Samples forwards 0, 3, 6, ...; raises when asked about ``fail_on``."""

    def __init__(self, fail_on: int) -> None:
        self.fail_on = fail_on
        self.asked: list[int] = []

    def should_sample(self, forward_index: int) -> bool:
        self.asked.append(forward_index)
        if forward_index == self.fail_on:
            raise RuntimeError("policy failed on purpose")
        return forward_index % 3 == 0

    def describe(self) -> dict[str, object]:
        return {"policy": "raises_on_forward"}


@pytest.mark.parametrize("fail_on", [1, 3])
def test_a_policy_that_raises_with_hooks_parked_counts_an_unsampled_forward(
    tmp_path: Path, fresh_dynamo, fail_on: int
) -> None:
    """Forward 1 is decided on the parked fast path, forward 3 (sampled) too: either way
    the error is counted, the forward counts as unsampled and training is unchanged."""
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    policy = RaisesOnForward(fail_on)
    handle = inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=policy)
    assert handle._observer is not None
    handle._observer.context.ROOT_SENTINEL_INTERVAL = 1  # the root sentinel on every forward
    losses = train(model, 7)
    remove_observer(model)
    assert losses == train(twin, 7)
    assert policy.asked == list(range(7))  # asked once per training forward
    sampled = [i for i in range(7) if i % 3 == 0 and i != fail_on]
    # The failed forward keeps whatever state its hooks were in (parked or not).
    seen = [count for i, count in enumerate(model.probe.hooks_seen) if i != fail_on]
    assert seen == [1 if i in sampled else 0 for i in range(7) if i != fail_on]
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["samples_observed"]) == (7, len(sampled))
    assert coverage["errors_total"] == 1
    assert coverage["sentinel_checks"] == 7 - len(sampled) - 1  # not the failed forward


def test_a_policy_error_resets_the_forward_state_like_a_counted_forward(
    tmp_path: Path, fresh_dynamo
) -> None:
    """After a train-mode no_grad forward, a policy error on the parked fast path must
    still reset the no-grad count: otherwise the next checkpointed root, recomputed in
    backward, is taken for a reentrant first pass and counted twice."""
    torch.manual_seed(0)
    model = Net()
    policy = RaisesOnForward(fail_on=1)
    inject_observer(model, output_dir=tmp_path, sampling=policy)
    x = torch.randn(4, 6)
    model(x).sum().backward()  # forward 0: sampled
    with torch.no_grad():
        model(x)  # parks the hooks
    # Forward 1, checkpointed: the policy raises; the root is recomputed in backward.
    checkpoint(model, x, use_reentrant=False).sum().backward()
    model(x).sum().backward()  # forward 2
    remove_observer(model)
    assert policy.asked == [0, 1, 2]
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["eval_forwards_skipped"]) == (3, 1)
    assert coverage["errors_total"] == 1


def test_full_sentinel_checks_every_training_forward_after_an_eval_forward(
    tmp_path: Path, fresh_dynamo
) -> None:
    """A no_grad or eval forward parks the hooks even with the full sentinel; the next
    training forwards must still take the full sentinel (hooks restored, every module
    checked), not the parked unsampled fast path."""
    torch.manual_seed(0)
    model = Net()
    inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(100), full_sentinel=True)
    x = torch.randn(4, 6)
    model(x).sum().backward()  # forward 0: sampled
    with torch.no_grad():
        model(x)  # validation in train mode: parks the hooks
    model.eval()
    model(x)
    model.train()
    bad = x.clone()
    bad[0, 0] = float("nan")
    model(bad).sum().backward()  # forward 1: unsampled, non-finite throughout
    for _ in range(3):
        model(x).sum().backward()
    remove_observer(model)
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["sentinel_nonfinite_forwards"] == 1
    # Forward 1 is checked at its 3 modules and its root; then 3 forced samples.
    assert (coverage["forwards_seen"], coverage["samples_observed"]) == (5, 4)
    assert coverage["sentinel_checks"] == 4
    assert model.probe.hooks_seen == [1, 0, 0, 1, 1, 1, 1]


def test_hooks_stay_parked_across_unsampled_forwards_until_a_sample(
    tmp_path: Path, fresh_dynamo
) -> None:
    model = Net()
    before = forward_hook_counts(model)
    inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(4))
    counts = []
    for _ in range(6):
        train(model, 1)
        counts.append(forward_hook_counts(model)["probe"])
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 6))  # eval forwards leave them parked too
    model.train()
    assert forward_hook_counts(model)["probe"] == 0
    train(model, 1)  # training forward 6 (eval forwards are not counted): not sampled
    remove_observer(model)
    assert counts == [1, 0, 0, 0, 1, 0]
    assert model.probe.hooks_seen == [1, 0, 0, 0, 1, 0, 0, 0]  # the 7th is the eval forward
    assert forward_hook_counts(model) == before


def test_a_module_with_another_hook_keeps_its_hooks_in_order(tmp_path: Path, fresh_dynamo) -> None:
    model = Net()
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(3))
    seen: list[float] = []

    def doubling(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        seen.append(output.detach().double().pow(2).mean().sqrt().item())
        return output * 2  # a user hook that replaces the output

    model.probe.register_forward_hook(doubling)
    train(model, 4)
    remove_observer(model)
    assert model.probe.hooks_seen == [2, 2, 2, 2]  # never parked: two hooks
    assert len(seen) == 4
    # Our hook ran first, on the probe's own output, not on the doubled one.
    probe = findings(read_series(tmp_path), "rms")[("probe", "activation")]
    assert probe["latest"]["sample"] == 1  # forwards 0 and 3
    assert probe["latest"]["value"] == pytest.approx(seen[3], rel=1e-5)


def test_parking_goes_on_under_torch_compile(tmp_path: Path, fresh_dynamo) -> None:
    """Compiled code guards on hook dictionaries (set when Dynamo loads): the hooks are
    parked in unsampled compiled forwards as in eager ones, and Dynamo holds one entry
    per hook state (in place, parked), compiled once, not one per park and restore.
    Parked, a module's hook dictionaries are those of a module without hooks (the
    with-kwargs flag goes too), so the parked entry guards as much as the plain twin's.
    Losses equal the compiled twin's; every submodule is observed in each sample."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    def guard_lines() -> list[int]:
        entries = _debug_get_cache_entry_list(CompileNet.forward.__code__)
        return sorted(str(entry.guard_manager).count("\n") for entry in entries)

    torch.manual_seed(0)
    model, twin = CompileNet(), CompileNet()
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(2))
    compiled = cast(nn.Module, torch.compile(model, backend="eager"))
    twin_compiled = cast(nn.Module, torch.compile(twin, backend="eager"))
    losses, hooks_after, flags_after = [], [], []
    graphs = 0
    for step in range(14):
        losses += train(model if step < 2 else compiled, 1, seed=step)
        hooks_after.append(len(model.act._forward_hooks))
        flags_after.append(len(model.act._forward_hooks_with_kwargs))
        if step == 3:  # compiled the sampled entry (forward 2), then the parked one
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs == 2
    parked_entry, sampled_entry = guard_lines()
    remove_observer(model)
    torch._dynamo.reset()
    twin_losses = [
        train(twin if step < 2 else twin_compiled, 1, seed=step)[0] for step in range(14)
    ]
    assert losses == twin_losses
    assert guard_lines() == [parked_entry] and sampled_entry > parked_entry
    # Sampled forwards 0, 2, ..., 12 have our hook in place (eager or compiled); it is
    # parked in the others, and stays out until the next sampled forward.
    assert hooks_after == flags_after == [1, 0] * 7
    report = read_report(tmp_path)
    assert report["run"]["hook_parking"] == "on"
    assert_observed_in_each_sample(tmp_path, ("fc1", "act", "fc2"), 7)


class GuardedNet(CompileNet):
    def forward(self, x: Tensor) -> Tensor:  # a code object of its own (Dynamo's cache)
        return self.fc2(self.act(self.fc1(x)))


class UntouchedNet(CompileNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def empty_hook_dict_guards(code: types.CodeType) -> list[set[str]]:
    """Per cache entry of ``code``: the modules' hook dictionaries its guards require
    empty (not the global ones)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return [
        set(re.findall(r"DICT_LENGTH: not (L\S+hooks)\b", str(entry.guard_manager)))
        for entry in _debug_get_cache_entry_list(code)
    ]


def test_a_model_the_observer_never_touches_compiles_without_hook_guards(
    tmp_path: Path, fresh_dynamo
) -> None:
    """With Dynamo's default ``skip_nnmodule_hook_guards=True`` left as it is, only the
    observed model's compiled code guards on its modules' empty ``_forward_hooks`` (what
    parking changes); another model compiled in the same process keeps Dynamo's default
    guards, none on its hooks."""
    torch.manual_seed(0)
    model, untouched = GuardedNet(), UntouchedNet()
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(2))
    compiled_model = cast(nn.Module, torch.compile(model, backend="eager"))
    compiled_untouched = cast(nn.Module, torch.compile(untouched, backend="eager"))
    train(compiled_model, 4)
    train(compiled_untouched, 4)
    assert torch._dynamo.config.skip_nnmodule_hook_guards is True
    assert empty_hook_dict_guards(UntouchedNet.forward.__code__) == [set()]
    parked, sampled = sorted(empty_hook_dict_guards(GuardedNet.forward.__code__), key=len)
    assert parked == {
        f"L['self']._modules['{name}']._forward_hooks" for name in ("fc1", "act", "fc2")
    }
    # Sampled: our hooks are in place (Dynamo guards their length itself).
    assert not {guard for guard in sampled if guard.endswith("._forward_hooks")}
    remove_observer(model)
    assert_observed_in_each_sample(tmp_path, ("fc1", "act", "fc2"), 2)


class FallbackNet(CompileNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FallbackUntouchedNet(CompileNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_where_the_guard_cannot_be_scoped_hook_guards_go_on_for_every_model(
    tmp_path: Path, fresh_dynamo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a torch whose Dynamo lacks the guard that injection scopes to observed models
    (here: the wrapper made to fail), ``skip_nnmodule_hook_guards`` is set to False for
    the process: parking goes on, and every compiled model, observed or not, guards on
    its modules' empty hook dictionaries."""
    from torch._dynamo.guards import GuardBuilder

    scoped = GuardBuilder.__dict__[compiled.EMPTY_HOOKS_GUARD]
    dynamos_own = getattr(scoped, "_torchinstruments_wrapped", scoped)
    monkeypatch.setattr(GuardBuilder, compiled.EMPTY_HOOKS_GUARD, dynamos_own)
    monkeypatch.setattr(compiled, "_wrap_empty_hooks_guard", lambda: False)
    monkeypatch.setattr(compiled, "_scoped", compiled._scoped)
    torch.manual_seed(0)
    model, untouched = FallbackNet(), FallbackUntouchedNet()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        run_with_fallback(tmp_path, model, untouched)


def run_with_fallback(tmp_path: Path, model: nn.Module, untouched: nn.Module) -> None:
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(2))
    assert torch._dynamo.config.skip_nnmodule_hook_guards is False
    assert compiled.hooks_guarded()
    train(cast(nn.Module, torch.compile(model, backend="eager")), 4)
    train(cast(nn.Module, torch.compile(untouched, backend="eager")), 2)
    every_hook_dict = {
        f"L['self']._modules['{name}'].{hooks}"
        for name in ("fc1", "act", "fc2")
        for hooks in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        )
    }
    assert every_hook_dict <= empty_hook_dict_guards(FallbackUntouchedNet.forward.__code__)[0]
    entries = empty_hook_dict_guards(FallbackNet.forward.__code__)
    assert len(entries) == 2  # sampled, parked
    assert any(every_hook_dict <= entry for entry in entries)  # the parked one
    remove_observer(model)
    assert read_report(tmp_path)["run"]["hook_parking"] == "on"
    assert_observed_in_each_sample(tmp_path, ("fc1", "act", "fc2"), 2)


class TwinNet(CompileNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SequentialHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
        self.run_body: Callable[[Tensor], Tensor] = self.body

    def forward(self, x: Tensor) -> Tensor:
        return self.run_body(x)


@pytest.mark.parametrize("compiled", ["modules", "function", "builtin"])
def test_another_instance_of_the_observed_class_never_runs_the_observed_models_code(
    tmp_path: Path, fresh_dynamo, compiled: str
) -> None:
    """A twin of the observed model's class (an EMA copy, a teacher), compiled in the same
    process, shares the observed model's code objects and so Dynamo's cache entries:
    the twin's entries, traced without our hooks, guard on its empty hook dictionaries
    and never run in place of the observed model's, which would leave its samples
    unobserved. Compiled as two modules, or as one function called with either model, or
    as the ``nn.Sequential`` inside each model compiled on its own (a ``torch.nn`` class,
    which Dynamo compiles through a wrapper frame shared by every such module: the
    frame's code is not the class's)."""
    torch.manual_seed(0)
    names = ("fc1", "act", "fc2")
    model: nn.Module
    twin: nn.Module
    if compiled == "builtin":
        model, twin = SequentialHolder(), SequentialHolder()
        names = ("body.0", "body.1", "body.2")
    else:
        model, twin = TwinNet(), TwinNet()
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(1))
    if compiled == "builtin":  # the bodies compiled on their own, the holders eager
        for holder in (model, twin):
            cast(SequentialHolder, holder).run_body = torch.compile(
                cast(SequentialHolder, holder).body, backend="eager"
            )
        run_model, run_twin = model, twin
    elif compiled == "modules":
        run_model = cast(nn.Module, torch.compile(model, backend="eager"))
        run_twin = cast(nn.Module, torch.compile(twin, backend="eager"))
    else:
        step = torch.compile(lambda module, x: module(x), backend="eager")
        run_model, run_twin = functools.partial(step, model), functools.partial(step, twin)
    generator = torch.Generator().manual_seed(0)
    losses: list[tuple[float, float]] = []
    for _ in range(6):
        x = torch.randn(4, 6, generator=generator)
        pair_losses = []
        for run in (run_twin, run_model):  # the twin first: its entry is tried first
            loss = run(x).square().mean()
            loss.backward()
            pair_losses.append(float(loss.detach()))
        losses.append((pair_losses[0], pair_losses[1]))
    remove_observer(model)
    assert all(twin_loss == model_loss for twin_loss, model_loss in losses)
    assert_observed_in_each_sample(tmp_path, names, 6)


class StepNet(CompileNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class HeldNet(CompileNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Holder(nn.Module):
    """Holds a model and calls it: compiled whole, its frame is the holder's."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)


class ListedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.act(self.fc(x))


class ListedNet(nn.Module):
    """Runs its blocks through a compiled helper that takes them as a list."""

    runner: Callable[[list[nn.Module], Tensor], Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ListedBlock(), ListedBlock()])
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.runner(list(self.blocks), x))


def run_layers(layers: list[nn.Module], x: Tensor) -> Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("compiled", ["function", "holder", "builtin", "list"])
def test_code_compiled_elsewhere_before_injection_runs_the_hooks_after(
    tmp_path: Path, fresh_dynamo, compiled: str
) -> None:
    """Code compiled before injection that runs the model from another frame (a compiled
    training-step function taking the model, a holder model compiled whole, Dynamo's
    wrapper frame of a ``torch.nn`` root, a compiled helper taking the model's layers in
    a list) has no guards on the model's hooks: injection invalidates it, so every
    sample is observed."""
    torch.manual_seed(0)
    names = ("fc1", "act", "fc2")
    model: nn.Module
    if compiled == "function":
        model = StepNet()
        step = torch.compile(lambda module, x: module(x), backend="eager")
        run: Callable[[Tensor], Tensor] = functools.partial(step, model)
    elif compiled == "holder":
        model = HeldNet()
        run = cast(nn.Module, torch.compile(Holder(model), backend="eager"))
    elif compiled == "builtin":
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
        names = ("0", "1", "2")
        run = cast(nn.Module, torch.compile(model, backend="eager"))
    else:
        listed = ListedNet()
        listed.runner = torch.compile(run_layers, backend="eager")
        model = run = listed
        names = ("blocks.0.fc", "blocks.0.act", "blocks.1.fc", "blocks.1.act", "head")
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 6, generator=generator) for _ in range(6)]
    for x in batches[:2]:  # compiled before injection
        run(x).square().mean().backward()
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(1))
    for x in batches[2:]:
        run(x).square().mean().backward()
    remove_observer(model)
    assert_observed_in_each_sample(tmp_path, names, 4)


class UserHookNet(CompileNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_a_user_hook_does_not_keep_code_compiled_before_injection(
    tmp_path: Path, fresh_dynamo
) -> None:
    """A user's own forward hook on a module the observer does not select makes the code
    compiled before injection guard on that (non-empty) hook dictionary, not on the
    others being empty: injection still invalidates it, and every sample is observed."""
    torch.manual_seed(0)
    model = UserHookNet()
    model.fc2.register_forward_hook(lambda module, args, output: None)
    compiled_model = cast(nn.Module, torch.compile(model, backend="eager"))
    train(compiled_model, 2)
    inject_observer(
        model,
        output_dir=tmp_path,
        report_config=WIDE,
        sampling=EveryNSampling(1),
        include=["fc1", "act"],
    )
    train(compiled_model, 4)
    remove_observer(model)
    assert_observed_in_each_sample(tmp_path, ("fc1", "act"), 4)


@pytest.fixture
def hook_guards_off_later(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Returns what leaves compiled code without guards on the observed model's empty
    hook dictionaries, as in a torch whose Dynamo lacks the guard that injection scopes
    to observed models, with ``skip_nnmodule_hook_guards`` set back to True by the user
    after injecting; both as they were at the test's end."""
    from torch._dynamo.guards import GuardBuilder

    config = torch._dynamo.config
    flag = config.skip_nnmodule_hook_guards

    def turn_off() -> None:
        config.skip_nnmodule_hook_guards = True
        scoped = GuardBuilder.__dict__[compiled.EMPTY_HOOKS_GUARD]
        dynamos_own = getattr(scoped, "_torchinstruments_wrapped", scoped)
        monkeypatch.setattr(GuardBuilder, compiled.EMPTY_HOOKS_GUARD, dynamos_own)

    yield turn_off
    config.skip_nnmodule_hook_guards = flag


def test_without_hook_guards_parking_stops_once_the_model_is_compiled(
    tmp_path: Path, fresh_dynamo, hook_guards_off_later: Callable[[], None]
) -> None:
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(2))
    hook_guards_off_later()
    train(model, 2)  # eager, parked in forward 1
    compiled = cast(nn.Module, torch.compile(model, backend="eager"))
    twin_compiled = cast(nn.Module, torch.compile(twin, backend="eager"))
    train(twin, 2)
    losses = train(compiled, 6, seed=1)
    remove_observer(model)
    torch._dynamo.reset()
    assert losses == train(twin_compiled, 6, seed=1)
    report = read_report(tmp_path)
    assert report["run"]["hook_parking"] == "off: torch.compile in use"
    # Sampled forwards 0, 2, 4, 6: every submodule observed in each, compiled or not.
    assert_observed_in_each_sample(tmp_path, ("fc1", "probe", "fc2"), 4)


class Outer(nn.Module):
    """Its middle block is compiled on its own (an OptimizedModule child)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.block = torch.compile(nn.Sequential(nn.Tanh(), nn.Linear(12, 12)), backend="eager")
        self.fc2 = nn.Linear(12, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.block(self.fc1(x)))


@pytest.mark.parametrize("hook_guards", [True, False], ids=["hook-guards", "no-hook-guards"])
def test_code_first_compiled_in_a_parked_forward_is_traced_again(
    tmp_path: Path, fresh_dynamo, hook_guards_off_later: Callable[[], None], hook_guards: bool
) -> None:
    """With hook guards the block's entry compiled while parked fails them once the
    hooks are back (a second entry is compiled); without, the entry is invalidated."""
    model = Outer()
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=OddForwards())
    if not hook_guards:
        hook_guards_off_later()
    train(model, 6)  # forward 0 is parked and compiles the block without our hooks
    remove_observer(model)
    torch._dynamo.reset()
    report = read_report(tmp_path)
    assert report["run"]["hook_parking"] == ("on" if hook_guards else "off: torch.compile in use")
    seen = observations(read_series(tmp_path))
    inner = [name for name, _ in seen if name.startswith("block.")]
    assert inner, sorted(seen)
    for name in inner:
        assert seen[(name, "activation")] == 3, (name, seen)


@pytest.mark.parametrize("hook_guards", [True, False], ids=["hook-guards", "no-hook-guards"])
def test_a_model_compiled_in_a_quiet_forward_is_observed_in_every_later_sample(
    tmp_path: Path, fresh_dynamo, hook_guards_off_later: Callable[[], None], hook_guards: bool
) -> None:
    """A quiet forward (the open-ended stretch between samples) does not ask whether
    something was compiled: a model first compiled in one runs its code compiled without
    our hooks in the quiet forwards that follow, and the forward that ends the stretch
    deals with it (with hook guards, the next sample compiles its own entry; without,
    the model's hook-free code is invalidated). Every sample after the compile is
    observed in full, and training equals the compiled twin's."""
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    handle = inject_observer(
        model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(12)
    )
    observer = handle._observer
    assert observer is not None
    if not hook_guards:
        hook_guards_off_later()
    losses = train(model, 5)
    assert observer.context._quiet_until > observer.context.forwards_seen  # forward 5 is quiet
    compiled = cast(nn.Module, torch.compile(model, backend="eager"))
    twin_compiled = cast(nn.Module, torch.compile(twin, backend="eager"))
    losses += train(compiled, 31, seed=1)
    remove_observer(model)
    torch._dynamo.reset()
    assert losses == train(twin, 5) + train(twin_compiled, 31, seed=1)
    report = read_report(tmp_path)
    assert report["run"]["hook_parking"] == ("on" if hook_guards else "off: torch.compile in use")
    # Forwards 0, 12 and 24 sampled, the last two compiled: every module in each.
    assert_observed_in_each_sample(tmp_path, ("fc1", "probe", "fc2"), 3)


def test_a_hook_added_during_a_parked_forward_runs_after_ours(tmp_path: Path, fresh_dynamo) -> None:
    model = Net()
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=OddForwards())
    seen: list[float] = []

    def hundredfold(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        seen.append(output.detach().double().pow(2).mean().sqrt().item())
        return output * 100

    original = model.forward

    def forward_registering_late(x: Tensor) -> Tensor:
        if not seen and not model.probe._forward_hooks:  # inside the parked forward 0
            model.probe.register_forward_hook(hundredfold)
        return original(x)

    model.forward = forward_registering_late  # type: ignore[method-assign]
    train(model, 2)
    order = [type(hook).__name__ for hook in model.probe._forward_hooks.values()]
    remove_observer(model)
    assert order == ["ForwardHook", "function"]
    probe = findings(read_series(tmp_path), "rms")[("probe", "activation")]
    assert probe["latest"]["value"] == pytest.approx(seen[1], rel=1e-5)  # not 100x


def test_keyboard_interrupt_inside_a_forward_leaves_no_hook_parked(
    tmp_path: Path, fresh_dynamo
) -> None:
    class Interrupting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: Tensor) -> Tensor:
            self.calls += 1
            if self.calls == 2:
                raise KeyboardInterrupt  # skips even always-called forward hooks
            return x

    model = nn.Sequential(nn.Linear(8, 16), Interrupting(), nn.Tanh(), nn.Linear(16, 1))
    before = forward_hook_counts(model)
    inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(2))
    attached = forward_hook_counts(model)
    for _ in range(8):
        with contextlib.suppress(KeyboardInterrupt):
            model(torch.randn(4, 8)).sum().backward()
    # All parked, the root's post-hook too: unsampled forward 7 was left open-ended.
    assert forward_hook_counts(model) == dict.fromkeys(attached, 0)
    model(torch.randn(4, 8)).sum().backward()  # forward 8: sampled, hooks back
    assert forward_hook_counts(model) == attached
    remove_observer(model)
    assert forward_hook_counts(model) == before
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["samples_observed"]) == (9, 5)


class AskedEvery:
    """Samples every ``n``-th forward, records what it is asked, and can tell its next
    sampled forward (so the observer may skip asking about quiet forwards)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.asked: list[int] = []

    def should_sample(self, forward_index: int) -> bool:
        self.asked.append(forward_index)
        return forward_index % self.n == 0

    def next_sampled(self, forward_index: int) -> int:
        return forward_index + (-forward_index) % self.n

    def describe(self) -> dict[str, object]:
        return {"policy": "asked_every", "n": self.n}


def test_quiet_forwards_run_with_the_root_post_hook_parked_too(
    tmp_path: Path, fresh_dynamo
) -> None:
    """Between samples, an unsampled forward without the root sentinel needs nothing at
    its end: the root's post-hook is parked as well, the forward is closed when the next
    one opens, and the forwards known to be quiet only count (the policy is not asked).
    Eval forwards and a forward that raises in between change none of the counts."""
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    before = forward_hook_counts(model)
    policy = AskedEvery(100)
    handle = inject_observer(model, output_dir=tmp_path, sampling=policy)
    observer = handle._observer
    assert observer is not None
    losses = train(model, 20)
    model.eval()
    model(torch.randn(4, 6))  # an eval forward: not counted
    model.train()
    losses += train(model, 2, seed=1)
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 5))  # training forward 22 raises at fc1
    losses += train(model, 4, seed=2)
    remove_observer(model)
    assert forward_hook_counts(model) == before
    twin_losses = train(twin, 20) + train(twin, 2, seed=1) + train(twin, 4, seed=2)
    assert losses == twin_losses
    # Forward 0 is sampled; forward 1 parks the submodule hooks and, at its end, the
    # root's post-hook. The root sentinel checks forwards 7, 8, 17 and 26 (post-hook back
    # for those); forward 20, after the eval forward, parks it again in its pre-hook.
    sentinel = [7, 8, 17, 26]
    expected = [1, 1] + [1 if i in sentinel else 0 for i in range(2, 20)]
    expected += [1]  # the eval forward: back in place, as for any forward not quiet
    expected += [1 if i in sentinel else 0 for i in range(20, 27)]
    assert model.root_hooks_seen == expected
    assert model.probe.hooks_seen == [1] + [0] * 26  # the raising forward never got there
    assert policy.asked == [0, 1, 20]  # forwards 2-19 and 21-26 were known to be quiet
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["forwards_seen"] == 27
    assert coverage["eval_forwards_skipped"] == 1
    assert coverage["samples_observed"] == 1
    assert coverage["sentinel_checks"] == len(sentinel)
    assert coverage["errors_total"] == 0


def test_a_policy_without_next_sampled_is_asked_about_every_forward(
    tmp_path: Path, fresh_dynamo
) -> None:
    model = Net()
    policy = RaisesOnForward(fail_on=-1)  # should_sample only: every 3rd forward
    inject_observer(model, output_dir=tmp_path, sampling=policy)
    train(model, 12)
    remove_observer(model)
    assert policy.asked == list(range(12))
    # The root's post-hook is still parked in unsampled forwards without the sentinel
    # (2, 5, 11), except right after a sample (1, 4, 10: the submodule hooks are parked
    # then, and the post-hook at the end); 7 and 8 have the root sentinel.
    assert model.root_hooks_seen == [1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 0]


class SelfCalling(nn.Module):
    """Calls itself once inside its forward while ``recurse`` is set (under no_grad with
    ``teacher``, as self-distillation does)."""

    def __init__(self, teacher: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.recurse = False
        self.inside = False
        self.teacher = teacher

    def forward(self, x: Tensor) -> Tensor:
        if self.recurse and not self.inside:
            self.inside = True
            try:
                with torch.no_grad() if self.teacher else contextlib.nullcontext():
                    target = self(x)
                x = x + target
            finally:
                self.inside = False
        return self.body(x)


class SelfCallingByAnotherName(SelfCalling):
    """``SelfCalling`` whose forward names its instance otherwise than ``self``."""

    def forward(this, x: Tensor) -> Tensor:
        if this.recurse and not this.inside:
            this.inside = True
            try:
                x = x + this(x)
            finally:
                this.inside = False
        return this.body(x)


def test_a_self_call_is_told_whatever_the_forward_names_its_instance(
    tmp_path: Path, fresh_dynamo
) -> None:
    """The root's caller is recognised by the forward's first argument, not by the name
    ``self``: the first self call, inside a quiet forward, is not counted as a forward."""
    torch.manual_seed(0)
    model = SelfCallingByAnotherName(teacher=False)
    handle = inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(100))
    observer = handle._observer
    assert observer is not None
    train(model, 12)
    assert observer.context._quiet_until > observer.context.forwards_seen  # forward 12 is quiet
    model.recurse = True
    train(model, 20, seed=1)
    assert observer.parking.root_post_off == "root module calls itself"
    remove_observer(model)
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["eval_forwards_skipped"]) == (32, 0)


@pytest.mark.parametrize("teacher", [False, True], ids=["grad", "no_grad"])
def test_a_root_that_starts_calling_itself_stops_open_ended_forwards(
    tmp_path: Path, fresh_dynamo, teacher: bool
) -> None:
    """An inner call of the root inside a forward left open-ended (and even inside a
    quiet one) is part of that forward, as in any other forward: counted neither as a
    forward nor as an eval forward. Forwards are no longer left open-ended after it."""
    torch.manual_seed(0)
    model, twin = SelfCalling(teacher), SelfCalling(teacher)
    twin.load_state_dict(model.state_dict())
    handle = inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(100))
    observer = handle._observer
    assert observer is not None
    losses = train(model, 12)
    assert observer.context._open_ended and not observer.parking.root_post_off
    assert observer.context._quiet_until > observer.context.forwards_seen  # forward 12 is quiet
    model.recurse = True
    losses += train(model, 20, seed=1)
    assert observer.parking.root_post_off == "root module calls itself"
    assert not observer.context._open_ended
    remove_observer(model)
    twin_losses = train(twin, 12)
    twin.recurse = True
    assert losses == twin_losses + train(twin, 20, seed=1)
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["forwards_seen"] == 32
    assert coverage["eval_forwards_skipped"] == 0
    assert coverage["errors_total"] == 0


@pytest.mark.parametrize("hook_guards", [True, False], ids=["hook-guards", "no-hook-guards"])
def test_compiling_after_quiet_forwards_observes_the_compiled_model(
    tmp_path: Path, fresh_dynamo, hook_guards_off_later: Callable[[], None], hook_guards: bool
) -> None:
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, report_config=WIDE, sampling=EveryNSampling(10))
    if not hook_guards:
        hook_guards_off_later()
    losses = train(model, 13)  # eager: forwards 2-6 and 11-12 quiet, the last left open
    compiled = cast(nn.Module, torch.compile(model, backend="eager"))
    losses += train(compiled, 20, seed=1)
    remove_observer(model)
    torch._dynamo.reset()
    twin_compiled = cast(nn.Module, torch.compile(twin, backend="eager"))
    assert losses == train(twin, 13) + train(twin_compiled, 20, seed=1)
    report = read_report(tmp_path)
    assert report["run"]["hook_parking"] == ("on" if hook_guards else "off: torch.compile in use")
    assert report["coverage"]["forwards_seen"] == 33
    # Sampled forwards 0 and 10 (eager), 20 and 30 (compiled): every submodule each time.
    assert_observed_in_each_sample(tmp_path, ("fc1", "probe", "fc2"), 4)


def test_a_subclass_that_overrides_only_should_sample_is_asked_about_every_forward(
    tmp_path: Path, fresh_dynamo
) -> None:
    """Its inherited ``next_sampled`` would not agree with it, so it is not used."""
    asked: list[int] = []

    class OddForwardsEveryN(EveryNSampling):
        def should_sample(self, forward_index: int) -> bool:
            asked.append(forward_index)
            return forward_index % 2 == 1

    model = Net()
    inject_observer(model, output_dir=tmp_path, sampling=OddForwardsEveryN(100))
    train(model, 12)
    remove_observer(model)
    assert asked == list(range(12))
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["samples_observed"]) == (12, 6)


def test_a_next_sampled_that_raises_is_counted_and_no_longer_used(
    tmp_path: Path, fresh_dynamo
) -> None:
    class BrokenLookahead(AskedEvery):
        def should_sample(self, forward_index: int) -> bool:
            return super().should_sample(forward_index)

        def next_sampled(self, forward_index: int) -> int:
            raise RuntimeError("next_sampled failed on purpose")

    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    policy = BrokenLookahead(4)
    inject_observer(model, output_dir=tmp_path, sampling=policy)
    losses = train(model, 12)
    remove_observer(model)
    assert losses == train(twin, 12)
    assert policy.asked == list(range(12))
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["samples_observed"]) == (12, 3)
    assert coverage["errors_total"] == 1


def test_a_copy_taken_while_the_root_post_hook_is_parked_ends_up_without_hooks(
    tmp_path: Path, fresh_dynamo
) -> None:
    """An EMA copy taken between quiet forwards: no always-called entry is left behind
    for a hook the copy does not have (a later hook of the copy could take its id)."""
    model = Net()
    before = {
        name: (dict(m._forward_hooks), dict(m._forward_hooks_always_called))
        for name, m in model.named_modules()
    }
    inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(100))
    train(model, 4)  # forward 3 is quiet: the root's post-hook is parked
    assert model.root_hooks_seen[-1] == 0
    ema = copy.deepcopy(model)
    assert dict(ema._forward_hooks_always_called) == {}
    ema(torch.randn(2, 6))  # the inert pre-hook removes itself
    assert {
        name: (dict(m._forward_hooks), dict(m._forward_hooks_always_called))
        for name, m in ema.named_modules()
    } == before
    assert not ema._forward_pre_hooks
    remove_observer(model)


def test_a_submodule_with_its_own_hook_keeps_the_root_post_hook_in_place(
    tmp_path: Path, fresh_dynamo
) -> None:
    """Our hook on such a module cannot be parked and sees the state between forwards:
    no forward is left open-ended, so calls outside the root forward are counted."""
    model = Net()
    model.fc2.register_forward_hook(lambda module, args, output: None)
    inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(100))
    for step in range(12):
        train(model, 1, seed=step)
        model.fc2(torch.randn(2, 12))  # a probe outside the root forward
    remove_observer(model)
    assert model.root_hooks_seen == [1] * 12
    coverage = read_report(tmp_path)["coverage"]
    assert coverage["forwards_seen"] == 12
    assert coverage["calls_outside_root_skipped"] == 12


def test_an_instance_that_overrides_should_sample_is_asked_about_every_forward(
    tmp_path: Path, fresh_dynamo
) -> None:
    policy = AskedEvery(100)
    asked: list[int] = []

    def odd(forward_index: int) -> bool:
        asked.append(forward_index)
        return forward_index % 2 == 1

    policy.should_sample = odd  # type: ignore[method-assign]
    model = Net()
    inject_observer(model, output_dir=tmp_path, sampling=policy)
    train(model, 10)
    remove_observer(model)
    assert asked == list(range(10))
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["samples_observed"]) == (10, 5)


class Wrapper(nn.Module):
    """Holds and calls a module of its own class (only the inner one is observed)."""

    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.fc(x))
        return self.inner(x) if self.inner is not None else x

    def teacher(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self(x)


def test_an_observed_model_called_by_a_module_of_its_class_is_not_taken_for_recursion(
    tmp_path: Path, fresh_dynamo
) -> None:
    torch.manual_seed(0)
    inner = Wrapper()
    outer = Wrapper(inner)
    inject_observer(inner, output_dir=tmp_path, sampling=EveryNSampling(100))
    train(outer, 300)
    remove_observer(inner)
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["samples_observed"]) == (300, 3)


class HelperTeacher(Wrapper):
    """Calls itself under no_grad through a helper method, from forward 12 on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        y = torch.tanh(self.fc(x))
        if self.calls > 12 and torch.is_grad_enabled():
            y = y + self.teacher(x)
        return y


def test_a_no_grad_self_call_through_a_helper_is_part_of_its_forward(
    tmp_path: Path, fresh_dynamo
) -> None:
    torch.manual_seed(0)
    model = HelperTeacher()
    inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(100))
    train(model, 30)
    remove_observer(model)
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["eval_forwards_skipped"]) == (30, 0)
    assert coverage["errors_total"] == 0


class Signalling(nn.Module):
    """Sets ``done`` at the end of its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 1)
        self.done = threading.Event()

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        self.done.set()
        return y


def test_a_root_called_as_the_entry_point_of_a_thread_runs(
    tmp_path: Path, fresh_dynamo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fewer Python frames above the root's call than the observer looks up."""
    errors: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda hook: errors.append(hook.exc_value))
    model = Signalling()
    inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(100))
    train(model, 4)  # forward 3 is quiet: forward 4 would be too
    model.done.clear()
    _thread.start_new_thread(model, (torch.randn(2, 6),))  # the root is the entry point
    assert model.done.wait(10), errors
    train(model, 2)
    remove_observer(model)
    assert errors == []
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["errors_total"]) == (7, 0)


class VmapSelfCall(nn.Module):
    """Calls itself under vmap, one row at a time, inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: Tensor, depth: int = 0) -> Tensor:
        y = torch.tanh(self.fc(x))
        if depth == 0:
            y = y + torch.func.vmap(lambda row: self(row, 1))(y)
        return y


def test_the_root_sentinel_checks_only_the_outer_call_of_a_self_calling_root(
    tmp_path: Path, fresh_dynamo
) -> None:
    """The inner output (here a tensor batched by vmap, which has no .item()) is part
    of the outer forward: checked neither twice nor at all."""
    model = VmapSelfCall()
    inject_observer(model, output_dir=tmp_path, sampling=EveryNSampling(100))
    train(model, 30)
    remove_observer(model)
    coverage = read_report(tmp_path)["coverage"]
    assert (coverage["forwards_seen"], coverage["eval_forwards_skipped"]) == (30, 0)
    assert coverage["sentinel_checks"] == 4  # forwards 7, 8, 17 and 26
    assert coverage["errors_total"] == 0
