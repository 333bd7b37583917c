"""Scenarios of the real-model benchmark: a known fault at a known module and step.

A scenario trains one run of a family (:mod:`.models`) with the observer attached with
its default settings, applies its fault at a fixed fraction of the run (before that
step's forward; never in the first :data:`MIN_FAULT_STEP` steps, and with at least
:data:`MIN_SAMPLES_AFTER` sampled forwards of the default schedule after it) and returns
the ``report.json`` written by ``remove_observer``, the probe's ground truth and the
losses. The clean controls are the same runs with no fault: same seed, data order and
initialisation as the faulty runs of their family; the second control of each family
(``*_clean_seed1``) uses the next seed (another initialisation and data order).

Ground truth, as in ``benchmarks.faults``:

- ``origin``: module names (exact) or block prefixes (ending with ``.``) where the fault
  starts, as in ``model.named_modules()``. Prefixes are used when the fault changes a
  block's structure (a module replaced: its old hooks go with it) or sits inside a
  container that also returns the changed tensor (``transformer.h.2.attn`` and its
  children). Optimizer faults have the origin ``("<model>",)``: nothing starts at one
  module, every block's update changes, and the report is expected to say so with a
  model-wide finding whose module is ``<model>``.
- ``expected``: the categories (docs/report.md) in which the fault should be reported.

The probe (:mod:`.probe`) checks every origin without the library, at the fault's step.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchinstruments import DefaultSampling

from .faults import (
    ActivationSwapped,
    AttentionScaled,
    DropoutRaised,
    Fault,
    FaultContext,
    GradientScaledByFunction,
    GradientScaledByHook,
    LearningRateScaled,
    MomentumChanged,
    NanOp,
    NanWeight,
    NormBypassed,
    NormWeightScaled,
    WeightDecayScaled,
    WeightScaled,
)
from .loops import run_loop
from .models import FAMILIES
from .probe import MODEL_WIDE_ORIGIN, ProbeResult, probe_fault

__all__ = [
    "MIN_FAULT_STEP",
    "MIN_SAMPLES_AFTER",
    "QUICK_STEPS",
    "SCENARIOS",
    "STEPS",
    "RunResult",
    "Scenario",
    "early_findings",
    "run_named_scenario",
    "run_scenario",
    "sampled_after",
]

#: Training steps of a full run.
STEPS = 1_000
#: Training steps of a ``--quick`` run.
QUICK_STEPS = 300
#: No fault starts before this step.
MIN_FAULT_STEP = 150
#: Sampled forwards (default schedule) a run must have after its first faulty forward.
MIN_SAMPLES_AFTER = 5
#: Steps averaged for the loss before the fault and at the end of the run.
LOSS_WINDOW = 20


def sampled_after(first_faulty_forward: int, steps: int) -> int:
    """Forwards the default sampling schedule samples in ``[first_faulty_forward, steps)``."""
    policy = DefaultSampling()
    return sum(1 for i in range(first_faulty_forward, steps) if policy.should_sample(i))


@dataclass(frozen=True, slots=True)
class Scenario:
    """One benchmark run and its ground truth.

    Attributes:
        name: unique name (``--only NAME``).
        family: a key of :data:`~benchmarks.real_faults.models.FAMILIES`.
        fault: the fault, or None for a clean control.
        at: fraction of the run's steps at which the fault starts.
        origin: exact module names or prefixes (ending with ``.``) where the fault
            starts; ``("<model>",)`` for a model-wide (optimizer) fault; None for a
            control.
        expected: categories in which the fault should be reported.
        quick: part of the ``--quick`` set (one fault and one control per loop: the
            Trainer's GPT-2, the plain loop's ResNet, accelerate's ViT).
        seed_offset: added to ``--seed`` (1 for the second control of a family).
    """

    name: str
    family: str
    fault: Fault | None = None
    at: float = 0.5
    origin: tuple[str, ...] | None = None
    expected: tuple[str, ...] = ()
    quick: bool = False
    seed_offset: int = 0

    @property
    def control(self) -> bool:
        """A clean run (no fault)."""
        return self.fault is None

    @property
    def kind(self) -> str:
        """The fault's kind, or ``control``."""
        return "control" if self.fault is None else self.fault.kind

    @property
    def loop(self) -> str:
        """The family's loop: ``plain``, ``trainer`` or ``accelerate``."""
        return FAMILIES[self.family].loop

    def fault_step(self, steps: int) -> int | None:
        """The step before whose forward the fault is applied (None for a control):
        ``at * steps``, and never before :data:`MIN_FAULT_STEP` (short ``--quick`` runs)."""
        return None if self.fault is None else max(MIN_FAULT_STEP, round(self.at * steps))

    def first_faulty_forward(self, steps: int) -> int | None:
        """The first training forward the fault changes (None for a control)."""
        step = self.fault_step(steps)
        return None if self.fault is None or step is None else self.fault.first_faulty_forward(step)


SCALE = ("activation_scale_drift", "regime_change")
SCALE_TAIL = ("activation_scale_drift", "regime_change", "heavy_tail_growth")
DEAD = ("zero_fraction_growth", "activation_scale_drift", "regime_change")
GRAD = ("gradient_scale_change", "regime_change")
NAN = ("non_finite",)
UNSTABLE = ("activation_scale_drift", "regime_change", "relative_volatility", "oscillation")
SHRINK = ("activation_scale_drift", "regime_change")
MODEL = (MODEL_WIDE_ORIGIN,)

SCENARIOS: tuple[Scenario, ...] = (
    # ---------------------------------------------------------------- GPT-2, plain loop
    Scenario("gpt2_clean", "gpt2"),
    Scenario("gpt2_clean_seed1", "gpt2", seed_offset=1),
    Scenario(
        "gpt2_ln2_bypassed_h1",
        "gpt2",
        NormBypassed("transformer.h.1.ln_2"),
        0.42,
        ("transformer.h.1.",),
        SCALE,
    ),
    Scenario(
        "gpt2_attn_unscaled_h2",
        "gpt2",
        AttentionScaled("transformer.h.2.attn", disable=True),
        0.5,
        ("transformer.h.2.attn", "transformer.h.2.attn."),
        SCALE_TAIL,
    ),
    Scenario(
        "gpt2_fc_x8_h2",
        "gpt2",
        WeightScaled("transformer.h.2.mlp.c_fc", 8.0),
        0.38,
        ("transformer.h.2.mlp.c_fc",),
        SCALE,
    ),
    Scenario(
        "gpt2_qkv_x1.4_h0",
        "gpt2",
        WeightScaled("transformer.h.0.attn.c_attn", 1.4),
        0.45,
        ("transformer.h.0.attn.c_attn",),
        SCALE,
    ),
    Scenario(
        "gpt2_dropout_0.7_h1",
        "gpt2",
        DropoutRaised("transformer.h.1.mlp.dropout", 0.7),
        0.54,
        ("transformer.h.1.mlp.dropout",),
        DEAD,
    ),
    Scenario(
        "gpt2_gelu_to_relu_h3",
        "gpt2",
        ActivationSwapped("transformer.h.3.mlp.act", "relu", replace_module=True),
        0.4,
        ("transformer.h.3.mlp.",),
        DEAD,
    ),
    Scenario(
        "gpt2_grad_x0.05_h1",
        "gpt2",
        GradientScaledByHook("transformer.h.1.attn.c_proj", 0.05),
        0.47,
        ("transformer.h.1.attn.c_proj",),
        GRAD,
    ),
    Scenario(
        "gpt2_nan_weight_h3",
        "gpt2",
        NanWeight("transformer.h.3.attn.c_attn", (5, 17)),
        0.56,
        ("transformer.h.3.attn.c_attn",),
        NAN,
    ),
    Scenario("gpt2_lr_x30", "gpt2", LearningRateScaled(30.0), 0.48, MODEL, UNSTABLE),
    # ---------------------------------------------------------------- GPT-2, Trainer
    Scenario("trainer_clean", "gpt2_trainer", quick=True),
    Scenario("trainer_clean_seed1", "gpt2_trainer", seed_offset=1),
    Scenario(
        "trainer_ln1_zeroed_h2",
        "gpt2_trainer",
        NormWeightScaled("transformer.h.2.ln_1", 0.0),
        0.44,
        ("transformer.h.2.ln_1",),
        SCALE,
        quick=True,
    ),
    Scenario(
        "trainer_attn_x8_h0",
        "gpt2_trainer",
        AttentionScaled("transformer.h.0.attn", factor=8.0),
        0.52,
        ("transformer.h.0.attn", "transformer.h.0.attn."),
        SCALE_TAIL,
    ),
    Scenario("trainer_lr_x30", "gpt2_trainer", LearningRateScaled(30.0), 0.4, MODEL, UNSTABLE),
    # ---------------------------------------------------------------- ResNet, plain loop
    Scenario("resnet_clean", "resnet", quick=True),
    Scenario("resnet_clean_seed1", "resnet", seed_offset=1),
    Scenario(
        "resnet_bn2_bypassed_l2",
        "resnet",
        NormBypassed("layer2.0.bn2"),
        0.46,
        ("layer2.0.",),
        SCALE,
    ),
    Scenario(
        "resnet_conv_x0.1_l3",
        "resnet",
        WeightScaled("layer3.0.conv2", 0.1),
        0.55,
        ("layer3.0.conv2",),
        SCALE,
        quick=True,
    ),
    Scenario(
        "resnet_relu_to_identity_l1",
        "resnet",
        ActivationSwapped("layer1.0.relu", "identity", replace_module=True),
        0.36,
        ("layer1.0.",),
        DEAD,
    ),
    Scenario(
        "resnet_grad_zero_l3",
        "resnet",
        GradientScaledByHook("layer3.0.bn2", 0.0),
        0.5,
        ("layer3.0.bn2",),
        GRAD,
    ),
    Scenario(
        "resnet_log1p_nan_l2",
        "resnet",
        NanOp("layer2.0.bn1", "log1p"),
        0.57,
        ("layer2.0.bn1",),
        NAN,
    ),
    Scenario(
        "resnet_momentum_0.995",
        "resnet",
        MomentumChanged(momentum=0.995),
        0.43,
        MODEL,
        UNSTABLE,
    ),
    # ---------------------------------------------------------------- ViT, accelerate
    Scenario("vit_clean", "vit", quick=True),
    Scenario("vit_clean_seed1", "vit", seed_offset=1),
    Scenario(
        "vit_norm2_x0.1_b1",
        "vit",
        NormWeightScaled("blocks.1.norm2", 0.1),
        0.41,
        ("blocks.1.norm2",),
        SCALE,
    ),
    Scenario(
        "vit_qkv_x8_b0",
        "vit",
        WeightScaled("blocks.0.attn.qkv", 8.0),
        0.53,
        ("blocks.0.attn.qkv",),
        SCALE_TAIL,
    ),
    Scenario(
        "vit_gelu_to_identity_b2",
        "vit",
        ActivationSwapped("blocks.2.mlp.act", "identity"),
        0.45,
        ("blocks.2.mlp.act",),
        SCALE,
    ),
    Scenario(
        "vit_dropout_0.5_b3",
        "vit",
        DropoutRaised("blocks.3.attn.proj_drop", 0.5),
        0.37,
        ("blocks.3.attn.proj_drop",),
        DEAD,
    ),
    Scenario(
        "vit_grad_x20_b1",
        "vit",
        GradientScaledByFunction("blocks.1.mlp", 20.0),
        0.49,
        ("blocks.1.mlp.",),
        GRAD,
        quick=True,
    ),
    Scenario(
        "vit_sqrt_nan_b3",
        "vit",
        NanOp("blocks.3.mlp.fc1", "sqrt"),
        0.56,
        ("blocks.3.mlp.fc1",),
        NAN,
    ),
    Scenario(
        "vit_weight_decay_x200",
        "vit",
        WeightDecayScaled(200.0),
        0.51,
        MODEL,
        SHRINK,
    ),
)

assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)


def _check_schedule() -> None:
    for scenario in SCENARIOS:
        for steps in (STEPS, QUICK_STEPS) if scenario.quick else (STEPS,):
            first = scenario.first_faulty_forward(steps)
            step = scenario.fault_step(steps)
            if first is None or step is None:
                continue
            assert step >= MIN_FAULT_STEP, f"{scenario.name}: fault at step {step}"
            after = sampled_after(first, steps)
            assert after >= MIN_SAMPLES_AFTER, f"{scenario.name}: {after} samples after"


_check_schedule()


@dataclass(slots=True)
class RunResult:
    """A finished scenario run.

    Attributes:
        scenario: the scenario.
        steps: training steps (= training forwards).
        seed: the run's seed (``--seed`` plus the scenario's offset).
        fault_step: step before whose forward the fault was applied (None: control).
        first_faulty_forward: first training forward the fault changed (None: control).
        samples_after_fault: forwards of the default schedule sampled from then on.
        report: the parsed ``report.json``.
        report_bytes: its size on disk, bytes.
        output_dir: where the run's files are (None once removed).
        probe: the ground-truth probe (None for a control).
        loss_before: mean finite loss of the ``LOSS_WINDOW`` steps before the fault (for a
            control: before the middle of the run), nats.
        loss_end: mean finite loss of the last ``LOSS_WINDOW`` steps, nats.
        nonfinite_losses: steps whose loss was not finite.
        skipped_updates: optimizer steps skipped because the gradient norm was not finite.
        seconds: wall time of the run (training, probe and report).
    """

    scenario: Scenario
    steps: int
    seed: int
    fault_step: int | None
    first_faulty_forward: int | None
    samples_after_fault: int | None
    report: dict[str, Any]
    report_bytes: int
    output_dir: Path | None
    probe: ProbeResult | None
    loss_before: float
    loss_end: float
    nonfinite_losses: int
    skipped_updates: int
    seconds: float


def _mean_finite(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def early_findings(
    report: dict[str, Any], first_faulty_forward: int | None
) -> list[dict[str, Any]]:
    """Notable findings whose detected change (``change_forward``) is dated before the
    fault's first faulty training forward (none for a control or without the field)."""
    if first_faulty_forward is None:
        return []
    return [
        f
        for f in report.get("findings", [])
        if f.get("notable")
        and isinstance(f.get("change_forward"), int)
        and f["change_forward"] < first_faulty_forward
    ]


def run_scenario(
    scenario: Scenario,
    *,
    steps: int = STEPS,
    seed: int = 0,
    output_dir: Path | None = None,
) -> RunResult:
    """Train one scenario with the observer attached and return its report and probe.

    Args:
        scenario: what to run.
        steps: training steps.
        seed: base seed of initialisation and data (the scenario's offset is added).
        output_dir: the observer's directory, kept; a temporary one (removed afterwards)
            when None.
    """
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        return _run(scenario, steps, seed + scenario.seed_offset, output_dir, keep=True)
    with tempfile.TemporaryDirectory(prefix=f"real-faults-{scenario.name}-") as directory:
        return _run(scenario, steps, seed + scenario.seed_offset, Path(directory), keep=False)


def run_named_scenario(
    name: str, steps: int, seed: int, output_dir: Path | None, threads: int
) -> RunResult:
    """:func:`run_scenario` of the scenario called ``name`` with ``threads`` torch CPU
    threads: what a worker process of ``python -m benchmarks.real_faults --jobs N`` runs
    (an importable function, so that a spawned interpreter finds it)."""
    torch.set_num_threads(threads)
    scenario = next(s for s in SCENARIOS if s.name == name)
    return run_scenario(scenario, steps=steps, seed=seed, output_dir=output_dir)


def _run(scenario: Scenario, steps: int, seed: int, directory: Path, *, keep: bool) -> RunResult:
    family = FAMILIES[scenario.family]
    fault = scenario.fault
    fault_step = scenario.fault_step(steps)
    probes: list[ProbeResult] = []

    def at_fault(model: nn.Module, optimizer: Any, lr_scheduler: Any) -> None:
        assert fault is not None and scenario.origin is not None
        probes.append(probe_fault(family, model, optimizer, fault, scenario.origin))
        fault.apply(FaultContext(model, optimizer, lr_scheduler))

    started = time.perf_counter()
    outcome = run_loop(
        family,
        steps=steps,
        seed=seed,
        output_dir=directory,
        fault_step=fault_step,
        at_fault=at_fault if fault is not None else None,
    )
    seconds = time.perf_counter() - started
    if fault is not None and not probes:
        raise RuntimeError(f"{scenario.name}: the fault was never applied")
    report_path = directory / "report.json"
    report = json.loads(report_path.read_text(encoding="utf-8"))
    losses = outcome.losses
    split = fault_step if fault_step is not None else steps // 2
    first = scenario.first_faulty_forward(steps)
    return RunResult(
        scenario=scenario,
        steps=steps,
        seed=seed,
        fault_step=fault_step,
        first_faulty_forward=first,
        samples_after_fault=None if first is None else sampled_after(first, steps),
        report=report,
        report_bytes=report_path.stat().st_size,
        output_dir=directory if keep else None,
        probe=probes[0] if probes else None,
        loss_before=_mean_finite(losses[max(0, split - LOSS_WINDOW) : split]),
        loss_end=_mean_finite(losses[-LOSS_WINDOW:]),
        nonfinite_losses=sum(1 for v in losses if not math.isfinite(v)),
        skipped_updates=outcome.skipped_updates,
        seconds=seconds,
    )
