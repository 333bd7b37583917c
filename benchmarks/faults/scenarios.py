"""Fault scenarios: a known fault at a known module and step, and how to run one.

A scenario trains one model family (see :mod:`benchmarks.faults.models`) with the
observer attached (``sampling=1``: every training forward is a sample), applies its fault
at a fixed fraction of the run (so ``--quick``'s shorter runs keep the same shape) and
returns the ``report.json`` written by ``remove_observer``. The clean controls are the
same runs with no fault: same seed, data order and initialisation as the faulty runs of
their family.

Each scenario states its ground truth:

- ``origin``: where the fault starts, as module names; an entry ending with ``.`` is a
  prefix (``blocks.3.`` = any module of block 3), any other entry an exact module name.
  Exact names are used when the fault sits on one module's parameters or output; a
  block prefix when the fault changes the block's structure (a removed normalization, a
  scaled residual branch, a ReLU killed by the bias before it) and several of its leaves
  are equally fair answers. A raised learning rate has no origin module: it moves the
  whole model at once, and the report must say so with a model-wide finding (module
  ``<model>``). ``None``: scored on category only.
- ``expected``: the categories in which the fault should be reported.

The training loop skips the optimizer step when a gradient is not finite (a common
guard), so a one-step NaN does not end the run.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from torchinstruments import inject_observer, remove_observer

from .models import FAMILIES, Block, Faultable, Scale

__all__ = [
    "QUICK_STEPS",
    "SCENARIOS",
    "STEPS",
    "BackwardOnly",
    "ChannelGrowth",
    "DeadReluBias",
    "Fault",
    "InputScale",
    "LearningRate",
    "NanOutput",
    "NormRemoved",
    "ResidualScale",
    "RunResult",
    "RunState",
    "Scenario",
    "WeightScale",
    "run_scenario",
]

#: Training steps of a full run (one sampled forward each: ``sampling=1``).
STEPS = 300
#: Training steps of a ``--quick`` run.
QUICK_STEPS = 120
#: Steps averaged for the loss before the fault and at the end of the run.
LOSS_WINDOW = 20


@dataclass(slots=True)
class RunState:
    """What a fault may change while a scenario trains."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    input_scale: float = 1.0


def _faultable(run: RunState, name: str) -> Faultable:
    module = run.model.get_submodule(name)
    assert isinstance(module, Faultable), f"{name} is not a Faultable leaf"
    return module


def _block(run: RunState, name: str) -> Block:
    module = run.model.get_submodule(name)
    assert isinstance(module, Block), f"{name} is not a block"
    return module


def _scale(run: RunState, name: str) -> Scale:
    module = run.model.get_submodule(name)
    assert isinstance(module, Scale), f"{name} is not a Scale"
    return module


class Fault:
    """A fault: ``start`` runs before the training step at which it begins, ``step``
    before that step and every later one (``since`` = steps since the start)."""

    kind: ClassVar[str] = ""

    def start(self, run: RunState) -> None:
        """Apply the fault (default: nothing)."""

    def step(self, run: RunState, since: int) -> None:
        """Update the fault before each step from the start on (default: nothing)."""

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class WeightScale(Fault):
    """Multiply one module's weight by ``factor`` once."""

    kind: ClassVar[str] = "weight_scaled"
    module: str
    factor: float = 8.0

    def start(self, run: RunState) -> None:
        with torch.no_grad():
            run.model.get_parameter(f"{self.module}.weight").mul_(self.factor)

    def describe(self) -> str:
        return f"{self.module}.weight x{self.factor:g}"


@dataclass(frozen=True, slots=True)
class DeadReluBias(Fault):
    """Set the bias of the module before a ReLU to ``bias`` on the first ``fraction`` of
    its units (channels), so the ReLU outputs zeros there and passes no gradient."""

    kind: ClassVar[str] = "dead_relu_bias"
    module: str
    bias: float = -10.0
    fraction: float = 1.0

    def start(self, run: RunState) -> None:
        with torch.no_grad():
            parameter = run.model.get_parameter(f"{self.module}.bias")
            parameter[: math.ceil(self.fraction * parameter.numel())] = self.bias

    def describe(self) -> str:
        return f"{self.module}.bias={self.bias:g} on {self.fraction:.0%} of units"


def _nan_rows(out: Tensor) -> Tensor:
    mask = torch.zeros_like(out, dtype=torch.bool)
    mask[0] = True
    return out.masked_fill(mask, math.nan)


@dataclass(frozen=True, slots=True)
class NanOutput(Fault):
    """NaN in the first example of one module's output, for ``steps`` steps."""

    kind: ClassVar[str] = "nan_output"
    module: str
    steps: int = 1

    def start(self, run: RunState) -> None:
        _faultable(run, self.module).output_fault = _nan_rows

    def step(self, run: RunState, since: int) -> None:
        if since == self.steps:
            _faultable(run, self.module).output_fault = None

    def describe(self) -> str:
        return f"NaN in example 0 of {self.module} output for {self.steps} step(s)"


@dataclass(frozen=True, slots=True)
class ResidualScale(Fault):
    """Scale a residual branch (a :class:`~benchmarks.faults.models.Scale`) down."""

    kind: ClassVar[str] = "residual_scaled_down"
    module: str
    factor: float = 0.02

    def start(self, run: RunState) -> None:
        _scale(run, self.module).factor = self.factor

    def describe(self) -> str:
        return f"{self.module} factor {self.factor:g}"


@dataclass(frozen=True, slots=True)
class NormRemoved(Fault):
    """The block skips one of its normalizations from the start on."""

    kind: ClassVar[str] = "norm_removed"
    block: str
    norm: str

    def start(self, run: RunState) -> None:
        _block(run, self.block).skip_norms.add(self.norm)

    def describe(self) -> str:
        return f"{self.block} skips {self.norm}"


@dataclass(slots=True)
class _ChannelMultiplier:
    channel: int
    axis: int
    factor: float = 1.0

    def __call__(self, out: Tensor) -> Tensor:
        shape = [1] * out.dim()
        shape[self.axis] = out.shape[self.axis]
        gain = torch.ones(shape, dtype=out.dtype, device=out.device)
        gain.view(-1)[self.channel] = self.factor
        return out * gain


@dataclass(frozen=True, slots=True)
class ChannelGrowth(Fault):
    """One channel of one module's output multiplied by ``growth ** since``."""

    kind: ClassVar[str] = "channel_growth"
    module: str
    channel: int
    axis: int
    growth: float = 1.03
    multiplier: _ChannelMultiplier = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "multiplier", _ChannelMultiplier(self.channel, self.axis))

    def start(self, run: RunState) -> None:
        self.multiplier.factor = 1.0
        _faultable(run, self.module).output_fault = self.multiplier

    def step(self, run: RunState, since: int) -> None:
        self.multiplier.factor = self.growth**since

    def describe(self) -> str:
        return f"{self.module} channel {self.channel} x{self.growth:g}^t"


@dataclass(frozen=True, slots=True)
class InputScale(Fault):
    """Inputs multiplied by ``factor`` from the start on (origin: the first layer)."""

    kind: ClassVar[str] = "input_rescaled"
    factor: float = 10.0

    def start(self, run: RunState) -> None:
        run.input_scale = self.factor

    def describe(self) -> str:
        return f"inputs x{self.factor:g}"


@dataclass(frozen=True, slots=True)
class LearningRate(Fault):
    """Every parameter group's learning rate multiplied by ``factor`` (no origin module)."""

    kind: ClassVar[str] = "lr_raised"
    factor: float = 10.0

    def start(self, run: RunState) -> None:
        for group in run.optimizer.param_groups:
            group["lr"] *= self.factor

    def describe(self) -> str:
        return f"learning rate x{self.factor:g}"


@dataclass(frozen=True, slots=True)
class BackwardOnly(Fault):
    """The block's branch gradient multiplied by ``gain`` in the backward pass only
    (see :class:`~benchmarks.faults.models.GradGain`): activations unchanged."""

    kind: ClassVar[str] = "backward_only"
    block: str
    gain: float = 0.01

    def start(self, run: RunState) -> None:
        _block(run, self.block).grad_gain = self.gain

    def describe(self) -> str:
        return f"{self.block} branch gradient x{self.gain:g} (backward only)"


@dataclass(frozen=True, slots=True)
class Scenario:
    """One benchmark run and its ground truth.

    Attributes:
        name: unique name (``--only NAME``).
        family: ``mlp``, ``cnn`` or ``transformer``.
        fault: the fault, or None for a clean control.
        at: fraction of the run's steps at which the fault starts.
        origin: module names (exact) or prefixes (ending with ``.``) where the fault
            starts; None scores the category only (or marks a control).
        expected: categories in which the fault should be reported.
        quick: part of the ``--quick`` set.
    """

    name: str
    family: str
    fault: Fault | None = None
    at: float = 0.5
    origin: tuple[str, ...] | None = None
    expected: tuple[str, ...] = ()
    quick: bool = False

    @property
    def control(self) -> bool:
        return self.fault is None

    @property
    def kind(self) -> str:
        return "control" if self.fault is None else self.fault.kind

    def fault_step(self, steps: int) -> int | None:
        return None if self.fault is None else round(self.at * steps)


SCALE = ("activation_scale_drift", "regime_change")
DEAD = ("zero_fraction_growth", "activation_scale_drift")
GRAD = ("gradient_scale_change", "regime_change")
RESIDUAL = ("activation_scale_drift", "gradient_scale_change")
TAIL = ("heavy_tail_growth", "activation_scale_drift")
NAN = ("non_finite",)
#: A raised learning rate moves the whole model at once: a model-wide event, reported as
#: module ``<model>`` in any of the categories it moves.
MODEL = "<model>"
MODEL_WIDE = (
    "activation_scale_drift",
    "gradient_scale_change",
    "regime_change",
    "relative_volatility",
    "oscillation",
)

SCENARIOS: tuple[Scenario, ...] = (
    # MLP: stem, blocks.0 .. blocks.5, head_norm, head
    Scenario("mlp_clean", "mlp", quick=True),
    Scenario(
        "mlp_weight_x8_b1", "mlp", WeightScale("blocks.1.fc1"), 0.47, ("blocks.1.fc1",), SCALE
    ),
    Scenario("mlp_dead_relu_b4", "mlp", DeadReluBias("blocks.4.fc1"), 0.57, ("blocks.4.",), DEAD),
    Scenario(
        "mlp_residual_down_b3",
        "mlp",
        ResidualScale("blocks.3.scale"),
        0.5,
        ("blocks.3.",),
        RESIDUAL,
        quick=True,
    ),
    Scenario("mlp_input_x10", "mlp", InputScale(10.0), 0.43, ("stem",), SCALE),
    Scenario("mlp_nan_b5", "mlp", NanOutput("blocks.5.fc2"), 0.67, ("blocks.5.fc2",), NAN),
    Scenario("mlp_backward_b0", "mlp", BackwardOnly("blocks.0"), 0.4, ("blocks.0.fc2",), GRAD),
    Scenario("mlp_lr_x8", "mlp", LearningRate(8.0), 0.53, (MODEL,), MODEL_WIDE),
    # CNN: stem, blocks.0 .. blocks.3, head
    Scenario("cnn_clean", "cnn", quick=True),
    Scenario("cnn_drop_bn_b0", "cnn", NormRemoved("blocks.0", "bn1"), 0.5, ("blocks.0.",), SCALE),
    Scenario(
        "cnn_dead_relu_b1",
        "cnn",
        DeadReluBias("blocks.1.bn1", fraction=0.5),
        0.45,
        ("blocks.1.",),
        DEAD,
    ),
    Scenario(
        "cnn_channel_growth_b2",
        "cnn",
        ChannelGrowth("blocks.2.conv2", channel=3, axis=1),
        0.4,
        ("blocks.2.conv2",),
        TAIL,
        quick=True,
    ),
    Scenario(
        "cnn_weight_x8_b3", "cnn", WeightScale("blocks.3.conv1"), 0.63, ("blocks.3.conv1",), SCALE
    ),
    Scenario("cnn_input_x10", "cnn", InputScale(10.0), 0.67, ("stem",), SCALE),
    Scenario(
        "cnn_backward_b2", "cnn", BackwardOnly("blocks.2", 0.02), 0.55, ("blocks.2.bn2",), GRAD
    ),
    # transformer: embed, pos, blocks.0 .. blocks.3, head_norm, head
    Scenario("tfm_clean", "transformer", quick=True),
    Scenario(
        "tfm_weight_x8_b0",
        "transformer",
        WeightScale("blocks.0.attn.qkv"),
        0.53,
        ("blocks.0.attn.qkv",),
        SCALE,
    ),
    Scenario(
        "tfm_nan_b1",
        "transformer",
        NanOutput("blocks.1.attn.proj"),
        0.5,
        ("blocks.1.attn.proj",),
        NAN,
        quick=True,
    ),
    Scenario(
        "tfm_residual_down_b1",
        "transformer",
        ResidualScale("blocks.1.mlp_scale"),
        0.43,
        ("blocks.1.",),
        RESIDUAL,
    ),
    Scenario(
        "tfm_backward_b2",
        "transformer",
        BackwardOnly("blocks.2"),
        0.47,
        ("blocks.2.attn.proj",),
        GRAD,
        quick=True,
    ),
    Scenario(
        "tfm_channel_growth_b2",
        "transformer",
        ChannelGrowth("blocks.2.fc1", channel=5, axis=-1),
        0.57,
        ("blocks.2.fc1",),
        TAIL,
    ),
    Scenario(
        "tfm_drop_norm_b3",
        "transformer",
        NormRemoved("blocks.3", "norm2"),
        0.6,
        ("blocks.3.",),
        SCALE,
    ),
    Scenario("tfm_lr_x10", "transformer", LearningRate(10.0), 0.5, (MODEL,), MODEL_WIDE),
)

assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)


@dataclass(slots=True)
class RunResult:
    """A finished scenario run.

    Attributes:
        scenario: the scenario.
        steps: training steps run (all sampled).
        fault_step: step at which the fault started (None for a control).
        report: the parsed ``report.json``.
        loss_before: mean finite loss over the ``LOSS_WINDOW`` steps before the fault (for
            a control: before the middle of the run).
        loss_end: mean finite loss over the last ``LOSS_WINDOW`` steps.
        nonfinite_losses: steps whose loss was not finite.
        skipped_updates: optimizer steps skipped because a gradient was not finite.
        seconds: wall time of the run.
    """

    scenario: Scenario
    steps: int
    fault_step: int | None
    report: dict[str, Any]
    loss_before: float
    loss_end: float
    nonfinite_losses: int
    skipped_updates: int
    seconds: float


def _mean_finite(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _grads_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def run_scenario(
    scenario: Scenario,
    *,
    steps: int = STEPS,
    seed: int = 0,
    report_dir: Path | None = None,
) -> RunResult:
    """Train one scenario with the observer attached and return its report.

    Args:
        scenario: what to run.
        steps: training steps; every one is sampled (``sampling=1``).
        seed: seed of the model initialisation and the data.
        report_dir: where to keep ``report.json`` and ``index.md``; a temporary
            directory (removed afterwards) when None.
    """
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        return _run(scenario, steps, seed, report_dir)
    with tempfile.TemporaryDirectory(prefix=f"faults-{scenario.name}-") as directory:
        return _run(scenario, steps, seed, Path(directory))


def _run(scenario: Scenario, steps: int, seed: int, directory: Path) -> RunResult:
    family = FAMILIES[scenario.family]
    torch.manual_seed(seed)
    model = family.build()
    data = family.data(seed)
    optimizer = family.optimizer(model)
    run = RunState(model, optimizer)
    fault = scenario.fault
    fault_step = scenario.fault_step(steps)
    losses: list[float] = []
    skipped = 0
    started = time.perf_counter()
    inject_observer(model, output_dir=directory, sampling=1)
    try:
        model.train()
        for step in range(steps):
            if fault is not None and fault_step is not None and step >= fault_step:
                if step == fault_step:
                    fault.start(run)
                fault.step(run, step - fault_step)
            inputs, labels = data.next()
            if run.input_scale != 1.0:
                inputs = inputs * run.input_scale
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            if _grads_finite(model):
                optimizer.step()
            else:
                skipped += 1
            losses.append(loss.item())
    finally:
        remove_observer(model)
    seconds = time.perf_counter() - started
    report = json.loads((directory / "report.json").read_text(encoding="utf-8"))
    split = fault_step if fault_step is not None else steps // 2
    return RunResult(
        scenario=scenario,
        steps=steps,
        fault_step=fault_step,
        report=report,
        loss_before=_mean_finite(losses[max(0, split - LOSS_WINDOW) : split]),
        loss_end=_mean_finite(losses[-LOSS_WINDOW:]),
        nonfinite_losses=sum(1 for v in losses if not math.isfinite(v)),
        skipped_updates=skipped,
        seconds=seconds,
    )
