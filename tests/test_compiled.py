"""``torch.compile``: observed modules are reduced inside compiled graphs (``aot_eager``
here; inductor in ``test_compiled_inductor.py``), and injection and removal keep other
models' compiled code.

Each model class here is used by one test only: Dynamo caches compiled code per code
object (a class's ``forward``), so a class shared between tests would share its cache.
"""

from __future__ import annotations

import copy
import functools
import inspect
import io
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, cast

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.harness import (
    REPO,
    act,
    assert_same_model,
    attach,
    finish,
    fit,
    grad,
    hook_counts,
    make_batches,
    observations,
    pair,
    read_report,
    train_on_noise,
)
from tests.harness.scenarios import (
    CheckpointNet,
    CompileNet,
    Series,
    assert_identical_training,
    assert_same_telemetry,
    example_batches,
    example_model,
    fit_classifier,
    written_series,
)
from torchinstruments import (
    inject_observer,
    observer_of,
    remove_observer,
)


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles (runs them as is),
    keeps their sizes (nodes) and notes which one ran last."""

    def __init__(self) -> None:
        self.graphs = 0
        self.sizes: list[int] = []
        self.last = -1

    def __call__(self, graph: torch.fx.GraphModule, example: list[Tensor]) -> Callable[..., Any]:
        index = self.graphs
        self.graphs += 1
        self.sizes.append(len(graph.graph.nodes))

        def run(*args: Any) -> Any:
            self.last = index
            return graph.forward(*args)

        return run


def remove_observer_and_read(model: nn.Module, directory: Path) -> dict[str, Any]:
    remove_observer(model)
    return read_report(directory)


def samples_of(directory: Path, module: str) -> int:
    """Samples observed of ``module``'s activation RMS, from the written series.json."""
    data = json.loads((directory / "series.json").read_text(encoding="utf-8"))
    for entry in data["series"]:
        if (entry["module"], entry["signal"], entry["metric"]) == (module, "activation", "rms"):
            return int(entry["count"])
    return 0


def decorated(function: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator as ``transformers`` puts on ``forward``: Dynamo compiles the wrapper's
    frame, whose code object is not the module's ``forward``."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


class ObservedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(12, 1)

    @decorated
    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class UnrelatedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_inject_and_remove_keep_another_models_compiled_code(tmp_path: Path) -> None:
    """:func:`check_inject_and_remove_keep_another_models_compiled_code` in a fresh
    interpreter, where the observed model's class was never observed before: the code
    compiled before injection has no hook guards, so injection must invalidate it, and
    removal compiles the model anew (its entry compiled with the hooks fails their
    guards). In a process where the class was observed before, the code compiled before
    this injection guards on the empty hook dictionaries already and runs again after
    removal, compiling nothing (the same graph, by its size: the check's last assertion
    holds there too). The other model's class is never observed: its code carries no hook
    guards (Dynamo's default), and nothing invalidates it."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        f"from {__name__} import check_inject_and_remove_keep_another_models_compiled_code"
        " as check; check(Path(sys.argv[2]))"
    )
    subprocess.run([sys.executable, "-c", code, str(REPO), str(tmp_path)], check=True, cwd=REPO)


def check_inject_and_remove_keep_another_models_compiled_code(tmp_path: Path) -> None:
    """Another compiled model is not compiled again by injection or removal, while the
    observed model's hooks (its ``forward`` decorated) take effect (it is traced again
    into a graph larger by the in-graph reductions, and every submodule is observed) and
    then go (traced again, into a graph of the size it had before injection)."""
    torch.manual_seed(0)
    observed, unrelated = ObservedNet(), UnrelatedNet()
    observed_backend, unrelated_backend = CountingBackend(), CountingBackend()
    compiled = cast(nn.Module, torch.compile(observed, backend=observed_backend))
    other = cast(nn.Module, torch.compile(unrelated, backend=unrelated_backend))
    train_on_noise(compiled, 2)
    train_on_noise(other, 2)
    assert unrelated_backend.graphs >= 1
    unrelated_graphs, observed_graphs = unrelated_backend.graphs, observed_backend.graphs

    inject_observer(observed, output_dir=tmp_path, sampling=1)
    train_on_noise(compiled, 3)
    train_on_noise(other, 3)
    assert unrelated_backend.graphs == unrelated_graphs  # no recompile of the other model
    assert observed_backend.graphs > observed_graphs  # traced again, with the hooks
    plain_size = observed_backend.sizes[0]
    assert observed_backend.sizes[observed_backend.last] > plain_size
    remove_observer(observed)
    for name in ("fc1", "act", "fc2"):
        assert samples_of(tmp_path, name) == 3, name

    observed_graphs = observed_backend.graphs
    train_on_noise(compiled, 2)
    train_on_noise(other, 2)
    assert unrelated_backend.graphs == unrelated_graphs
    assert observed_backend.graphs > observed_graphs  # traced again, without the hooks
    assert observed_backend.sizes[observed_backend.last] == plain_size


# ----------------------------------------------------------- capture inside compiled graphs
class Holder(nn.Module):
    """Holds an ``ObservedNet`` (a teacher, an EMA copy) and adds a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ObservedNet()
        self.head = nn.Linear(1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(x))


def test_a_compiled_model_holding_the_observed_class_compiles_once_over_injections(
    tmp_path: Path, fresh_dynamo: None
) -> None:
    """A model holding another instance of the observed class, compiled whole with
    ``fullgraph=True`` before any injection: the first injection invalidates its code
    (which ran that class's submodules without hook guards), its new code guards on
    their hooks, so ten more injections of new models of the class compile nothing
    more (each used to add an entry, until ``recompile_limit`` stopped training)."""
    torch.manual_seed(0)
    backend = CountingBackend()
    holder = cast(nn.Module, torch.compile(Holder(), backend=backend, fullgraph=True))
    x = torch.randn(4, 6)
    holder(x).sum().backward()
    for run in range(10):
        observed = ObservedNet()
        inject_observer(observed, output_dir=tmp_path / str(run), sampling=1)
        observed(x).sum().backward()
        holder(x).sum().backward()
        remove_observer(observed)
    assert backend.graphs == 2


def test_a_compiled_step_function_with_fullgraph_survives_a_sweep(
    tmp_path: Path, fresh_dynamo: None
) -> None:
    """A step function compiled with ``fullgraph=True`` traces the observed root's call
    (its hooks do nothing there): removal resets the code that guards on the removed
    hooks' ids, so a sweep of ten models through it never reaches ``recompile_limit``
    (it failed at the eighth), at most two compilations a run."""
    backend = CountingBackend()

    @torch.compile(backend=backend, fullgraph=True)
    def step(model: nn.Module, x: Tensor) -> Tensor:
        return model(x).pow(2).mean()

    x = torch.randn(4, 6)
    for run in range(10):
        torch.manual_seed(run)
        model = ObservedNet()
        before = backend.graphs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the advice about traced roots
            inject_observer(model, output_dir=tmp_path / str(run), sampling=1)
            for _ in range(3):
                step(model, x).backward()
        remove_observer(model)
        assert backend.graphs - before <= 2, run


def test_fullgraph_training_is_identical_and_telemetry_equals_eager(tmp_path: Path) -> None:
    """``fullgraph=True`` compiles with the observer (so the observer adds no graph
    break); training is bit-identical to the same compiled model
    without it; every series (activations and output gradients of the 13 leaf modules
    and the root) equals the eager path's on the same batches; the sampling decision
    compiles nothing again (one graph over 6 sampled forwards)."""
    from torch._dynamo.utils import counters

    base = example_model()
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    data = example_batches(6)
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=1)
    fit_classifier(eager, data)
    remove_observer(eager)

    inject_observer(observed, output_dir=tmp_path / "compiled", sampling=1)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled = torch.compile(observed, backend="aot_eager", fullgraph=True)
    losses = fit_classifier(cast(nn.Module, compiled), data)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # no recompile per forward
    assert sum(counters["graph_break"].values()) == breaks
    report = remove_observer_and_read(observed, tmp_path / "compiled")
    twin_losses = fit_classifier(
        cast(nn.Module, torch.compile(twin, backend="aot_eager", fullgraph=True)), data
    )
    assert_identical_training(observed, twin, losses, twin_losses)
    eager_series = written_series(tmp_path / "eager")
    assert len({key[:4] for key in eager_series}) == 2 * 14  # 13 leaves and the root
    assert_same_telemetry(eager_series, written_series(tmp_path / "compiled"))
    compile_coverage = report["coverage"]["compiled_capture"]
    assert compile_coverage["mode"] == "in_graph"
    assert compile_coverage["slots"] == 2 * 13  # every leaf module, both signals
    assert compile_coverage["slots_dropped"] == 0


class DeepNet(nn.Module):
    """33 blocks of Linear(6, 6) and Tanh: 66 observed outputs with gradients, more
    modules than the smallest activation buffer holds (64)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(m for _ in range(33) for m in (nn.Linear(6, 6), nn.Tanh())))
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layers(x))


def test_more_modules_than_the_smallest_buffer_trace_into_one_graph(tmp_path: Path) -> None:
    """Every module's rows exist before Dynamo reads them (an entry added while tracing
    is missing from Dynamo's view of the hook's dict, and the whole frame would run
    eagerly, each hook a frame of its own). With ``fullgraph=True`` the model compiles
    into one graph; 2 x 67 (module, call, signal, path) measured in it; training equals
    the compiled twin's and every series the eager path's."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        DeepNet(), tmp_path, functools.partial(aot_eager, fullgraph=True), sampling=2, steps=4
    )
    coverage = report["coverage"]["compiled_capture"]
    assert coverage["slots"] == 2 * 67
    assert coverage["slots_dropped"] == 0
    assert ("layers.0", 0, "grad_output", "output", "rms") in compiled
    assert_same_telemetry(eager, compiled)


class WidthsNet(nn.Module):
    """12 Linear layers of 12 widths (6 to 17), each followed by a Tanh: 12 distinct
    element counts among the observed outputs, more than the 8 graphs that a nested
    compile region keeps by default."""

    def __init__(self) -> None:
        super().__init__()
        widths = list(range(6, 18))
        layers: list[nn.Module] = []
        for inputs, outputs in zip([6, *widths[:-1]], widths, strict=True):
            layers += [nn.Linear(inputs, outputs), nn.Tanh()]
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(widths[-1], 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layers(x))


def test_the_reductions_are_traced_once_per_element_count(tmp_path: Path) -> None:
    """Where torch has nested compile regions, each output's (and output gradient's)
    reductions are one region call in the graph Dynamo builds: with 12 distinct element
    counts (more regions than Dynamo keeps by default, where it would raise) the model
    compiles with ``fullgraph=True`` into one graph; every series equals the eager
    path's and training the compiled twin's."""
    from torchinstruments import _compiled_capture

    targets: list[str] = []

    def recording(graph: torch.fx.GraphModule, example: list[Tensor]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.compilers import nop

        targets.extend(str(node.target) for node in graph.graph.nodes)
        return aot_autograd(fw_compiler=nop)(graph, example)

    def compile_model(model: nn.Module) -> nn.Module:
        return cast(nn.Module, torch.compile(model, backend=recording, fullgraph=True))

    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        WidthsNet(), tmp_path, compile_model, sampling=2, steps=4
    )
    coverage = report["coverage"]["compiled_capture"]
    assert coverage["slots"] == 2 * 25  # 12 Linear, 12 Tanh, the head
    assert coverage["slots_dropped"] == 0
    assert_same_telemetry(eager, compiled)
    regions = [target for target in targets if "invoke_subgraph" in target]
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None or "max_reuse_entries" not in inspect.signature(region).parameters:
        assert _compiled_capture._rows_in_region is _compiled_capture._masked_rows
        assert regions == []
    else:
        # One call per observed output in the sampled graph (the twin's graphs hold
        # none): the forward taps' own regions run in the backward, which AOT traces.
        assert len(regions) == 25


class InPlaceReLUNet(nn.Module):
    """Linear, then ReLU(inplace=True) on its output (torchvision ResNet's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.act(self.lin(x)))


def square_loss(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).square().mean()


def train_steps(
    model: nn.Module,
    steps: int,
    loss_of: Callable[[nn.Module, Tensor], Tensor] = square_loss,
) -> list[float]:
    """One forward and one backward per SGD step, on seeded noise; the loss
    ``loss_of(model, x)``."""
    generator = torch.Generator().manual_seed(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_of(model, torch.randn(8, 6, generator=generator))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_an_in_place_op_on_a_tapped_output_compiles_and_trains_identically(
    tmp_path: Path,
) -> None:
    """The in-graph gradient tap returns a copy: an in-place ReLU on its output (which
    autograd forbids on a view a custom Function returned) trains as without the
    observer, and the telemetry equals the eager path's. The ReLU's output is its input,
    so its gradient is not tapped (counted): a copy would no longer be that tensor."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        InPlaceReLUNet(), tmp_path, aot_eager, sampling=1, steps=4
    )
    assert {("lin", "grad_output"), ("act", "activation")} <= {(key[0], key[2]) for key in compiled}
    assert report["coverage"]["compiled_capture"]["gradients_not_captured"] >= 1
    assert_same_telemetry(
        {key: points for key, points in eager.items() if key[:3] != ("act", 0, "grad_output")},
        compiled,
    )


class First(nn.Module):
    """Returns the first tensor of a pair (a tensor nested in its input)."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return pair[0]


class AliasNet(nn.Module):
    """A module whose output is its input itself, read after the input was changed in
    place: the model relies on the two being one tensor. ``passing`` says how the input
    reaches it: ``positional`` (``nn.Identity``), ``keyword`` (``nn.Identity`` called
    as ``keep(input=h)``) or ``nested`` (:class:`First` of ``(h, x)``)."""

    def __init__(self, passing: str = "positional") -> None:
        super().__init__()
        self.passing = passing
        self.lin = nn.Linear(6, 8)
        self.keep = First() if passing == "nested" else nn.Identity()
        self.out = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x) * 1.0
        if self.passing == "keyword":
            kept = self.keep(input=h)
        elif self.passing == "nested":
            kept = self.keep((h, x))
        else:
            kept = self.keep(h)
        h.mul_(2.0)
        return self.out(kept)


@pytest.mark.parametrize("passing", ["positional", "keyword", "nested"])
def test_an_output_that_is_its_input_stays_that_tensor(tmp_path: Path, passing: str) -> None:
    """The tap returns a copy, so an output that is one of the module's inputs
    (positional, keyword or nested in one) is not tapped: the model's in-place change of
    the input still reaches the output (training identical, ``fullgraph=True``); its
    gradient is counted under ``gradients_not_captured``, the other series equal the
    eager path's. (Keyword and nested inputs were tapped, and training changed.)"""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        AliasNet(passing),
        tmp_path,
        functools.partial(aot_eager, fullgraph=True),
        sampling=1,
        steps=4,
    )
    untapped = report["coverage"]["compiled_capture"]["gradients_not_captured"]
    assert untapped >= 1
    keep_gradient = ("keep", 0, "grad_output", "output", "rms")
    assert keep_gradient in eager and keep_gradient not in compiled
    assert_same_telemetry({k: v for k, v in eager.items() if k[:3] != keep_gradient[:3]}, compiled)
    index = (tmp_path / "compiled" / "index.md").read_text(encoding="utf-8")
    assert (
        f"output gradients of {untapped} traced outputs (in dicts, dataclasses or lists "
        "inside the output, one of the module's inputs, or inside an activation-checkpoint "
        "region that compiled code calls)"
    ) in index


class NonReentrantNet(nn.Module):
    """Linear -> a block (Linear, Tanh, Linear) that runs as
    ``checkpoint(compiled_block, h, use_reentrant=False)`` once compiled -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.block = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))
        self.head = nn.Linear(12, 1)
        self.run_block: Callable[[Tensor], Tensor] = self.block

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.run_block, self.inp(x), use_reentrant=False)
        assert isinstance(h, Tensor)
        return self.head(h)


class ReentrantNet(NonReentrantNet):
    """:class:`NonReentrantNet` with ``use_reentrant=True`` (a forward of its own: Dynamo
    caches per code object)."""

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.run_block, self.inp(x), use_reentrant=True)
        assert isinstance(h, Tensor)
        return self.head(h)


def observe_eager_and_compiled(
    base: nn.Module,
    directory: Path,
    compile_model: Callable[[nn.Module], nn.Module],
    *,
    sampling: int,
    steps: int,
    train: Callable[[nn.Module, int], list[float]] = train_steps,
    train_eager: Callable[[nn.Module, int], list[float]] | None = None,
) -> tuple[Series, Series, dict[str, Any]]:
    """Train three copies of ``base`` ``steps`` steps of ``train`` (which returns the
    losses): observed eagerly (with ``train_eager`` where given), observed and compiled
    by ``compile_model`` (which returns what to train), and compiled the same way
    without the observer; training must be bit-identical to the last's. The eager and
    compiled series and the compiled run's report."""
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    inject_observer(eager, output_dir=directory / "eager", sampling=sampling)
    (train_eager or train)(eager, steps)
    remove_observer(eager)
    inject_observer(observed, output_dir=directory / "compiled", sampling=sampling)
    losses = train(compile_model(observed), steps)
    report = remove_observer_and_read(observed, directory / "compiled")
    assert losses == train(compile_model(twin), steps)
    assert_same_model(observed, twin)
    return written_series(directory / "eager"), written_series(directory / "compiled"), report


def compile_block(model: nn.Module) -> nn.Module:
    """:class:`NonReentrantNet` (or a subclass) with its block compiled (aot_eager)."""
    assert isinstance(model, NonReentrantNet)
    compiled = torch.compile(model.block, backend="aot_eager")
    model.run_block = cast(Callable[[Tensor], Tensor], compiled)
    return model


def aot_eager(model: nn.Module, **options: Any) -> nn.Module:
    return cast(nn.Module, torch.compile(model, backend="aot_eager", **options))


def test_a_compiled_block_under_non_reentrant_checkpointing(tmp_path: Path) -> None:
    """``checkpoint(compiled_block, h, use_reentrant=False)`` recomputes the block's graph
    in the backward, where the sample is over: were the hooks traced into the graph, the
    recomputation would run the unsampled variant and ``torch.utils.checkpoint`` would
    raise (another number of saved tensors). Traced under the checkpoint's saved-tensor
    hooks, they stay graph breaks: training equals the compiled twin's, every series
    (the block's output gradients included) the eager path's, and the coverage says so."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        NonReentrantNet(), tmp_path, compile_block, sampling=2, steps=8
    )
    assert ("block.1", 0, "grad_output", "output", "rms") in compiled
    assert_same_telemetry(eager, compiled)
    coverage = report["coverage"]["compiled_capture"]
    assert coverage["mode"] == (
        "graph_breaks: traced under saved-tensor hooks (activation checkpointing)"
    )
    assert coverage["slots"] == 0
    assert coverage["calls_under_saved_tensor_hooks"] >= 3  # block.0, block.1, block.2
    assert report["coverage"]["errors_total"] == 0


class SweepCheckpointNet(NonReentrantNet):
    """:class:`NonReentrantNet` with its block compiled at construction (``aot_eager``),
    a class of its own for a sweep."""

    def __init__(self) -> None:
        super().__init__()
        self.run_block = cast(
            Callable[[Tensor], Tensor], torch.compile(self.block, backend="aot_eager")
        )

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.run_block, self.inp(x), use_reentrant=False)
        assert isinstance(h, Tensor)
        return self.head(h)


def test_a_sweep_of_compiled_blocks_under_checkpointing_reports_each_run(
    tmp_path: Path, fresh_dynamo
) -> None:
    """Four runs in one process, each a new :class:`SweepCheckpointNet` observed: only
    the first compiles, and every run's report says its block's hooks ran as graph
    breaks under saved-tensor hooks (counted as they run: the report said ``unused``
    from the second run on, when the count was taken while tracing) and has the
    block's output gradients."""
    from torch._dynamo.utils import counters

    for run in range(4):
        torch.manual_seed(run)
        model = SweepCheckpointNet()
        inject_observer(model, output_dir=tmp_path / str(run), sampling=2)
        frames = counters["frames"]["total"]
        train_steps(model, 4)
        report = remove_observer_and_read(model, tmp_path / str(run))
        if run:
            assert counters["frames"]["total"] == frames, run
        capture = report["coverage"]["compiled_capture"]
        assert capture["mode"] == (
            "graph_breaks: traced under saved-tensor hooks (activation checkpointing)"
        ), run
        # Two sampled forwards: the 3 block modules' hooks in the forward and 2 in the
        # recomputation (torch.utils.checkpoint stops recomputing once the tensors the
        # backward needs are back, before the last module's hook).
        assert capture["calls_under_saved_tensor_hooks"] == 2 * (3 + 2), run
        series = written_series(tmp_path / str(run))
        assert len(series[("block.1", 0, "grad_output", "output", "rms")]) == 2, run


def test_a_compiled_block_under_reentrant_checkpointing(tmp_path: Path) -> None:
    """``checkpoint(compiled_block, h, use_reentrant=True)``: the first pass (no grad) is
    reduced inside the graph, and training equals the compiled twin's. The block's
    activations equal the eager path's; its output gradients are not captured (the
    recomputation in the backward runs the unsampled graph, as documented in
    ``_compiled_capture.py``); every other series equals the eager path's."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        ReentrantNet(), tmp_path, compile_block, sampling=2, steps=8
    )
    block_gradients = {k for k in eager if k[0].startswith("block.") and k[2] == "grad_output"}
    assert len(block_gradients) > 0 and not block_gradients & set(compiled)
    assert_same_telemetry({k: v for k, v in eager.items() if k not in block_gradients}, compiled)
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"
    assert report["coverage"]["compiled_capture"]["slots"] == 3


def accumulate(model: nn.Module, steps: int) -> list[float]:
    """Gradient accumulation: two forwards, then one backward of their summed loss, per
    step."""
    generator = torch.Generator().manual_seed(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum(model(torch.randn(8, 6, generator=generator)).square().mean() for _ in "ab")
        assert isinstance(loss, Tensor)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_unsampled_forwards_run_a_graph_of_their_own_compiled_once(tmp_path: Path) -> None:
    """Sampling every 2nd forward: one graph with the reductions, one without, each
    compiled once over 8 forwards (Dynamo picks by its guard); 4 samples observed. Then
    gradient accumulation (a sampled and an unsampled forward before each backward):
    the sampled forward's output gradients are taken after that backward. Training
    equals the compiled twin's, every series the eager path's."""
    from torch._dynamo.utils import counters

    class EveryOtherNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(6, 8)
            self.fc2 = nn.Linear(8, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc2(torch.tanh(self.fc1(x)))

    torch.manual_seed(0)
    model = EveryOtherNet()
    twin, eager = copy.deepcopy(model), copy.deepcopy(model)
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=2)
    train_on_noise(eager, 8)
    accumulate(eager, 2)
    remove_observer(eager)
    inject_observer(model, output_dir=tmp_path / "compiled", sampling=2)
    graphs = counters["stats"]["unique_graphs"]
    compiled = cast(nn.Module, torch.compile(model, backend="aot_eager", fullgraph=True))
    losses = train_on_noise(compiled, 8)
    assert counters["stats"]["unique_graphs"] - graphs == 2
    losses += accumulate(compiled, 2)
    assert counters["stats"]["unique_graphs"] - graphs == 2
    report = remove_observer_and_read(model, tmp_path / "compiled")
    plain = cast(nn.Module, torch.compile(twin, backend="aot_eager"))
    assert losses == train_on_noise(plain, 8) + accumulate(plain, 2)
    series = written_series(tmp_path / "compiled")
    assert len(series[("fc1", 0, "activation", "output", "rms")]) == 6
    assert len(series[("fc1", 0, "grad_output", "output", "rms")]) == 6
    assert_same_telemetry(written_series(tmp_path / "eager"), series)
    assert report["coverage"]["samples_observed"] == 6


def test_gpt2_observed_with_no_graph_break(tmp_path: Path) -> None:
    """A ``transformers`` GPT-2 (two blocks, from a config): no graph break with the
    observer, one graph; every observed submodule output traced into it. Its attention
    logits are not measured inside the graph: the report counts the two traced calls."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config)
    handle = inject_observer(model, output_dir=tmp_path, sampling=1)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(model)(input_ids=ids)
    observer = handle._observer
    remove_observer(model)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1
    assert observer is not None and observer.compiled_capture is not None
    traced = {observer.names[key[0]] for key in observer.compiled_capture.measured}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.act", "lm_head"} <= traced
    coverage = read_report(tmp_path)["coverage"]["compiled_capture"]
    assert coverage["attention_calls_not_measured"] == 2


# -------------------------------------------------- compile before and after injection
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


def test_between_unsampled_compiled_forwards_the_root_post_hook_is_parked(
    tmp_path: Path,
) -> None:
    """Compiled, the submodule hooks are parked in unsampled forwards and the root's
    post-hook is out of the root between forwards that need nothing at its end, as in
    eager training: over 48 forwards sampled every 16th it is out after each of the 45
    unsampled ones (put back for the forwards the root sentinel checks, which take it
    out again at their end), no graph is compiled after the first two, and the forward,
    sample and root sentinel counts are the eager twin's."""
    from torch._dynamo.utils import counters

    from torchinstruments._sentinel import ROOT_SENTINEL_INTERVAL, root_sentinel_due
    from torchinstruments.capture import RootPostHook

    class ParkedPostNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(6, 8)
            self.fc2 = nn.Linear(8, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc2(torch.tanh(self.fc1(x)))

    torch.manual_seed(0)
    model = ParkedPostNet()
    eager = copy.deepcopy(model)
    inject_observer(eager, output_dir=tmp_path / "eager", sampling=16)
    train_on_noise(eager, 48)
    eager_report = remove_observer_and_read(eager, tmp_path / "eager")
    inject_observer(model, output_dir=tmp_path / "compiled", sampling=16)
    compiled = cast(nn.Module, torch.compile(model, backend="aot_eager"))
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    out_after = []
    graphs = 0
    for step in range(48):
        optimizer.zero_grad()
        compiled(torch.randn(8, 6, generator=generator)).square().mean().backward()
        optimizer.step()
        if step == 1:
            graphs = counters["stats"]["unique_graphs"]
        if not any(isinstance(hook, RootPostHook) for hook in model._forward_hooks.values()):
            out_after.append(step)
    assert counters["stats"]["unique_graphs"] == graphs
    assert out_after == [step for step in range(48) if step % 16]
    report = remove_observer_and_read(model, tmp_path / "compiled")
    for key in ("forwards_seen", "samples_seen"):
        assert report["run"][key] == eager_report["run"][key]
    assert report["coverage"]["samples_observed"] == 3
    checks = sum(root_sentinel_due(step, ROOT_SENTINEL_INTERVAL) for step in range(48) if step % 16)
    assert checks == 6
    assert report["coverage"]["sentinel_checks"] == eager_report["coverage"]["sentinel_checks"]
    assert report["coverage"]["sentinel_checks"] == checks


class Block(nn.Module):
    """One block of :class:`BlockStack` (every block shares this ``forward``'s code)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


class BlockStack(nn.Module):
    """``blocks`` blocks of one class, then a linear head."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def compile_each_block(model: nn.Module) -> nn.Module:
    """:class:`BlockStack` with ``block.compile()`` (aot_eager) for each block."""
    assert isinstance(model, BlockStack)
    for block in model.blocks:
        block.compile(backend="aot_eager")
    return model


@pytest.mark.parametrize("sampling", [1, 2])
def test_blocks_compiled_one_by_one_share_their_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sampling: int
) -> None:
    """Twelve blocks of one class, each compiled with ``block.compile()``, share one code
    object: every block runs the graphs traced for the first (a module's rows are graph
    inputs, never constants), so Dynamo's recompile limit (8) is never reached. At most
    4 graphs: sampled and unsampled (``sampling=2``: hooks parked), each for the first
    block's input, which does not require grad, and for the others'. Every block's output
    is measured in every sample, equal to the eager path's; training equals the compiled
    twin's."""
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters, "unimplemented", type(counters["unimplemented"])())
    torch.manual_seed(0)
    torch._dynamo.reset()  # no entry of Block.forward from another test
    graphs = counters["stats"]["unique_graphs"]
    eager, compiled, report = observe_eager_and_compiled(
        BlockStack(12), tmp_path, compile_each_block, sampling=sampling, steps=4
    )
    # The observed copy and its twin each compile their graphs.
    assert counters["stats"]["unique_graphs"] - graphs <= 2 * (2 if sampling == 1 else 4)
    coverage = report["coverage"]["compiled_capture"]
    assert coverage["mode"] == "in_graph"
    assert coverage["recompile_limit_hits"] == 0
    assert coverage["slots"] == 12 * 2  # every block's fc (the leaves), both signals
    for index in range(12):
        assert len(compiled[(f"blocks.{index}.fc", 0, "activation", "output", "rms")]) == (
            4 // sampling
        )
    assert_same_telemetry(eager, compiled)


def test_gpt2_blocks_compiled_one_by_one_share_their_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A six-layer ``transformers`` GPT-2 whose blocks are each compiled
    (``block.compile()``, as one compiles a model block by block): the six blocks share
    their graphs (every forward sampled, every block's input requiring grad), the recompile
    limit is never reached, and every block's attention projection and MLP input
    projection are measured in every sample, with their output gradients."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters, "unimplemented", type(counters["unimplemented"])())
    torch.manual_seed(0)
    torch._dynamo.reset()
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=6, n_head=2, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config)
    handle = inject_observer(model, output_dir=tmp_path, sampling=1)
    for block in model.transformer.h:
        block.compile(backend="aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        ids = torch.randint(0, 64, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        if step == 1:
            handle.flush()
    compiled_graphs = counters["stats"]["unique_graphs"] - graphs
    report = remove_observer_and_read(model, tmp_path)
    torch._dynamo.reset()
    # One graph, and one more where the attention modules come to be observed (they call
    # scaled_dot_product_attention): for all six blocks.
    assert compiled_graphs <= 2, compiled_graphs
    coverage = report["coverage"]
    assert coverage["compiled_capture"]["recompile_limit_hits"] == 0
    assert "torch_compile_recompile_limit" not in coverage["limits_hit"]
    series = written_series(tmp_path)
    for index in range(6):
        key = (f"transformer.h.{index}.attn.c_attn", 0, "activation", "output", "rms")
        assert len(series[key]) == 6, index
        grad = (f"transformer.h.{index}.mlp.c_fc", 0, "grad_output", "output", "rms")
        assert len(series[grad]) == 6, index
        # Measured in the shared graph from the second sample on, each block's own.
        logits = (f"transformer.h.{index}.attn", 0, "activation", "attention_logits", "rms")
        assert [sample for sample, _ in series[logits]] == [1, 2, 3, 4, 5], index
    values = {
        series[(f"transformer.h.{i}.attn", 0, "activation", "attention_logits", "rms")][0][1]
        for i in range(6)
    }
    assert len(values) == 6  # six blocks, six different values


class SweepNet(nn.Module):
    """Linear -> tanh -> Linear -> Identity -> Linear; input ``(batch, 6)``, output
    ``(batch, 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.keep = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.keep(self.fc2(torch.tanh(self.fc1(x)))))


def test_a_sweep_in_one_process_compiles_the_observed_class_once(
    tmp_path: Path, fresh_dynamo
) -> None:
    """Ten runs in one process, each a new model of one class, compiled whole, observed
    and removed (a hyperparameter sweep): the graphs compiled for the first observer
    serve every later one, so no run compiles anything and none reaches
    ``recompile_limit`` (8: each observer compiled graphs of its own, and the eighth run
    trained uncompiled). Each run's telemetry equals the eager path's for the same
    batches (but for the output gradient of ``nn.Identity``, whose output is its input,
    not tapped in graphs), each report counts that gradient not captured (the rows say
    so, although only the first observer's graphs were traced), and training equals a
    compiled model never observed."""
    from torch._dynamo.utils import counters

    graphs_after_first_run = 0
    for run in range(10):
        torch.manual_seed(run)
        eager_series, series, report = observe_eager_and_compiled(
            SweepNet(), tmp_path / str(run), aot_eager, sampling=2, steps=6
        )
        if run == 0:
            graphs_after_first_run = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs_after_first_run, run
        coverage = report["coverage"]["compiled_capture"]
        assert (coverage["mode"], coverage["recompile_limit_hits"]) == ("in_graph", 0), run
        assert coverage["gradients_not_captured"] == 1, run
        assert len(series[("fc2", 0, "grad_output", "output", "rms")]) == 3, run
        untapped = ("keep", 0, "grad_output")
        assert {k[:3] for k in eager_series} - {k[:3] for k in series} == {untapped}, run
        assert_same_telemetry({k: v for k, v in eager_series.items() if k[:3] != untapped}, series)


def test_a_sweep_of_gpt2_models_compiles_nothing_after_its_first_run(
    tmp_path: Path, fresh_dynamo
) -> None:
    """Three runs of a ``transformers`` GPT-2 sweep in one process (a new model each,
    compiled whole, observed, removed): after the first run no frame is compiled again.
    ``transformers`` decorates ``forward``: the decorator's frame breaks before calling
    the model's own ``forward`` and checks nothing inside the model, so injection and
    removal keep its entry (they invalidated it, and each run compiled three frames
    again, about 8 s a run on 2 CPUs, until the limit)."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False
    )
    generator = torch.Generator().manual_seed(0)
    compiled_after_first_run = (0, 0)
    for run in range(3):
        torch.manual_seed(run)
        model = transformers.GPT2LMHeadModel(config)
        inject_observer(model, output_dir=tmp_path / str(run), sampling=1)
        compiled = aot_eager(model)
        for _ in range(2):
            ids = torch.randint(0, 64, (2, 16), generator=generator)
            compiled(input_ids=ids, labels=ids).loss.backward()
        report = remove_observer_and_read(model, tmp_path / str(run))
        compiled_so_far = (counters["frames"]["ok"], counters["stats"]["unique_graphs"])
        if run == 0:
            compiled_after_first_run = compiled_so_far
        assert compiled_so_far == compiled_after_first_run, run
        coverage = report["coverage"]["compiled_capture"]
        assert (coverage["mode"], coverage["recompile_limit_hits"]) == ("in_graph", 0), run


class StepSweepNet(nn.Module):
    """:class:`SweepNet`'s layers without the ``nn.Identity``, a code object of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.fc2(torch.tanh(self.fc1(x))))


def test_a_compiled_step_function_serves_every_run_of_a_sweep(tmp_path: Path, fresh_dynamo) -> None:
    """One compiled function computing the loss, called with each run's new model: its
    entry meets the observed root's pre-hook, a graph break, before it calls the model,
    and checks nothing inside the model, so injection keeps it (it was invalidated at
    each injection and stayed in the cache: the eighth run reached ``recompile_limit``).
    Eight runs keep one entry; each run's telemetry equals the eager path's."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    def loss_of(model: nn.Module, x: Tensor) -> Tensor:  # a code object of this test's
        return square_loss(model, x)

    compiled_loss = torch.compile(loss_of, backend="aot_eager")
    train_compiled = functools.partial(train_steps, loss_of=compiled_loss)

    entries = []
    for run in range(8):
        torch.manual_seed(run)
        eager_series, series, report = observe_eager_and_compiled(
            StepSweepNet(),
            tmp_path / str(run),
            lambda model: model,
            sampling=2,
            steps=4,
            train=train_compiled,
            train_eager=train_steps,
        )
        coverage = report["coverage"]["compiled_capture"]
        assert (coverage["mode"], coverage["recompile_limit_hits"]) == ("in_graph", 0), run
        assert_same_telemetry(eager_series, series)
        entries.append(len(_debug_get_cache_entry_list(loss_of.__code__)))
    assert entries == [1] * 8


def test_a_model_without_parameters_is_observed_inside_the_graph(tmp_path: Path) -> None:
    """A model with neither parameters nor buffers gives no device for the rows: they
    are made on the CPU, and its modules are measured inside the graph as eagerly (their
    series were missing, and the report said the capture was not used)."""

    class Scale(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x * 2.0

    class ParameterFreeNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Scale(), Scale()

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.tanh(self.a(x)))

    model = ParameterFreeNet()
    inject_observer(model, output_dir=tmp_path / "eager", sampling=1)
    for seed in range(3):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)))
    remove_observer(model)
    inject_observer(model, output_dir=tmp_path / "compiled", sampling=1)
    compiled = aot_eager(model)
    for seed in range(3):
        compiled(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)))
    report = remove_observer_and_read(model, tmp_path / "compiled")
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"
    series = written_series(tmp_path / "compiled")
    assert {key[0] for key in series} >= {"a", "b"}
    assert_same_telemetry(written_series(tmp_path / "eager"), series)


class ReinjectedNet(nn.Module):
    """:class:`SweepNet`'s layers, with a ``forward`` code object of its own (Dynamo
    keeps cache entries per code object)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.fc2(torch.tanh(self.fc1(x))))


def test_injecting_again_into_a_compiled_model_compiles_nothing_more(
    tmp_path: Path, fresh_dynamo
) -> None:
    """Ten injections and removals on one compiled model: the second and later
    observers run the graphs compiled for the first (with the hooks and, after removal,
    without), so the cache entries of the model's ``forward`` stay at three and
    ``recompile_limit`` is never reached; every observer measures each of its samples
    in the graph, its output gradients included."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = ReinjectedNet()
    compiled = aot_eager(model)
    train_steps(compiled, 2)
    entries = []
    graphs = 0
    for cycle in range(10):
        inject_observer(model, output_dir=tmp_path / str(cycle), sampling=2)
        train_steps(compiled, 4)
        report = remove_observer_and_read(model, tmp_path / str(cycle))
        train_steps(compiled, 2)
        if cycle == 0:
            graphs = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs, cycle
        entries.append(len(_debug_get_cache_entry_list(ReinjectedNet.forward.__code__)))
        coverage = report["coverage"]["compiled_capture"]
        assert (coverage["mode"], coverage["recompile_limit_hits"]) == ("in_graph", 0), cycle
        series = written_series(tmp_path / str(cycle))
        assert len(series[("fc1", 0, "grad_output", "output", "rms")]) == 2, cycle
    # The entry compiled before the first injection (invalidated then: a model never
    # observed compiles without hook guards), the one with the observer's hooks, and the
    # one without them, compiled after the first removal.
    assert entries == [3] * 10


def test_the_recompile_limit_is_counted_and_named_in_limits_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block compiled with ``dynamic=False`` meets three batch sizes: each is a cache
    entry of its own, and with ``recompile_limit`` 2 the third runs uncompiled. The
    report counts the stop and names the limit; the block is observed in every sample
    (eagerly once uncompiled); training is unchanged."""
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters, "unimplemented", type(counters["unimplemented"])())
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = BlockStack(1)
    twin = copy.deepcopy(model)
    inject_observer(model, output_dir=tmp_path, sampling=1)
    for stack in (model, twin):
        stack.blocks[0].compile(backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        losses = [
            train_on_noise(model, 1, seed, rows=rows)[0] for seed, rows in enumerate((4, 8, 16))
        ]
        report = remove_observer_and_read(model, tmp_path)
        torch._dynamo.reset()
        twin_losses = [
            train_on_noise(twin, 1, seed, rows=rows)[0] for seed, rows in enumerate((4, 8, 16))
        ]
    assert losses == twin_losses
    coverage = report["coverage"]
    assert coverage["compiled_capture"]["mode"] == "in_graph"
    assert coverage["compiled_capture"]["recompile_limit_hits"] == 1
    assert "torch_compile_recompile_limit" in coverage["limits_hit"]
    series = written_series(tmp_path)[("blocks.0.fc", 0, "activation", "output", "rms")]
    assert len(series) == 3


def test_blocks_compiled_before_injection_keep_their_names(tmp_path: Path) -> None:
    """``model.blocks[i] = torch.compile(block)`` before injecting: the blocks' modules
    are named as when they are compiled after it (``blocks.0.fc``, no ``_orig_mod``), so
    that reports of the two compare module by module."""

    model = BlockStack(2)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = cast(nn.Module, torch.compile(block, backend="eager"))
    inject_observer(model, output_dir=tmp_path, sampling=1)
    train_on_noise(model, 2)
    remove_observer(model)
    modules = {key[0] for key in written_series(tmp_path)}
    assert modules == {"<root>", "blocks.0.fc", "blocks.1.fc", "head"}


class LayerDropStack(BlockStack):
    """:class:`BlockStack` whose blocks after the first are skipped where ``drop``."""

    drop = False

    def forward(self, x: Tensor) -> Tensor:
        for index, block in enumerate(self.blocks):
            if not (self.drop and index):
                x = block(x)
        return self.head(x)


def test_compiled_blocks_skipped_in_some_samples_lose_no_gradients(tmp_path: Path) -> None:
    """LayerDrop: compiled blocks skipped in every other sampled step (one forward, one
    backward each). A sample whose backward ran with nothing in the gradient sinks ran
    no graph with taps: no gradient sample is counted lost, and the skipped blocks have
    a gradient row in each step they ran."""
    torch.manual_seed(0)
    model = LayerDropStack(3)
    inject_observer(model, output_dir=tmp_path, sampling=1)
    for block in model.blocks[1:]:
        block.compile(backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        model.drop = step % 2 == 1
        model(torch.randn(4, 6, generator=generator)).square().mean().backward()
    report = remove_observer_and_read(model, tmp_path)
    coverage = report["coverage"]
    assert coverage["compiled_capture"]["gradient_samples_lost"] == 0
    assert "compiled_gradient_samples" not in coverage["limits_hit"]
    series = written_series(tmp_path)
    for name, samples in (("blocks.0.fc", [0, 1, 2, 3, 4, 5]), ("blocks.2.fc", [0, 2, 4])):
        for signal in ("activation", "grad_output"):
            assert [p[0] for p in series[(name, 0, signal, "output", "rms")]] == samples


def forwards_then_one_backward(
    model: nn.Module,
    steps: int,
    forwards: int,
    after_first_step: Callable[[], None] | None = None,
) -> list[float]:
    """``steps`` SGD steps of ``forwards`` forwards each (views of one batch, as in
    contrastive training) and one backward of their summed losses; the losses.
    ``after_first_step`` is called once the first step is done."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        views = [model(torch.randn(4, 6, generator=generator)) for _ in range(forwards)]
        loss = torch.stack([view.square().mean() for view in views]).sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 0 and after_first_step is not None:
            after_first_step()
    return losses


def observe_views(
    directory: Path, forwards: int, steps: int = 3
) -> tuple[Series, Series, dict[str, Any], int]:
    """:class:`CompileNet` trained by :func:`forwards_then_one_backward`, every forward
    sampled, observed eagerly (nothing counted lost) and compiled (aot_eager), training
    bit-identical to the compiled twin's: the eager and compiled series, the compiled
    run's report and the graphs compiled after the first step."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = CompileNet()
    eager, observed, twin = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    inject_observer(eager, output_dir=directory / "eager", sampling=1)
    forwards_then_one_backward(eager, steps, forwards)
    eager_report = remove_observer_and_read(eager, directory / "eager")
    # Eagerly nothing is lost, however many forwards precede the backward.
    assert eager_report["coverage"]["compiled_capture"]["gradient_samples_lost"] == 0
    assert "compiled_gradient_samples" not in eager_report["coverage"]["limits_hit"]
    inject_observer(observed, output_dir=directory / "compiled", sampling=1)
    graphs: list[int] = []
    losses = forwards_then_one_backward(
        aot_eager(observed),
        steps,
        forwards,
        lambda: graphs.append(counters["stats"]["unique_graphs"]),
    )
    later_graphs = counters["stats"]["unique_graphs"] - graphs[0]
    report = remove_observer_and_read(observed, directory / "compiled")
    assert losses == forwards_then_one_backward(aot_eager(twin), steps, forwards)
    assert_same_model(observed, twin)
    return (
        written_series(directory / "eager"),
        written_series(directory / "compiled"),
        report,
        later_graphs,
    )


def test_two_sampled_forwards_before_one_backward_keep_their_gradients_apart(
    tmp_path: Path,
) -> None:
    """Every forward sampled, two forwards before each backward: each sample has
    gradient sinks of its own (the second gradient set is made for the second sample,
    and handing the hooks either set compiles nothing again), so every sample's output
    gradients are recorded and equal the eager path's; none is counted lost."""
    eager, compiled, report, later_graphs = observe_views(tmp_path, forwards=2)
    assert later_graphs == 0
    assert report["coverage"]["compiled_capture"]["gradient_samples_lost"] == 0
    assert "compiled_gradient_samples" not in report["coverage"]["limits_hit"]
    gradients = {key: points for key, points in compiled.items() if key[2] == "grad_output"}
    assert {key[0] for key in gradients} == {"<root>", "fc1", "act", "fc2"}
    for key, points in gradients.items():
        assert [point[0] for point in points] == [0, 1, 2, 3, 4, 5], key
    assert_same_telemetry(eager, compiled)


def test_more_sampled_forwards_than_gradient_sets_before_one_backward_are_counted(
    tmp_path: Path,
) -> None:
    """Six sampled forwards before each backward, four gradient sets: the fifth and sixth
    samples take the sets of the first and second, whose gradients then mix two
    samples' and are not recorded (four samples counted lost a step, said in the
    report); the third and fourth samples' output gradients are recorded, equal to the
    eager path's."""
    from torchinstruments._compiled_capture import MAX_GRADIENT_SETS

    assert MAX_GRADIENT_SETS == 4
    eager, compiled, report, _ = observe_views(tmp_path, forwards=6, steps=2)
    assert report["coverage"]["compiled_capture"]["gradient_samples_lost"] == 2 * 4
    assert "compiled_gradient_samples" in report["coverage"]["limits_hit"]
    recorded = [2, 3, 8, 9]
    for key, points in compiled.items():
        if key[2] == "grad_output" and key[0] != "<root>":
            assert [point[0] for point in points] == recorded, key
            expected = [point for point in eager[key] if point[0] in recorded]
            assert_same_telemetry({key: expected}, {key: points})
    index = (tmp_path / "compiled" / "index.md").read_text()
    assert "output gradients of 8 samples." in index


class RetainGraphNet(CompileNet):
    """:class:`CompileNet` with a forward of its own: Dynamo caches compiled code per code
    object, and a backward that other tests compiled donates its buffers, which refuses
    ``retain_graph=True``."""

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def two_losses_two_backward_passes(model: nn.Module, steps: int) -> list[float]:
    """SGD steps of one forward each; on even steps two losses of its output, each with
    a backward pass of its own (the first with ``retain_graph=True``), on odd steps one."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        output = model(torch.randn(4, 6, generator=generator))
        loss = output.square().mean()
        if step % 2 == 0:
            loss.backward(retain_graph=True)
            second = output.abs().mean()
            second.backward()
            loss = loss + second
        else:
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_second_backward_pass_over_a_sample_leaves_its_compiled_gradients_out(
    tmp_path: Path,
) -> None:
    """Two backward passes over one sampled forward (``retain_graph=True``): eagerly the
    recorded output gradient is the total of both passes'; a graph's gradient sink sums
    both passes' rows, which are not the rows of the total, so the compiled modules'
    output gradients of those samples (0 and 2) are left out and counted, and the
    others (1 and 3) equal the eager path's, as do all activations and the root's
    output gradients (the root is observed eagerly around the compiled frame)."""
    torch.manual_seed(0)
    eager_series, compiled_series, report = observe_eager_and_compiled(
        RetainGraphNet(),
        tmp_path,
        aot_eager,
        sampling=1,
        steps=4,
        train=two_losses_two_backward_passes,
    )
    assert read_report(tmp_path / "eager")["coverage"]["backward_gradients_summed"] > 0
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"
    assert report["coverage"]["compiled_capture"]["gradient_samples_lost"] == 2
    assert "compiled_gradient_samples" in report["coverage"]["limits_hit"]
    assert sorted(compiled_series) == sorted(eager_series)
    for key, points in compiled_series.items():
        in_graph_gradient = key[2] == "grad_output" and key[0] != "<root>"
        expected = [p for p in eager_series[key] if not in_graph_gradient or p[0] in (1, 3)]
        assert [p[0] for p in points] == ([1, 3] if in_graph_gradient else [0, 1, 2, 3]), key
        assert_same_telemetry({key: expected}, {key: points})


class TwoHeadNet(nn.Module):
    """A trunk and two heads; the forward returns both heads' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.head_a = nn.Linear(8, 1)
        self.head_b = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.head_a(h), self.head_b(h)


def one_backward_pass_per_head(model: nn.Module, steps: int) -> list[float]:
    """SGD steps of one forward and a backward pass from each head's loss (the first
    with ``retain_graph=True``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        a, b = model(torch.randn(4, 6, generator=generator))
        loss_a, loss_b = a.square().mean(), b.abs().mean()
        loss_a.backward(retain_graph=True)
        loss_b.backward()
        optimizer.step()
        losses.append((loss_a + loss_b).item())
    return losses


def test_backward_passes_from_two_outputs_of_one_sample_are_counted(tmp_path: Path) -> None:
    """Two backward passes over one forward, each from another output: the second is
    known as another pass by its autograd graph task (no output gradient repeats at
    the root), so the compiled modules' output gradients are left out and every sample
    counted; activations and the root's gradients equal the eager path's."""
    torch.manual_seed(0)
    eager_series, compiled_series, report = observe_eager_and_compiled(
        TwoHeadNet(), tmp_path, aot_eager, sampling=1, steps=3, train=one_backward_pass_per_head
    )
    assert report["coverage"]["compiled_capture"]["gradient_samples_lost"] == 3
    expected = {k: v for k, v in eager_series.items() if k[2] == "activation" or k[0] == "<root>"}
    assert ("trunk", 0, "grad_output", "output", "rms") in eager_series
    assert_same_telemetry(expected, compiled_series)


def consistency_steps(model: nn.Module, steps: int) -> list[float]:
    """SGD steps of two forwards A and B of one batch (B's input shifted): A's loss has a
    backward pass of its own (``retain_graph=True``), then one pass of the consistency
    loss between A and B and of B's loss, which runs through A's graph again."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(4, 6, generator=generator)
        a = model(x)
        loss_a = a.square().mean()
        loss_a.backward(retain_graph=True)
        b = model(x + 0.1)
        loss = (a - b).square().mean() + b.abs().mean()
        loss.backward()
        optimizer.step()
        losses.append((loss_a + loss).item())
    return losses


def test_a_second_backward_pass_after_a_later_forward_is_counted(tmp_path: Path) -> None:
    """A's second backward pass comes after B's forward, when A's rows were taken: the
    late gradients reach A's own gradient set (a sample opens on the free set taken
    longest ago), not B's, so B's output gradients equal the eager path's; A's rows
    are taken back and A counted lost. The first sample's rows are read at once (until
    then it is not known which modules the graphs ran), before its second pass: they
    stay, from its first pass only (counted all the same)."""
    torch.manual_seed(0)
    eager_series, compiled_series, report = observe_eager_and_compiled(
        RetainGraphNet(), tmp_path, aot_eager, sampling=1, steps=3, train=consistency_steps
    )
    assert report["coverage"]["compiled_capture"]["gradient_samples_lost"] == 3
    for key, points in compiled_series.items():
        if key[2] == "grad_output" and key[0] != "<root>":
            assert [p[0] for p in points] == [0, 1, 3, 5], key
            expected = [p for p in eager_series[key] if p[0] in (1, 3, 5)]
            assert_same_telemetry({key: expected}, {key: points[1:]})
        elif key[2] == "grad_output":  # the root, observed eagerly: sample 0 read at once
            assert_same_telemetry({key: eager_series[key][1:]}, {key: points[1:]})
        else:
            assert_same_telemetry({key: eager_series[key]}, {key: points})
    # The root's sample 0 was read before its second pass: that gradient is not summed.
    assert report["coverage"]["backward_gradients_not_summed"] == 1


def backward_out_of_forward_order(model: nn.Module, steps: int) -> list[float]:
    """SGD steps of three forwards A, B, C with their backward passes in the order A, B,
    backward of B, C, backward of A, backward of C (gradients accumulate, one optimizer
    step after the three); the summed losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss_a = model(torch.randn(4, 6, generator=generator)).square().mean()
        loss_b = model(torch.randn(4, 6, generator=generator)).square().mean()
        loss_b.backward()
        loss_c = model(torch.randn(4, 6, generator=generator)).square().mean()
        loss_a.backward()
        loss_c.backward()
        optimizer.step()
        losses.append((loss_a + loss_b + loss_c).item())
    return losses


def test_backward_passes_out_of_forward_order_keep_each_samples_gradients(
    tmp_path: Path,
) -> None:
    """A sample whose backward runs after a later sample's (A after B) keeps its gradient
    set until its own backward: every sample's output gradients are recorded, none is
    counted lost, and all series equal the eager path's."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        CompileNet(), tmp_path, aot_eager, sampling=1, steps=2, train=backward_out_of_forward_order
    )
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"
    assert report["coverage"]["compiled_capture"]["gradient_samples_lost"] == 0
    for key, points in compiled.items():
        if key[2] == "grad_output":
            assert [point[0] for point in points] == [0, 1, 2, 3, 4, 5], key
    assert_same_telemetry(eager, compiled)


def gradients_of_the_parameters_only(model: nn.Module, steps: int, how: str) -> list[float]:
    """SGD steps whose gradients come from ``torch.autograd.grad(loss, params)`` (put
    into ``.grad``), where ``how`` is ``"grad"``, or from
    ``loss.backward(inputs=params)``, where it is ``"inputs"``; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    params = list(model.parameters())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 6, generator=generator)).square().mean()
        if how == "grad":
            for param, grad in zip(params, torch.autograd.grad(loss, params), strict=True):
                param.grad = grad
        else:
            loss.backward(inputs=params)
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("how", ["grad", "inputs"])
def test_a_backward_pass_up_to_the_parameters_only_is_counted(tmp_path: Path, how: str) -> None:
    """``torch.autograd.grad(loss, params)`` and ``loss.backward(inputs=params)`` run
    the graph up to the parameters only, not into the gradient sinks: the compiled
    modules' output gradients are not recorded, and every sample is counted in
    ``gradient_samples_lost`` (said in the report); activations and the root's output
    gradients (observed eagerly) equal the eager path's, training is unchanged."""
    torch.manual_seed(0)
    eager_series, compiled_series, report = observe_eager_and_compiled(
        CompileNet(),
        tmp_path,
        aot_eager,
        sampling=1,
        steps=3,
        train=functools.partial(gradients_of_the_parameters_only, how=how),
    )
    eager_report = read_report(tmp_path / "eager")
    assert eager_report["coverage"]["compiled_capture"]["gradient_samples_lost"] == 0
    compiled_capture = report["coverage"]["compiled_capture"]
    assert compiled_capture["mode"] == "in_graph"
    assert compiled_capture["gradient_samples_lost"] == 3
    assert "compiled_gradient_samples" in report["coverage"]["limits_hit"]
    expected = {
        key: points
        for key, points in eager_series.items()
        if key[2] == "activation" or key[0] == "<root>"
    }
    assert {key[0] for key in eager_series if key[2] == "grad_output"} == {
        "<root>",
        "fc1",
        "act",
        "fc2",
    }
    assert_same_telemetry(expected, compiled_series)


def test_injecting_into_a_model_never_compiled_invalidates_nothing(tmp_path: Path) -> None:
    """Dynamo loaded, but no compiled code of the model (a class of its own): the
    report says ``none``."""

    class NeverCompiled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x)

    model = NeverCompiled()
    inject_observer(model, output_dir=tmp_path, sampling=1)
    train_on_noise(model, 1)
    report = remove_observer_and_read(model, tmp_path)
    assert report["coverage"]["compiled_capture"]["compiled_code_invalidation"] == "none"


def test_rows_from_graphs_take_forward_positions_children_first() -> None:
    """Rows from graphs become pending in the order forward hooks fire in a nested
    forward: each module after its descendants, siblings in definition order; a name
    not in the model comes last."""
    from torchinstruments._compiled_capture import _post_order

    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), nn.ReLU()),
        nn.Linear(2, 2),
        nn.Sequential(nn.Sequential(nn.Tanh()), nn.Linear(2, 2)),
    )
    names = {0: "", 1: "0", 2: "0.0", 3: "0.1", 4: "1", 5: "2", 6: "2.0", 7: "2.0.0", 8: "2.1"}
    names[9] = "gone"
    assert _post_order(model, names) == [2, 3, 1, 4, 7, 6, 8, 5, 0, 9]


class BackboneThenEager(nn.Module):
    """A compiled sub-network (:class:`DirectNet`, a ``torch.compile`` wrapper, or
    compiled with ``module.compile()``), then eager modules that take its output."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.backbone = DirectNet()
        if how == "wrapper":
            self.backbone = cast(nn.Module, torch.compile(self.backbone, backend="aot_eager"))
        else:
            self.backbone.compile(backend="aot_eager")
        self.extra = nn.Sequential(nn.ReLU(), nn.Linear(2, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.extra(self.backbone(x))


class PartsCalledDirectly(nn.Module):
    """Trains a :class:`BackboneThenEager` by calling its two parts, never its root."""

    def __init__(self, model: BackboneThenEager) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model.extra(self.model.backbone(x))


def forward_order(directory: Path) -> list[str]:
    """The activation series' modules in ``forward_position`` order (series.json)."""
    data = json.loads((directory / "series.json").read_text(encoding="utf-8"))
    entries = [e for e in data["series"] if e["signal"] == "activation" and e["metric"] == "rms"]
    return [e["module"] for e in sorted(entries, key=lambda e: e["forward_position"])]


@pytest.mark.parametrize(
    ("how", "direct"),
    [("wrapper", False), ("module.compile", False), ("wrapper", True)],
    ids=["wrapper", "module.compile", "wrapper-direct-calls"],
)
def test_eager_modules_after_a_compiled_sub_network_keep_their_forward_order(
    tmp_path: Path, fresh_dynamo, how: str, direct: bool
) -> None:
    """Rows from graphs took forward positions after every eager call of the sample,
    so ``extra.0`` and ``extra.1``, which run after the compiled backbone, came first
    in forward order (a fault in the backbone was then placed at ``extra.0``, with the
    backbone's module among its echoes). Rows written before an eager call are taken
    before it: the order is the forward's, as eagerly; also where training calls the
    two parts directly, never the root (``direct``)."""
    torch.manual_seed(0)
    model = BackboneThenEager(how)
    inject_observer(model, output_dir=tmp_path, sampling=1)
    train_steps(PartsCalledDirectly(model) if direct else model, 3)
    report = remove_observer_and_read(model, tmp_path)
    order = forward_order(tmp_path)
    root = [] if direct else ["<root>"]  # a root never called has no series
    assert order == ["backbone.fc1", "backbone.act", "backbone.fc2", "extra.0", "extra.1", *root]
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"
    assert report["coverage"]["compiled_capture"]["slots_dropped"] == 0
    assert report["errors"] == []


class SiameseNet(nn.Module):
    """One encoder (Linear, Tanh, Linear) applied to both halves of the input, then a
    head on the two codes: ``run_encoder`` is the encoder, compiled on its own once
    compiled (weight sharing, as in siamese and contrastive models)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
        self.head = nn.Linear(8, 1)
        self.run_encoder: Callable[[Tensor], Tensor] = self.encoder

    def forward(self, x: Tensor) -> Tensor:
        left, right = self.run_encoder(x[:, :3]), self.run_encoder(x[:, 3:])
        return self.head(torch.cat((left, right), dim=1))


def compile_encoder(model: nn.Module) -> nn.Module:
    """:class:`SiameseNet` with its encoder compiled on its own (aot_eager)."""
    assert isinstance(model, SiameseNet)
    model.run_encoder = cast(
        Callable[[Tensor], Tensor], torch.compile(model.encoder, backend="aot_eager")
    )
    return model


@pytest.mark.parametrize("sampling", [1, 2])
def test_a_block_compiled_on_its_own_and_called_twice_records_both_calls(
    tmp_path: Path, sampling: int
) -> None:
    """The encoder's graph runs twice per forward: each run writes the next rows of the
    encoder's modules, with call indices 0 and 1 counted on the device, so both calls'
    activations and output gradients equal the eager path's (not the second call's
    activation and the sum of both calls' gradient rows as call 0)."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        SiameseNet(), tmp_path, compile_encoder, sampling=sampling, steps=4
    )
    for call in (0, 1):
        for signal in ("activation", "grad_output"):
            assert len(compiled[("encoder.2", call, signal, "output", "rms")]) == 4 // sampling
    left = compiled[("encoder.0", 0, "activation", "output", "rms")]
    right = compiled[("encoder.0", 1, "activation", "output", "rms")]
    assert left != right
    assert_same_telemetry(eager, compiled)
    coverage = report["coverage"]["compiled_capture"]
    assert coverage["mode"] == "in_graph"
    assert coverage["slots_dropped"] == 0


class LoopNet(nn.Module):
    """One Linear applied ``calls`` times in a loop, with a graph break after the first
    call (``torch._dynamo.graph_break()``): its calls run in two compiled frames."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls = calls
        self.step = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        for call in range(self.calls):
            x = torch.tanh(self.step(x))
            if call == 0:
                torch._dynamo.graph_break()
        return self.head(x)


def test_a_module_called_in_two_frames_and_beyond_its_rows_is_counted(tmp_path: Path) -> None:
    """Calls of one module in two frames of one forward (a graph break between them) get
    their own call indices; the 20 calls of ``step`` need 20 of its 16 rows: calls 0 to
    15 equal the eager path's, the 4 beyond are counted under ``slots_dropped`` in each
    sample and named in ``limits_hit``."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        LoopNet(20), tmp_path, aot_eager, sampling=1, steps=3
    )
    assert {key[1] for key in compiled if key[0] == "step"} == set(range(16))
    kept = {key: points for key, points in eager.items() if key[0] != "step" or key[1] < 16}
    assert_same_telemetry(kept, compiled)
    assert report["coverage"]["compiled_capture"]["slots_dropped"] == 3 * 4
    assert "compiled_max_slots" in report["coverage"]["limits_hit"]


class TwiceReturned(nn.Module):
    """Returns one tensor at both places of a tuple (a leaf module: no submodules)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / 3)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(x @ self.weight)
        return h, h


class TwiceReturnedNet(nn.Module):
    """Uses both places of :class:`TwiceReturned`'s output, with different weights;
    with ``halves``, ``run_pair`` (the pair, compiled on its own once compiled) runs on
    each half of the input."""

    def __init__(self, halves: bool = False) -> None:
        super().__init__()
        self.halves = halves
        width = 3 if halves else 6
        self.pair = TwiceReturned(width)
        self.run_pair: Callable[[Tensor], tuple[Tensor, Tensor]] = self.pair
        self.left = nn.Linear(width, 1)
        self.right = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.zeros(x.shape[0], 1)
        for part in x.split(3, dim=1) if self.halves else (x,):
            a, b = self.run_pair(part)
            out = out + self.left(a) * self.right(b)
        return out


def compile_pair(model: nn.Module) -> nn.Module:
    """:class:`TwiceReturnedNet` with its pair compiled on its own (aot_eager)."""
    assert isinstance(model, TwiceReturnedNet)
    compiled = torch.compile(model.pair, backend="aot_eager", fullgraph=True)
    model.run_pair = cast(Callable[[Tensor], tuple[Tensor, Tensor]], compiled)
    return model


@pytest.mark.parametrize("halves", [False, True])
def test_one_tensor_at_two_places_of_an_output_is_tapped_once(tmp_path: Path, halves: bool) -> None:
    """``return h, h``: eagerly each place's output gradient is the whole gradient of
    ``h``; in the graph one chain of taps makes one copy that takes both places, so both
    rows equal the eager path's and training is bit-identical (a tap per place made two
    copies, each place's share, and the summed gradient differed in the last bits). With
    ``halves`` the pair's graph runs twice before the backward: the taps' saved rows are
    their own tensors, not read again from the block the second run changes."""
    torch.manual_seed(0)
    compile_model = compile_pair if halves else functools.partial(aot_eager, fullgraph=True)
    eager, compiled, _ = observe_eager_and_compiled(
        TwiceReturnedNet(halves), tmp_path, compile_model, sampling=1, steps=4
    )
    for call in (0, 1) if halves else (0,):
        first = compiled[("pair", call, "grad_output", "output[0]", "rms")]
        assert len(first) == 4
        assert first == compiled[("pair", call, "grad_output", "output[1]", "rms")]
    assert_same_telemetry(eager, compiled)


def test_a_second_observer_compiles_the_hook_frames_with_its_own_capture(
    tmp_path: Path,
) -> None:
    """The pair compiled on its own with ``fullgraph=True`` compiles the hooks as frames
    of their own; a second observer in the process compiles them again for its capture.
    Its key is a string: an int key that changed became a symbol (Dynamo's automatic
    dynamic shapes), which the slot assignment cannot take, and ``fullgraph`` failed."""
    torch._dynamo.reset()
    for run in ("first", "second"):
        torch.manual_seed(0)
        eager, compiled, _ = observe_eager_and_compiled(
            TwiceReturnedNet(halves=True), tmp_path / run, compile_pair, sampling=1, steps=2
        )
        assert ("pair", 1, "grad_output", "output[0]", "rms") in compiled
        assert_same_telemetry(eager, compiled)


def reload(model: nn.Module) -> nn.Module:
    """``model`` through ``torch.save`` and ``torch.load``, as a checkpoint of it."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return cast(nn.Module, torch.load(buffer, weights_only=False))


@pytest.mark.parametrize("compile_what", ["model", "block"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.load"])
def test_a_copy_of_an_observed_model_compiles_with_fullgraph(
    tmp_path: Path, how: str, compile_what: str
) -> None:
    """A copy of an observed model carries inert placeholders of our hooks. Compiled
    with ``fullgraph=True``, whole or its encoder on its own, it trains as the same
    model never observed: the root's placeholders run eagerly and remove every
    placeholder of the copy before Dynamo traces it (Dynamo could not trace their
    removal, and ``fullgraph=True`` failed). ``remove_observer`` of a copy removes them
    at once."""
    torch.manual_seed(0)
    base = SiameseNet()
    observed = copy.deepcopy(base)
    inject_observer(observed, output_dir=tmp_path / "original", sampling=1)
    train_steps(observed, 1)
    copied = copy.deepcopy(observed) if how == "deepcopy" else reload(observed)
    other = copy.deepcopy(observed)
    remove_observer(observed)
    twin = copy.deepcopy(observed)
    assert hook_counts(copied) != hook_counts(twin)
    remove_observer(other)
    assert hook_counts(other) == hook_counts(twin)

    def compile_model(model: nn.Module) -> nn.Module:
        assert isinstance(model, SiameseNet)
        if compile_what == "model":
            return cast(nn.Module, torch.compile(model, backend="aot_eager", fullgraph=True))
        encoder = torch.compile(model.encoder, backend="aot_eager", fullgraph=True)
        model.run_encoder = cast(Callable[[Tensor], Tensor], encoder)
        return model

    assert train_steps(compile_model(copied), 3) == train_steps(compile_model(twin), 3)
    assert_same_model(copied, twin)
    assert hook_counts(copied) == hook_counts(twin)


class Halves(NamedTuple):
    first: Tensor
    second: Tensor


class NestedOutputs(nn.Module):
    """Returns its tensors in nested containers, by ``kind``: a tuple holding a tuple
    (``nn.LSTM``'s ``(output, (h, c))``), tuples in a tuple, a namedtuple, a dict
    holding a list."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.randn(6, 18) / 3)

    def forward(self, x: Tensor) -> object:
        a, b, c = torch.tanh(x @ self.weight).split(6, dim=1)
        if self.kind == "tuple":
            return a, (b, c)
        if self.kind == "tuples":
            return (a,), (b, c)
        if self.kind == "dict":
            return {"a": a, "rest": [b, c]}
        return Halves(a, b * c)


class NestedOutputsNet(nn.Module):
    """Uses every tensor of :class:`NestedOutputs`'s output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inner = NestedOutputs(kind)
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        out = self.inner(x)
        if self.kind == "tuple":
            a, (b, c) = out
            parts = [a, b, c]
        elif self.kind == "tuples":
            (a,), (b, c) = out
            parts = [a, b, c]
        elif self.kind == "dict":
            parts = [out["a"], *out["rest"]]
        else:
            parts = [out.first, out.second]
        return self.head(sum(part * (index + 1) for index, part in enumerate(parts)))


@pytest.mark.parametrize("kind", ["tuple", "tuples", "namedtuple", "dict"])
def test_tensors_in_nested_tuples_have_their_output_gradients(tmp_path: Path, kind: str) -> None:
    """Outputs in nested tuples and namedtuples are tapped where they lie and the output
    is rebuilt around the copies (``fullgraph=True``): every tensor path's output
    gradient equals the eager path's, nothing is counted as not captured, and training
    is bit-identical (only a flat tuple or list was tapped before). Tensors in a dict
    are not tapped (a dict, or a list inside the output, stays the very object it is)
    and are counted."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        NestedOutputsNet(kind),
        tmp_path,
        functools.partial(aot_eager, fullgraph=True),
        sampling=1,
        steps=3,
    )
    paths = {key[3] for key in compiled if key[0] == "inner" and key[2] == "grad_output"}
    untapped = report["coverage"]["compiled_capture"]["gradients_not_captured"]
    if kind == "dict":
        assert (paths, untapped) == (set(), 3)
        kept = {k: v for k, v in eager.items() if k[0] != "inner" or k[2] != "grad_output"}
        assert_same_telemetry(kept, compiled)
        return
    assert len(paths) == (2 if kind == "namedtuple" else 3)
    assert untapped == 0
    assert_same_telemetry(eager, compiled)


class Collector(nn.Module):
    """Appends its activation to the list it is given, and returns that list and a
    multiple of the activation (a leaf module: no submodules)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, features: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        h = torch.tanh(features[-1] @ self.weight)
        features.append(h)
        return features, h * 2.0


class CollectorNet(nn.Module):
    """Reads the list it passed to :class:`Collector` after changing the returned one
    in place: the model relies on the two being one list."""

    def __init__(self) -> None:
        super().__init__()
        self.collect = Collector()
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        returned, doubled = self.collect(features)
        returned.append(doubled)
        return self.head(features[-1])


def test_a_list_of_the_inputs_inside_an_output_stays_that_list(tmp_path: Path) -> None:
    """A module that returns the list it was given (with its activation appended) next
    to a new tensor: the new tensor is tapped and the output tuple rebuilt around the
    copy, while the list stays the very list the caller holds (a new list would leave
    the caller's list without the later changes): training is bit-identical, the new
    tensor's output gradient equals the eager path's and the list's tensors' are
    counted as not captured."""
    torch.manual_seed(0)
    eager, compiled, report = observe_eager_and_compiled(
        CollectorNet(), tmp_path, functools.partial(aot_eager, fullgraph=True), sampling=1, steps=3
    )
    assert report["coverage"]["compiled_capture"]["gradients_not_captured"] >= 1
    gradients = {key[3] for key in compiled if key[0] == "collect" and key[2] == "grad_output"}
    assert gradients == {"output[1]"}
    assert_same_telemetry(
        {
            k: v
            for k, v in eager.items()
            if k[0] != "collect" or k[3] == "output[1]" or k[2] == "activation"
        },
        compiled,
    )


@pytest.mark.parametrize("backend", ["eager", "as_is", "aot_eager"])
def test_checkpoint_called_inside_compiled_code(tmp_path: Path, fresh_dynamo, backend: str) -> None:
    """``torch.utils.checkpoint`` called inside compiled code (``CheckpointNet``: a
    block of ``lin``, ``act``, ``out`` checkpointed between ``inp`` and ``head``).

    Under ``backend="eager"`` or a user's backend that returns the graph's own
    ``forward`` (``as_is``), the region runs as ``torch.utils.checkpoint`` itself,
    which saves its inputs: the capture wrote its rows in place there, and the backward
    raised. The block's hooks now stay graph breaks, so the eager path observes the
    block (counted under ``calls_under_saved_tensor_hooks``) and every module has its 3
    samples of both signals. Under ``aot_eager`` the block's activations are captured in
    the graph, and their output gradients are not tapped (AOTAutograd recomputes the
    region in the backward from the rows as the forward left them: they were recorded
    under call index 1): the three block modules count under
    ``gradients_not_captured``, and no series has a call index other than 0. Training
    equals the same compiled model's without the observer."""

    def as_is(graph: torch.fx.GraphModule, inputs: list[Tensor]) -> Callable[..., Any]:
        return graph.forward

    def train(model: nn.Module) -> list[float]:
        compiled = torch.compile(model, backend=as_is if backend == "as_is" else backend)
        return train_steps(cast(nn.Module, compiled), 3)

    torch.manual_seed(0)
    model, twin = CheckpointNet("non_reentrant"), CheckpointNet("non_reentrant")
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, sampling=1)
    losses = train(model)
    report = remove_observer_and_read(model, tmp_path)
    assert losses == train(twin)
    assert report["errors"] == []
    counts = {key[:3]: len(points) for key, points in written_series(tmp_path).items()}
    block = ("block.lin", "block.act", "block.out")
    expected = {
        (name, 0, signal): 3
        for name in ("<root>", "inp", *block, "head")
        for signal in ("activation", "grad_output")
        if backend != "aot_eager" or signal == "activation" or name not in block
    }
    assert counts == expected
    capture = report["coverage"]["compiled_capture"]
    assert capture["mode"] == "in_graph"
    if backend == "aot_eager":
        assert capture["calls_under_saved_tensor_hooks"] == 0
        assert capture["gradients_not_captured"] == 3
    else:
        assert capture["calls_under_saved_tensor_hooks"] > 0
        assert capture["gradients_not_captured"] == 0


class DirectNet(nn.Module):
    """Linear(6, 12) -> GELU -> Linear(12, 2): what :class:`DirectHolder` holds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DirectHolder(nn.Module):
    """A root whose forward training never calls: the steps call ``self.model`` (and
    ``self.head``) directly, as a Lightning ``training_step`` that calls
    ``self.model(x)`` does. With ``backend``, both are ``torch.compile`` wrappers."""

    def __init__(self, backend: str | None, model: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.model = torch.compile(model, backend=backend) if backend else model
        self.head = torch.compile(head, backend=backend) if backend else head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.model(x))


def direct_steps(
    holder: nn.Module,
    steps: int,
    *,
    with_head: bool,
    detach: bool = False,
    after_step: Callable[[], object] = lambda: None,
) -> list[float]:
    """SGD steps that call ``holder.model`` (then ``holder.head``, on ``model``'s output
    detached with ``detach``) directly; ``after_step`` is called after each."""
    assert isinstance(holder, DirectHolder)
    generator = torch.Generator().manual_seed(3)
    optimizer = torch.optim.SGD(holder.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        output = holder.model(torch.randn(8, 6, generator=generator))
        if with_head:
            output = holder.head(output.detach() if detach else output)
        loss = output.square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        after_step()
    return losses


@pytest.mark.parametrize("with_head", [False, True], ids=["model", "model-then-head"])
@pytest.mark.parametrize("sampling", [1, 2])
def test_a_compiled_submodule_called_directly_is_observed_inside_its_graph(
    tmp_path: Path, fresh_dynamo, sampling: int, with_head: bool
) -> None:
    """Training calls a compiled submodule directly, never the root (``self.model =
    torch.compile(net)``, ``self.model(x)`` in a Lightning ``training_step``). Its
    modules ran only inside the compiled frame, whose hooks never opened the
    direct-call sample: nothing was recorded (0 forwards, mode ``unused``) and the
    headline told the user to train in train mode. Now the wrapper's own hooks open the
    sample before the frame runs: every series equals the same model's observed
    eagerly, the modules of a second wrapper called in the same step (``head``) join
    the sample, training equals the compiled model's without the observer, and the
    headline is a normal one (it was the same wrong one eagerly too)."""
    steps = 6
    train = functools.partial(direct_steps, with_head=with_head)
    torch.manual_seed(0)
    model, head = DirectNet(), nn.Linear(2, 1)
    eager, observed, twin = (
        DirectHolder(backend, copy.deepcopy(model), copy.deepcopy(head))
        for backend in (None, "aot_eager", "aot_eager")
    )
    reports = {}
    for name, holder in (("eager", eager), ("compiled", observed)):
        handle = inject_observer(holder, output_dir=tmp_path / name, sampling=sampling)
        # A report built after each step flushes while a direct-call sample is open.
        losses = train(holder, steps, after_step=handle.report)
        reports[name] = remove_observer_and_read(holder, tmp_path / name)
    assert losses == train(twin, steps)
    assert_same_model(observed, twin)
    eager_series = written_series(tmp_path / "eager")
    modules = {"model.fc1", "model.act", "model.fc2"} | ({"head"} if with_head else set())
    assert {key[0] for key in eager_series} == modules
    assert_same_telemetry(eager_series, written_series(tmp_path / "compiled"))
    samples = -(-steps // sampling)
    for name, report in reports.items():
        coverage = report["coverage"]
        assert report["errors"] == [], name
        assert coverage["direct_call_forwards"] == steps, name
        assert coverage["samples_observed"] == coverage["backward_samples_observed"] == samples
        assert not report["summary"]["headline"].startswith("No training forward"), name
    assert reports["compiled"]["coverage"]["compiled_capture"]["mode"] == "in_graph"


def test_a_compiled_submodule_whose_output_the_loss_detaches_loses_nothing(
    tmp_path: Path, fresh_dynamo
) -> None:
    """``head(model(x).detach())`` with ``model`` compiled and called directly, ``head``
    eager: the backward never reaches ``model``'s graph, so its modules have no output
    gradient (as eagerly), and nothing is lost: the sample's sinks were counted lost
    (``gradient_samples_lost`` 1 a sample, ``limits_hit`` named it) because the search
    for them started at ``model``'s output, which no backward pass reaches."""

    detached_steps = functools.partial(direct_steps, with_head=True, detach=True)
    torch.manual_seed(0)
    model, head = DirectNet(), nn.Linear(2, 1)
    eager = DirectHolder(None, copy.deepcopy(model), copy.deepcopy(head))
    observed, twin = (DirectHolder(None, copy.deepcopy(model), copy.deepcopy(head)) for _ in "ab")
    for holder in (observed, twin):
        holder.model = cast(nn.Module, torch.compile(holder.model, backend="aot_eager"))
    reports = {}
    for name, holder in (("eager", eager), ("compiled", observed)):
        inject_observer(holder, output_dir=tmp_path / name, sampling=1)
        losses = detached_steps(holder, 3)
        reports[name] = remove_observer_and_read(holder, tmp_path / name)
    assert losses == detached_steps(twin, 3)
    eager_series = written_series(tmp_path / "eager")
    assert ("model.fc2", 0, "grad_output") not in {key[:3] for key in eager_series}
    assert_same_telemetry(eager_series, written_series(tmp_path / "compiled"))
    coverage = reports["compiled"]["coverage"]
    assert coverage["compiled_capture"]["gradient_samples_lost"] == 0
    assert "compiled_gradient_samples" not in coverage["limits_hit"]


def test_compile_wrappers_lose_their_direct_call_hooks_once_training_goes_through_the_root(
    tmp_path: Path, fresh_dynamo
) -> None:
    """Hooks on a compile wrapper send every call of it through ``nn.Module``'s full hook
    dispatch (3.5 % of a step with each block of the example a wrapper). They only open
    direct-call samples, and once a training forward went through the root, direct
    calls are side computations: the first such forward removes them. Training through
    the root is observed inside the graphs as before."""
    torch.manual_seed(0)
    holder = DirectHolder("aot_eager", LateNet(), nn.Linear(2, 1))
    wrappers = [cast(nn.Module, holder.model), cast(nn.Module, holder.head)]
    inject_observer(holder, output_dir=tmp_path, sampling=1)

    def ours(module: nn.Module) -> list[object]:
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        return [hook for hook in hooks if type(hook).__module__.startswith("torchinstruments")]

    assert all(len(ours(wrapper)) == 2 for wrapper in wrappers)
    holder.eval()
    holder(torch.randn(4, 6))  # an evaluation forward keeps them
    assert all(len(ours(wrapper)) == 2 for wrapper in wrappers)
    holder.train()
    holder(torch.randn(4, 6)).square().mean().backward()
    assert [ours(wrapper) for wrapper in wrappers] == [[], []]
    report = remove_observer_and_read(holder, tmp_path)
    assert report["coverage"]["samples_observed"] == 1
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"


class LateNet(nn.Module):
    """:class:`DirectNet`'s layers with a forward of its own: code that no other test
    compiled, so that its first call traces it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_a_compile_wrapper_made_after_injection_is_observed_from_its_second_call(
    tmp_path: Path, fresh_dynamo
) -> None:
    """``inject_observer(holder)``, then ``holder.model = torch.compile(holder.model)``,
    then training that calls ``holder.model`` directly. The wrapper was unknown at
    injection, and nothing of ours ran eagerly around its compiled frame: every call was
    lost (0 forwards, mode ``unused``). Dynamo tracing our hooks with no forward open
    now hooks the new wrapper during its first call: from the second call on, every
    series equals that of the same model observed eagerly from its second step on, and
    training equals the compiled model's without the observer."""
    steps = 6
    torch.manual_seed(0)
    model, head = LateNet(), nn.Linear(2, 1)
    eager, observed, twin = (
        DirectHolder(None, copy.deepcopy(model), copy.deepcopy(head)) for _ in "abc"
    )
    twin.model = cast(nn.Module, torch.compile(twin.model, backend="aot_eager"))

    def observe_eager_from_the_second_step() -> None:
        if observer_of(eager) is None:
            inject_observer(eager, output_dir=tmp_path / "eager", sampling=1)

    direct_steps(eager, steps, with_head=False, after_step=observe_eager_from_the_second_step)
    inject_observer(observed, output_dir=tmp_path / "compiled", sampling=1)
    observed.model = cast(nn.Module, torch.compile(observed.model, backend="aot_eager"))
    losses = direct_steps(observed, steps, with_head=False)
    reports = {
        name: remove_observer_and_read(holder, tmp_path / name)
        for name, holder in (("eager", eager), ("compiled", observed))
    }
    assert losses == direct_steps(twin, steps, with_head=False)
    assert_same_model(observed, twin)
    eager_series = written_series(tmp_path / "eager")
    assert {key[0] for key in eager_series} == {"model.fc1", "model.act", "model.fc2"}
    assert_same_telemetry(eager_series, written_series(tmp_path / "compiled"))
    for name, report in reports.items():
        coverage = report["coverage"]
        assert report["errors"] == [], name
        assert coverage["direct_call_forwards"] == steps - 1, name
        assert coverage["samples_observed"] == coverage["backward_samples_observed"] == steps - 1
    assert reports["compiled"]["coverage"]["compiled_capture"]["mode"] == "in_graph"
    # Another model of the class, wrapped after injection too: its code is compiled
    # already, so nothing traces our hooks and its calls stay unobserved. The headline
    # says why instead of asking for train mode.
    again = DirectHolder(None, copy.deepcopy(model), copy.deepcopy(head))
    inject_observer(again, output_dir=tmp_path / "again", sampling=1)
    again.model = cast(nn.Module, torch.compile(again.model, backend="aot_eager"))
    direct_steps(again, 2, with_head=False)
    headline = remove_observer_and_read(again, tmp_path / "again")["summary"]["headline"]
    assert headline == (
        "No training forward was observed. `model` is a torch.compile wrapper made after "
        "injection whose code was compiled before (for another model of its class): calls "
        "made outside the root's forward run unobserved there. Inject the observer after "
        "compiling, or train through the root."
    )


class GanHolder(nn.Module):
    """A generator and a discriminator (:class:`DirectNet` shapes), each a
    ``torch.compile`` wrapper with ``backend``; training calls them directly."""

    def __init__(self, backend: str | None, generator: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.generator = cast(
            nn.Module, torch.compile(generator, backend=backend) if backend else generator
        )
        self.critic = cast(nn.Module, torch.compile(critic, backend=backend) if backend else critic)


def gan_steps(holder: nn.Module, steps: int, *, loop: str) -> list[float]:
    """``loop="gan"``: per step a discriminator pass (the critic on real data and on the
    generator's detached output, one backward) and a generator pass (the critic on the
    generator's output, another backward), each with its own SGD. ``loop="twice"``: the
    critic called twice on the generator's output, one backward over all three calls."""
    assert isinstance(holder, GanHolder)
    generator = torch.Generator().manual_seed(4)
    generator_sgd = torch.optim.SGD(holder.generator.parameters(), lr=0.02)
    critic_sgd = torch.optim.SGD(holder.critic.parameters(), lr=0.02)
    losses = []
    for _ in range(steps):
        real = torch.randn(8, 2, generator=generator)
        fake = holder.generator(torch.randn(8, 6, generator=generator))
        if loop == "twice":
            loss = holder.critic(fake).square().mean() + holder.critic(fake * 2).abs().mean()
            passes = [(loss, (generator_sgd, critic_sgd))]
        else:
            softplus = nn.functional.softplus
            critic_loss = (
                softplus(-holder.critic(real)).mean()
                + softplus(holder.critic(fake.detach())).mean()
            )
            critic_sgd.zero_grad()
            critic_loss.backward()
            critic_sgd.step()
            losses.append(float(critic_loss.detach()))
            passes = [(softplus(-holder.critic(fake)).mean(), (generator_sgd,))]
        for loss, optimizers in passes:
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
            losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("loop", ["gan", "twice"])
def test_a_gan_trained_through_directly_called_compiled_modules(
    tmp_path: Path, fresh_dynamo, loop: str
) -> None:
    """A generator and a discriminator compiled apart and called directly. ``twice``:
    the critic's second call in a sample was recorded as call 0 (each wrapper's return
    cleared the rows, and the call counts with them) and its gradients merged with the
    first call's. ``gan``: the discriminator's pass reaches the generator's output
    detached, and the generator's pass reaches it later; every gradient of such a
    sample was counted lost (the search for the sample's sinks stopped at the
    generator's, which the first pass does not run), and the generator's output
    gradients, which arrive after the sample's first pass was taken, were dropped as
    a repeated pass. Now every series equals the eager path's, nothing is counted
    lost, and training equals the compiled twin's."""
    steps = 3
    train = functools.partial(gan_steps, loop=loop)
    torch.manual_seed(0)
    generator, critic = DirectNet(), DirectNet()
    generator.fc2 = nn.Linear(12, 2)  # a sample of 2 features, as the real data
    critic.fc1 = nn.Linear(2, 12)
    eager, observed, twin = (
        GanHolder(backend, copy.deepcopy(generator), copy.deepcopy(critic))
        for backend in (None, "aot_eager", "aot_eager")
    )
    reports = {}
    for name, holder in (("eager", eager), ("compiled", observed)):
        inject_observer(holder, output_dir=tmp_path / name, sampling=1)
        losses = train(holder, steps)
        reports[name] = remove_observer_and_read(holder, tmp_path / name)
    assert losses == train(twin, steps)
    assert_same_model(observed, twin)
    eager_series = written_series(tmp_path / "eager")
    calls = {key[:3] for key in eager_series}
    assert ("generator.fc1", 0, "grad_output") in calls
    assert ("critic.fc1", 1, "grad_output") in calls  # two critic calls in a sample
    assert_same_telemetry(eager_series, written_series(tmp_path / "compiled"))
    compiled = reports["compiled"]["coverage"]["compiled_capture"]
    assert compiled["mode"] == "in_graph" and compiled["gradient_samples_lost"] == 0
    assert reports["compiled"]["errors"] == []


def test_a_float8_output_inside_a_compiled_graph_is_skipped(tmp_path: Path) -> None:
    """No reduction takes float8 on the CPU: the traced capture skips such an output as
    the eager path does (it raised inside the graph, and training stopped); the other
    modules are captured in the graph, and training equals the compiled twin's."""

    class Quantize(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.to(torch.float8_e4m3fn)

    class Float8Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.quantize, self.out = nn.Linear(6, 4), Quantize(), nn.Linear(4, 1)

        def forward(self, x: Tensor) -> Tensor:
            h = self.fc(x)
            return self.out(h + self.quantize(h.detach()).to(torch.float32))

    torch.manual_seed(0)
    model, twin = Float8Net(), Float8Net()
    twin.load_state_dict(model.state_dict())
    inject_observer(model, output_dir=tmp_path, sampling=1)
    losses = train_steps(aot_eager(model), 3)
    report = remove_observer_and_read(model, tmp_path)
    assert losses == train_steps(aot_eager(twin), 3)
    assert report["errors"] == []
    assert report["coverage"]["compiled_capture"]["mode"] == "in_graph"
    observed = {key[0] for key in written_series(tmp_path)}
    assert {"fc", "out"} <= observed and "quantize" not in observed


class ArgMax(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.argmax(-1)


class EmptyOutput(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x[:0] * 2


class UnreducibleBlock(nn.Module):
    """A Linear, then two children whose outputs cannot be reduced: integer indices and
    a tensor of no elements."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.pick = ArgMax()
        self.none = EmptyOutput()

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return h + self.pick(h).unsqueeze(-1).float() * 0 + self.none(h).sum()


class UnreducibleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = UnreducibleBlock()
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(x))


def test_modules_with_only_unreducible_outputs_ran_inside_graphs_too(tmp_path: Path) -> None:
    """Children whose only output is an integer tensor or an empty one run in every
    forward: inside a compiled graph as eagerly, they are not named among the modules
    that never ran, and their parent is not observed in their place (which would
    compile the sampled graph again)."""
    torch.manual_seed(0)
    base = UnreducibleNet()
    reports = {}
    for how in ("eager", "compiled"):
        model = copy.deepcopy(base)
        inject_observer(model, output_dir=tmp_path / how)
        run = model if how == "eager" else aot_eager(model, fullgraph=True)
        generator = torch.Generator().manual_seed(3)
        for _ in range(10):
            run(torch.randn(4, 8, generator=generator)).sum().backward()
        reports[how] = remove_observer_and_read(model, tmp_path / how)["coverage"]
    for how, coverage in reports.items():
        assert coverage["modules_never_ran"] == [], how
        assert coverage["parents_observed"] == {}, how
        assert coverage["errors_total"] == 0, how
    assert reports["eager"]["tensors_skipped"] == {"empty": 8, "non_floating": 8}
    assert reports["compiled"]["compiled_capture"]["slots"] == 2 * 2  # fc and head
