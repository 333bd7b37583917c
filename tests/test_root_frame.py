"""A root whose class's forward Dynamo never compiles as a frame (a ``torch.nn`` class)
gets a frame of its own (``_root_frame.py``): compiled whole, with ``fullgraph=True``
too, its hooks run around the compiled frame and its modules are measured inside the
graph. A root whose own call Dynamo traces anyway (a compiled function that calls it)
keeps training, whether or not the trace allows graph breaks."""

from __future__ import annotations

import copy
import inspect
import io
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import Tensor, nn

from tests.harness import assert_same_model, read_report
from tests.harness.scenarios import assert_same_telemetry, written_series
from torchinstruments import capture, inject_observer, remove_observer
from torchinstruments import observer as observer_module
from torchinstruments._root_frame import RootFrame, needs_root_frame


def sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def train(model: nn.Module, steps: int, *, first: int = 0) -> list[float]:
    """SGD steps on the square of the output, batches seeded by step number."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


class CountingAotEager:
    """The ``aot_eager`` backend, counting the forwards its compiled graphs run."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example: list[Tensor]) -> Any:
        compiled = torch._dynamo.lookup_backend("aot_eager")(graph, example)

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


def graph_counts() -> tuple[int, int]:
    """Graphs Dynamo compiled and graph breaks it met, in the process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_only_roots_of_torch_classes_get_a_frame() -> None:
    class Own(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    class OwnSequential(nn.Sequential):  # the forward is still nn.Sequential's
        pass

    assert needs_root_frame(nn.Sequential())
    assert needs_root_frame(nn.Linear(2, 2))
    assert needs_root_frame(OwnSequential())
    assert not needs_root_frame(Own())
    with_instance_forward = nn.Sequential()
    with_instance_forward.forward = lambda x: x  # type: ignore[method-assign]
    assert not needs_root_frame(with_instance_forward)


@pytest.mark.parametrize("order", ["inject_then_compile", "compile_train_then_inject"])
def test_a_torch_nn_root_compiles_whole_with_fullgraph(tmp_path: Path, order: str) -> None:
    """``torch.compile(nn.Sequential(...), fullgraph=True)``, compiled before or after
    injection: no graph break, nothing traced of the root's hooks, every series of the
    three leaves and the root equal to the eager path's, training bit-identical to the
    compiled twin's; after removal the
    compiled wrapper goes on running compiled code, training as the twin: its frame
    stays, since that code runs it, and observing the model again three times compiles
    nothing more."""
    base = sequential()
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    train(eager, 1)
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=1)
    train(eager, 4, first=1)
    remove_observer(eager)

    backend = CountingAotEager()
    twin_compiled = cast(nn.Module, torch.compile(twin, backend=CountingAotEager(), fullgraph=True))
    twin_losses = train(twin_compiled, 1)
    traces = capture.root_hook_traces()
    if order == "compile_train_then_inject":
        compiled = cast(nn.Module, torch.compile(observed, backend=backend, fullgraph=True))
        assert train(compiled, 1) == twin_losses
        inject_observer(compiled, output_dir=tmp_path / "compiled", sampling=1)
    else:
        train(observed, 1)  # eagerly, as the twin's first step
        inject_observer(observed, output_dir=tmp_path / "compiled", sampling=1)
        compiled = cast(nn.Module, torch.compile(observed, backend=backend, fullgraph=True))
    assert isinstance(observed.__dict__["forward"], RootFrame)
    graphs, breaks = graph_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no advice about traced roots
        losses = train(compiled, 4, first=1)
    assert graph_counts() == (graphs + 1, breaks)
    remove_observer(observed)
    assert isinstance(observed.__dict__["forward"], RootFrame)  # compiled code runs it
    assert losses == train(twin_compiled, 4, first=1)
    report = read_report(tmp_path / "compiled")
    coverage = report["coverage"]["compiled_capture"]
    assert coverage["mode"] == "in_graph"
    assert coverage["slots"] == 2 * 3
    assert capture.root_hook_traces() == traces
    eager_series = written_series(tmp_path / "eager")
    assert len({key[:4] for key in eager_series}) == 2 * 4  # 3 leaves and the root
    assert_same_telemetry(eager_series, written_series(tmp_path / "compiled"))

    runs = backend.runs
    after = train(compiled, 3, first=5)
    assert backend.runs == runs + 3  # compiled still
    assert after == train(twin_compiled, 3, first=5)
    assert_same_model(observed, twin)
    graphs, breaks = graph_counts()
    for cycle in range(3):  # the frame stays: observing again compiles nothing more
        inject_observer(observed, output_dir=tmp_path / f"again-{cycle}", sampling=1)
        assert train(compiled, 2, first=8 + 2 * cycle) == train(
            twin_compiled, 2, first=8 + 2 * cycle
        )
        remove_observer(observed)
    assert graph_counts() == (graphs, breaks)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_torch_nn_root_compiled_in_place_before_injection_compiles_its_frame(
    tmp_path: Path, fullgraph: bool
) -> None:
    """``model.compile()`` on an ``nn.Sequential`` before injection compiled the
    root's whole call, hooks included (a graph break, or under ``fullgraph=True`` no
    forward observed). Injection compiles the call again with the same settings: no
    graph break, no traced root hook, series equal to the eager path's, training
    bit-identical to the compiled twin's, and after removal the call still runs
    compiled code."""
    base = sequential()
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    train(eager, 1)
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=1)
    train(eager, 4, first=1)
    remove_observer(eager)

    twin.compile(backend=CountingAotEager(), fullgraph=fullgraph)
    backend = CountingAotEager()
    observed.compile(backend=backend, fullgraph=fullgraph)
    assert train(observed, 1) == train(twin, 1)
    traces = capture.root_hook_traces()
    inject_observer(observed, output_dir=tmp_path / "compiled", sampling=1)
    graphs, breaks = graph_counts()
    runs = backend.runs
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no advice about traced roots
        losses = train(observed, 4, first=1)
    assert backend.runs == runs + 4
    assert graph_counts() == (graphs + 1, breaks)
    remove_observer(observed)
    assert losses == train(twin, 4, first=1)
    assert capture.root_hook_traces() == traces
    assert read_report(tmp_path / "compiled")["coverage"]["compiled_capture"]["mode"] == "in_graph"
    assert_same_telemetry(written_series(tmp_path / "eager"), written_series(tmp_path / "compiled"))
    runs = backend.runs
    assert train(observed, 2, first=5) == train(twin, 2, first=5)
    assert backend.runs == runs + 2  # compiled still, without the hooks
    assert_same_model(observed, twin)


def test_the_frame_copies_pickles_and_signs_as_the_class_forward(tmp_path: Path) -> None:
    """A deep copy and an unpickled copy carry a copied frame that leaves at their first
    forward when it runs eagerly (the copy is not observed); removal takes out a frame
    that no compiled code ran; ``inspect.signature`` sees the class ``forward``'s
    parameters; the frame holds the root weakly."""
    model = sequential()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    assert inspect.signature(model.forward) == inspect.signature(nn.Sequential().forward)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    x = torch.randn(3, 6)
    for copy_of_model in (copied, loaded):
        frame = copy_of_model.__dict__["forward"]
        assert isinstance(frame, RootFrame) and frame.copied
        assert torch.equal(copy_of_model(x), model(x))
        assert "forward" not in copy_of_model.__dict__  # run eagerly: a clean copy
        assert not copy_of_model._forward_pre_hooks and not copy_of_model._forward_hooks
    remove_observer(model)
    assert "forward" not in model.__dict__  # never compiled: the frame goes
    collected = sequential()
    inject_observer(collected, output_dir=tmp_path / "collected", sampling=1)
    frame = collected.__dict__["forward"]
    assert isinstance(frame, RootFrame)
    del collected
    assert frame._module() is None  # no reference cycle through the frame


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(6, 8), nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_model_called_from_a_compiled_function_keeps_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fullgraph: bool, fresh_dynamo: None
) -> None:
    """A compiled function that calls the observed model traces the root's own call,
    its hooks included. Where the trace allows graph breaks, each root hook is one and
    the modules inside are measured in the graph; where it refuses them
    (``fullgraph=True``), the root's hooks trace to nothing and training goes on
    unobserved (it raised inside Dynamo before). Either way training is the compiled
    twin's, one warning gives the way out, and the coverage counts the traces and
    index.md explains them."""
    monkeypatch.setattr(capture, "_root_traced_warned", False)
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())

    def step_function(net: nn.Module) -> Any:
        return torch.compile(lambda x: net(x), backend="aot_eager", fullgraph=fullgraph)

    class Called(nn.Module):  # what train() calls: the compiled function
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net, self.function = net, step_function(net)

        def forward(self, x: Tensor) -> Tensor:
            return self.function(x)

    traces, unobserved = capture.root_hook_traces(), capture.root_hook_traces_unobserved()
    inject_observer(model, output_dir=tmp_path, sampling=2)
    with pytest.warns(RuntimeWarning, match="traces the observed root's own call") as caught:
        losses = train(Called(model), 4)
    assert sum(capture.ROOT_TRACED_ADVICE in str(w.message) for w in caught) == 1
    remove_observer(model)
    assert losses == train(Called(twin), 4)
    assert_same_model(model, twin)
    report = read_report(tmp_path)
    coverage = report["coverage"]["compiled_capture"]
    assert coverage["root_hooks_traced"] > traces
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    if fullgraph:
        assert coverage["root_hooks_unobserved"] - unobserved == (
            coverage["root_hooks_traced"] - traces
        )
        assert coverage["slots"] == 0
        assert report["coverage"]["samples_observed"] == 0
        assert (
            "No training forward was observed: torch.compile traced the root's own call "
            "with fullgraph=True" in " ".join(index.split())
        )
    else:
        assert "Dynamo met the root's hooks while tracing" in index
        assert coverage["root_hooks_unobserved"] == unobserved
        assert coverage["mode"] == "in_graph"
        assert coverage["slots"] == 2 * 2


@pytest.mark.parametrize("found", ["at_injection", "while_tracing"])
def test_a_wrapper_made_before_injection_compiles_the_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    """``torch.compile(nn.Sequential(...), fullgraph=True)`` made and run before the
    observer is injected into the model itself (not the wrapper). Injection finds the
    wrapper and has it compile the root's frame, with the root's hooks around it.
    Where injection misses it (``while_tracing``: as if the search found nothing), the
    wrapper's first call after injection still traces the root's call, where the
    root's hooks do nothing (that forward is not observed), and is found on the stack
    then; its next calls compile the frame. No warning, no trace counted; training is
    the twin's, during and after observation, and after removal the wrapper still runs
    compiled code."""
    if found == "while_tracing":
        monkeypatch.setattr(observer_module, "wrappers_of", lambda root: [])
    base = sequential()
    observed, twin = copy.deepcopy(base), copy.deepcopy(base)
    backend = CountingAotEager()
    compiled = cast(nn.Module, torch.compile(observed, backend=backend, fullgraph=True))
    twin_compiled = cast(nn.Module, torch.compile(twin, backend=CountingAotEager(), fullgraph=True))
    assert train(compiled, 1) == train(twin_compiled, 1)
    traces = capture.root_hook_traces(), capture.root_hook_traces_unobserved()
    inject_observer(observed, output_dir=tmp_path, sampling=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        losses = train(compiled, 4, first=1)
    frame = observed.__dict__["forward"]
    assert isinstance(frame, RootFrame)
    assert [ref() for ref in frame.wrappers] == [compiled]
    remove_observer(observed)
    assert observed.__dict__["forward"] is frame  # the wrapper's compiled code runs it
    assert losses == train(twin_compiled, 4, first=1)
    report = read_report(tmp_path)
    assert (capture.root_hook_traces(), capture.root_hook_traces_unobserved()) == traces
    unobserved = 1 if found == "while_tracing" else 0  # the first forward, traced whole
    assert report["coverage"]["samples_observed"] == 4 - unobserved
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"
    assert report["coverage"]["compiled_capture"]["slots"] == 2 * 3
    runs = backend.runs
    assert train(compiled, 2, first=5) == train(twin_compiled, 2, first=5)
    assert backend.runs == runs + 2
    assert_same_model(observed, twin)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_copy_compiled_before_its_first_forward_runs_compiled(
    tmp_path: Path, fullgraph: bool
) -> None:
    """An EMA copy (``copy.deepcopy``) or a ``torch.load`` copy of an observed
    ``nn.Sequential``, compiled before its first forward: its wrapper compiles the
    copy's frame (kept, since the wrapper chose it), every call runs compiled code, the
    copy is not observed (its inert hooks leave at the first call) and computes what
    the model does."""
    model = sequential()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    x = torch.randn(4, 6)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copy_of_model in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        backend = CountingAotEager()
        compiled = cast(
            nn.Module, torch.compile(copy_of_model, backend=backend, fullgraph=fullgraph)
        )
        outputs = [compiled(x) for _ in range(4)]
        assert backend.runs == 4
        assert all(torch.equal(output, model(x)) for output in outputs)
        assert isinstance(copy_of_model.__dict__["forward"], RootFrame)
        assert not copy_of_model._forward_pre_hooks and not copy_of_model._forward_hooks
    remove_observer(model)
