"""The tests' shared harness: seeded models and data, training loops, the uninstrumented
twin, the float64 reference, report readers and probes of what an observer leaves behind.

Every test file imports these from here (``from tests.harness import ...``); fixtures
built on them are in ``tests/conftest.py``. Two larger pieces have modules of their own:
``tests.harness.ranks`` (real multi-process gloo groups) and ``tests.harness.scenarios``
(training scenarios run both on the CPU and on a device or compiler backend).

Twin training: a model and its ``copy.deepcopy`` (:func:`pair`), trained on the same
batches, one observed and one not, must end bit-identical (:func:`assert_same_model`).
Reference values: :class:`Reference` puts plain forward hooks and tensor hooks on the
twin and reduces in float64 (:func:`rms64`); :func:`check_against_reference` compares
them with the report's series.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from torchinstruments import ReportConfig, inject_observer, remove_observer
from torchinstruments.reduce import METRICS

#: The repository's root (the folder holding ``src/``, ``tests/``, ``examples/``).
REPO = Path(__file__).resolve().parents[2]

#: Every series of a small model is listed (each activation / gradient RMS series is a
#: candidate of a scale category), so findings can be read as the series values.
WIDE = ReportConfig(top_k_per_category=500, max_bytes=4_000_000)

Key = tuple[str, int, str, str]  # module, call index, signal, tensor path
Report = dict[str, Any]
Batch = tuple[Tensor, Tensor]
#: One training step's forward and backward; returns the loss.
Step = Callable[[nn.Module, Tensor, Tensor], Tensor]
ModuleT = TypeVar("ModuleT", bound=nn.Module)


# ------------------------------------------------------------------------------ models
class ResidualNet(nn.Module):
    """Linear -> (LayerNorm, Linear, in-place ReLU) residual block -> head.

    Input ``(batch, 8)``, output ``(batch, 1)``; ``width`` (default 16) is the block's.
    """

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.act(self.fc(self.norm(h)))
        return self.head(h)


class MLP(nn.Module):
    """Linear(features, 12) -> Tanh -> Linear(12, 1); ``features`` defaults to 6."""

    def __init__(self, features: int = 6) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, 12)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(12, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


#: The module names of :class:`MLP`, the root (``""``) first.
MLP_NAMES = ("", "fc1", "act", "fc2")


def load_example(name: str, module_name: str) -> ModuleType:
    """Import ``examples/<name>`` as module ``module_name`` (registered in ``sys.modules``,
    so forked or pickled workers find it)."""
    spec = importlib.util.spec_from_file_location(module_name, REPO / "examples" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# -------------------------------------------------------------------------------- data
def make_batches(count: int, seed: int = 0, *, features: int = 8, rows: int = 16) -> list[Batch]:
    """``count`` seeded regression batches: ``x`` of shape ``(rows, features)`` and ``y``
    of shape ``(rows, 1)``, standard normal, drawn in turn from one generator."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(rows, features, generator=generator),
            torch.randn(rows, 1, generator=generator),
        )
        for _ in range(count)
    ]


# ---------------------------------------------------------------------------- training
def train(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    lr: float = 0.05,
    on_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Plain SGD (``lr``) on the mean squared error; ``on_step(step)`` runs before each
    step. Returns the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step, (x, y) in enumerate(batches):
        if on_step is not None:
            on_step(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def mse_step(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The default :data:`Step`: mean squared error, backward, the loss returned."""
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def fit(model: nn.Module, data: Sequence[Batch], step: Step = mse_step) -> list[float]:
    """SGD with momentum (lr 0.05, momentum 0.9); ``step`` runs forward and backward and
    returns the loss. Returns the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(float(step(model, x, y).detach()))
        optimizer.step()
    return losses


def train_on_noise(
    model: nn.Module, steps: int, seed: int = 0, *, rows: int = 8, lr: float | None = 0.05
) -> list[float]:
    """``steps`` steps on fresh seeded inputs of shape ``(rows, 6)`` with the loss
    ``mean(output ** 2)``: SGD with ``lr``, or with ``lr=None`` backward only (gradients
    accumulate, nothing is updated). Returns the losses."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = None if lr is None else torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        x = torch.randn(rows, 6, generator=generator)
        if optimizer is not None:
            optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        losses.append(float(loss.detach()))
    return losses


# -------------------------------------------------------------------------------- twin
def pair(factory: Callable[[], ModuleT], seed: int = 1) -> tuple[ModuleT, ModuleT]:
    """``factory()`` built after ``torch.manual_seed(seed)``, and its deep copy (the
    uninstrumented twin)."""
    torch.manual_seed(seed)
    model = factory()
    return model, copy.deepcopy(model)


def assert_same_model(observed: nn.Module, twin: nn.Module) -> None:
    """Every parameter and buffer of ``observed`` equals its twin's bit for bit
    (``torch.equal``), under the same names in the same order."""
    a, b = observed.state_dict(), twin.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs from the uninstrumented twin"


def parameters_equal(a: nn.Module, b: nn.Module) -> bool:
    """Whether the parameters of ``a`` and ``b`` are equal bit for bit, in order."""
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# --------------------------------------------------------------------------- reference
def rms64(tensor: Tensor) -> float:
    """RMS in float64 of the finite values, safe for any finite magnitude (scaled by the
    largest magnitude first); complex tensors by magnitude; 0.0 when all are zero."""
    data = tensor.detach()
    data = data.abs() if data.is_complex() else data
    data = data.to(torch.float64).reshape(-1)
    data = data[torch.isfinite(data)]
    peak = float(data.abs().max())
    if peak == 0.0:
        return 0.0
    return peak * math.sqrt(float(((data / peak) ** 2).mean()))


def reference_metrics(x: torch.Tensor) -> dict[str, float | None]:
    """Every metric of ``torchinstruments.reduce.METRICS`` from its documented definition,
    in float64 numpy on the tensor's exact values (copied to the CPU; complex tensors by
    magnitude). A metric that is undefined for ``x`` is ``None``: all but
    ``nonfinite_fraction`` without a finite value, ``tail_ratio`` when the RMS is 0,
    ``excess_kurtosis`` below 4 finite values or for a variance of 1e-10 or less."""
    if x.is_complex():
        x = x.abs()
    values = x.detach().cpu().to(torch.float64).reshape(-1).numpy()
    finite = values[np.isfinite(values)]
    out: dict[str, float | None] = dict.fromkeys(METRICS)
    out["nonfinite_fraction"] = (values.size - finite.size) / values.size
    if finite.size == 0:
        return out
    # Scale by the largest magnitude before squaring so that the float64 reference itself
    # neither overflows (1e300) nor underflows (1e-300).
    max_abs = float(np.max(np.abs(finite)))
    scale = max_abs if max_abs > 0 else 1.0
    scaled = finite / scale
    rms = scale * math.sqrt(float(np.mean(scaled * scaled)))
    out["rms"] = rms
    out["mean_abs"] = scale * float(np.mean(np.abs(scaled)))
    out["max_abs"] = max_abs
    out["tail_ratio"] = max_abs / rms if rms > 0 else None
    centred = scaled - scaled.mean()
    m2 = float(np.mean(centred**2))
    m4 = float(np.mean(centred**4))
    if finite.size >= 4 and m2 > 1e-10:
        out["excess_kurtosis"] = m4 / (m2 * m2) - 3.0
    out["zero_fraction"] = float(np.count_nonzero(finite == 0)) / finite.size
    return out


class Reference:
    """Hand-computed reference on an uninstrumented twin.

    For every step (:meth:`start`) and every (module, call) of the named modules: the
    float64 RMS of the output and of the first gradient the output receives (with
    ``total_gradients``, of the sum of the gradients it receives over several backward
    passes). Forwards run without gradients (eval, recomputation) are ignored.
    """

    def __init__(
        self, model: nn.Module, names: Sequence[str], *, total_gradients: bool = False
    ) -> None:
        self.total_gradients = total_gradients
        self.steps: list[dict[tuple[str, int], dict[str, float]]] = []
        self._calls: dict[str, int] = {}
        modules = dict(model.named_modules())
        self._handles = [modules[name].register_forward_hook(self._hook(name)) for name in names]

    def _hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or not self.steps:
                return
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            entry = {"activation": rms64(output)}
            self.steps[-1][(name, call)] = entry
            if output.requires_grad:
                total: list[Tensor] = []

                def on_grad(gradient: Tensor) -> None:
                    if not self.total_gradients:
                        entry.setdefault("grad_output", rms64(gradient))
                        return
                    total.append(gradient.detach().double() + (total.pop() if total else 0))
                    entry["grad_output"] = rms64(total[0])

                output.register_hook(on_grad)

        return hook

    def start(self) -> None:
        """Begin a new step: later calls are recorded under it, call indices from 0."""
        self.steps.append({})
        self._calls = {}


def referenced_step(reference: Reference, step: Step = mse_step) -> Step:
    """``step`` that first starts a new step of ``reference``."""

    def run(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        reference.start()
        return step(model, x, y)

    return run


def check_against_reference(report: Report, reference: Reference) -> int:
    """Every reference value equals the report's first and latest value of its series
    (``rel=1e-4``: series.json keeps 6 significant digits). Returns how many were
    checked."""
    checked = 0
    last = len(reference.steps) - 1
    for point, step in (("first", 0), ("latest", last)):
        for (name, call), entry in reference.steps[step].items():
            module = name or "<root>"
            for signal, expected in entry.items():
                key = (module, call, signal, "output")
                got = value(report, key, point=point)
                assert got == pytest.approx(expected, rel=1e-4), (key, point, got, expected)
                checked += 1
    return checked


# ----------------------------------------------------------------------------- reading
def read_report(directory: Path) -> dict[str, Any]:
    """``report.json`` of ``directory``, parsed."""
    return json.loads((directory / "report.json").read_text(encoding="utf-8"))


def read_series(directory: Path) -> list[dict[str, Any]]:
    """The rows of ``series.json`` (every series, unlike the report's few compact rows),
    each with ``observations``, ``history`` (its points) and ``first`` / ``latest``
    (its first and last points) added, for tests that read per-series values."""
    data = json.loads((directory / "series.json").read_text(encoding="utf-8"))
    rows = []
    for row in data["series"]:
        points = row["points"]
        rows.append(
            {
                **row,
                "observations": row["count"],
                "history": points,
                "first": {"sample": points[0][0], "value": points[0][1]},
                "latest": {"sample": points[-1][0], "value": points[-1][1]},
            }
        )
    return rows


def event_of(report: dict[str, Any], finding: dict[str, Any]) -> dict[str, Any]:
    """The event a notable finding of ``report`` refers to."""
    return next(e for e in report["events"] if e["id"] == finding["event"])


def attach(model: nn.Module, directory: Path, **options: Any) -> Any:
    """``inject_observer`` writing to ``directory``, every forward sampled and every
    series reported (:data:`WIDE`) unless ``options`` say otherwise."""
    options.setdefault("sampling", 1)
    options.setdefault("report_config", WIDE)
    return inject_observer(model, output_dir=directory, **options)


def read(directory: Path) -> Report:
    """``report.json`` parsed strictly (``NaN`` or ``Infinity`` fails the test), with the
    rows of ``series.json`` added as ``series_rows`` (see :func:`read_series`)."""
    text = (directory / "report.json").read_text(encoding="utf-8")

    def refuse(constant: str) -> None:
        raise AssertionError(f"report.json contains {constant}")

    report = json.loads(text, parse_constant=refuse)
    report["series_rows"] = read_series(directory)
    return report


def finish(model: nn.Module, directory: Path) -> Report:
    """Remove the observer of ``model`` and :func:`read` what it wrote."""
    remove_observer(model)
    return read(directory)


def observe_against_twin(
    factory: Callable[[], ModuleT],
    watched: Sequence[str],
    data: Sequence[Batch],
    directory: Path,
    *,
    step: Step = mse_step,
    plain_step: Step = mse_step,
    plain: Callable[[ModuleT], None] | None = None,
    total_gradients: bool = False,
    **options: Any,
) -> tuple[Report, Reference]:
    """The twin-and-reference harness: build ``factory()`` and its uninstrumented twin
    (:func:`pair`) and a third copy for the :class:`Reference` over the ``watched``
    modules (``plain`` may change that copy first, e.g. to run without in-place ops or
    checkpointing); train the observed model (:func:`attach` with ``options``) and the
    twin on ``data`` with ``step``, and assert that training was bit-identical (losses,
    parameters and buffers); then train the reference copy with ``plain_step``.

    Returns:
        The observed run's report (:func:`finish`) and the filled reference.
    """
    model, twin = pair(factory)
    copy_for_reference = copy.deepcopy(model)
    if plain is not None:
        plain(copy_for_reference)
    reference = Reference(copy_for_reference, watched, total_gradients=total_gradients)
    attach(model, directory, **options)
    losses = fit(model, data, step)
    report = finish(model, directory)
    assert losses == fit(twin, data, step)
    assert_same_model(model, twin)
    fit(copy_for_reference, data, referenced_step(reference, plain_step))
    return report, reference


def series(report: Report, metric: str = "rms") -> dict[Key, dict[str, Any]]:
    """The ``series.json`` rows of ``metric`` keyed by series (one entry per series)."""
    found: dict[Key, dict[str, Any]] = {}
    for finding in report["series_rows"]:
        if finding["metric"] == metric:
            key = (
                finding["module"],
                finding["call_index"],
                finding["signal"],
                finding["tensor_path"],
            )
            found.setdefault(key, finding)
    return found


def value(report: Report, key: Key, *, metric: str = "rms", point: str = "latest") -> float:
    """The ``point`` (``"first"`` or ``"latest"``) value of series ``key``; fails the test
    when there is no such series or its value is not a number."""
    found = series(report, metric)
    assert key in found, f"no {metric} series {key}; series: {sorted(found)}"
    result = found[key][point]["value"]
    assert isinstance(result, float | int), (key, found[key][point])
    return float(result)


def observations(report: Report) -> dict[Key, int]:
    """Samples observed per RMS series."""
    return {key: finding["observations"] for key, finding in series(report).items()}


def act(module: str, call: int = 0, path: str = "output") -> Key:
    """The key of an activation series."""
    return (module, call, "activation", path)


def grad(module: str, call: int = 0, path: str = "output") -> Key:
    """The key of an output-gradient series."""
    return (module, call, "grad_output", path)


# ------------------------------------------------------------------------------ probes
#: The hook tables of ``nn.Module`` that :func:`hook_counts` counts.
HOOK_TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def hook_counts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Per module name, the number of entries in each of :data:`HOOK_TABLES`."""
    return {
        name: tuple(len(getattr(module, key, {}) or {}) for key in HOOK_TABLES)
        for name, module in model.named_modules()
    }


def forward_hook_counts(model: nn.Module) -> dict[str, int]:
    """Per module name, the number of forward hooks (the ones hook parking takes out)."""
    return {name: len(module._forward_hooks) for name, module in model.named_modules()}


def hook_total(model: nn.Module) -> int:
    """Forward hooks and forward pre-hooks of every module of ``model``, summed."""
    return sum(
        len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules()
    )


def instance_attributes(model: nn.Module) -> dict[str, list[str]]:
    """Per module name, the sorted names in the module's ``__dict__``."""
    return {name: sorted(module.__dict__) for name, module in model.named_modules()}


def live(kind: str) -> int:
    """Number of live objects whose class is named ``kind`` (after a collection)."""
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj).__name__ == kind)


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Leave every object alive now out of the collector's passes and of
    :func:`live_tensors` until the block ends (``gc.freeze``). Compiled code that earlier
    tests left dies over many collections, each a pass over the whole heap (20 passes
    over 700,000 objects, 8 s, after one compiled ``transformers.Trainer`` run); frozen,
    it costs a leak test nothing, and what the test makes is all that is counted."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def live_tensors() -> int:
    """Number of live tensors, subclasses included, once collections free nothing more.

    One collection is not enough after compiled code died: an autograd node defined in
    Python (Dynamo's autograd-function wrapper) frees its Python objects from its C++
    destructor, after the pass that found it, so each pass frees another layer.
    """
    for _ in range(1_000):
        if gc.collect() == 0:
            break
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), Tensor))
