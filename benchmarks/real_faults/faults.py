"""The faults of the real-model benchmark: bugs people report, applied to upstream models.

A fault is applied once, before the forward of its training step (``apply``), to the
model or to its optimizer, through a :class:`FaultContext`. It acts on one of three
things (``acts_on``):

- ``forward``: a module's output changes from that forward on (a weight rescaled, a
  normalisation bypassed or its weight zeroed, an activation swapped, attention scaling
  wrong, dropout raised, a NaN-producing op or weight);
- ``backward``: the gradient through one module changes and every activation stays as it
  was (a tensor hook registered from a forward hook of ours, or an identity
  ``autograd.Function`` with a scaled backward wrapped around a submodule);
- ``optimizer``: the optimizer's hyperparameters change (learning rate, momentum or
  betas, weight decay); no module is at fault, every block's update changes, and the
  first forward that differs is the one after the fault's step.

Faults that replace a module (``nn.Identity`` for a LayerNorm) take it out of the
observation: the observer's hooks stay on the old module, which is no longer called.
Faults that override a module's ``forward`` on the instance keep the module (and its
hooks) in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from benchmarks.faults.models import GradGain

__all__ = [
    "ActivationSwapped",
    "AttentionScaled",
    "DropoutRaised",
    "Fault",
    "FaultContext",
    "GradientScaledByFunction",
    "GradientScaledByHook",
    "LearningRateScaled",
    "MomentumChanged",
    "NanOp",
    "NanWeight",
    "NormBypassed",
    "NormWeightScaled",
    "WeightDecayScaled",
    "WeightScaled",
]

ActsOn = Literal["forward", "backward", "optimizer"]


@dataclass(slots=True)
class FaultContext:
    """What a fault may change: the model, its optimizer and (Trainer) the LR scheduler."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None


class Fault:
    """A fault: ``apply`` runs once, before the forward of the training step it starts at."""

    kind: ClassVar[str] = ""
    acts_on: ClassVar[ActsOn] = "forward"

    def apply(self, context: FaultContext) -> None:
        """Apply the fault to ``context.model`` (or its optimizer), in place."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line: what the fault does and where."""
        raise NotImplementedError

    def first_faulty_forward(self, fault_step: int) -> int:
        """The 0-based index of the first training forward the fault changes.

        ``fault_step`` for model faults (applied before that step's forward); one more
        for optimizer faults (the step's forward ran with the old parameters).
        """
        return fault_step + 1 if self.acts_on == "optimizer" else fault_step


def _replace_submodule(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if not hasattr(parent, child):
        raise KeyError(f"{name} is not a submodule")
    setattr(parent, child, replacement)


def _override_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Set ``forward`` on the instance: ``module(...)`` (and its hooks) call it."""
    vars(module)["forward"] = forward


@dataclass(frozen=True, slots=True)
class NormBypassed(Fault):
    """A normalisation layer replaced by ``nn.Identity`` (the layer is taken out)."""

    kind: ClassVar[str] = "norm_bypassed"
    module: str

    def apply(self, context: FaultContext) -> None:
        _replace_submodule(context.model, self.module, nn.Identity())

    def describe(self) -> str:
        return f"{self.module} replaced by Identity"


@dataclass(frozen=True, slots=True)
class NormWeightScaled(Fault):
    """A normalisation layer's affine weight multiplied by ``factor`` (0: zeroed)."""

    kind: ClassVar[str] = "norm_weight_scaled"
    module: str
    factor: float = 0.0

    def apply(self, context: FaultContext) -> None:
        with torch.no_grad():
            context.model.get_parameter(f"{self.module}.weight").mul_(self.factor)

    def describe(self) -> str:
        what = "zeroed" if self.factor == 0 else f"x{self.factor:g}"
        return f"{self.module}.weight {what}"


@dataclass(frozen=True, slots=True)
class WeightScaled(Fault):
    """One module's weight multiplied by ``factor`` once."""

    kind: ClassVar[str] = "weight_scaled"
    module: str
    factor: float = 8.0

    def apply(self, context: FaultContext) -> None:
        with torch.no_grad():
            context.model.get_parameter(f"{self.module}.weight").mul_(self.factor)

    def describe(self) -> str:
        return f"{self.module}.weight x{self.factor:g}"


def _relu(*args: Any, **kwargs: Any) -> Tensor:
    return torch.relu(args[0])


def _identity(*args: Any, **kwargs: Any) -> Tensor:
    return args[0]


@dataclass(frozen=True, slots=True)
class ActivationSwapped(Fault):
    """An activation swapped for ReLU or the identity.

    ``replace_module=True`` puts a new ``nn.ReLU`` / ``nn.Identity`` in its place (the
    old module, and the observation on it, is gone); otherwise the module stays and its
    ``forward`` is overridden on the instance.
    """

    kind: ClassVar[str] = "activation_swapped"
    module: str
    to: Literal["relu", "identity"]
    replace_module: bool = False

    def apply(self, context: FaultContext) -> None:
        if self.replace_module:
            new = nn.ReLU() if self.to == "relu" else nn.Identity()
            _replace_submodule(context.model, self.module, new)
        else:
            target = context.model.get_submodule(self.module)
            _override_forward(target, _relu if self.to == "relu" else _identity)

    def describe(self) -> str:
        how = "replaced by" if self.replace_module else "forward swapped to"
        name = {"relu": "ReLU", "identity": "identity"}[self.to]
        return f"{self.module} {how} {name}"


@dataclass(frozen=True, slots=True)
class AttentionScaled(Fault):
    """GPT-2 attention logits scaled wrongly: ``GPT2Attention.scaling`` times ``factor``.

    ``scaling`` is ``head_dim ** -0.5`` when healthy; ``disable=True`` sets it to 1.0 (as
    ``scale_attn_weights=False`` would), i.e. the logits grow by ``sqrt(head_dim)``.
    """

    kind: ClassVar[str] = "attention_scale"
    module: str
    factor: float = 1.0
    disable: bool = False

    def apply(self, context: FaultContext) -> None:
        attention = context.model.get_submodule(self.module)
        current = float(vars(attention)["scaling"])
        vars(attention)["scaling"] = 1.0 if self.disable else current * self.factor

    def describe(self) -> str:
        if self.disable:
            return f"{self.module} attention scale 1/sqrt(d) disabled"
        return f"{self.module} attention scale x{self.factor:g}"


@dataclass(frozen=True, slots=True)
class DropoutRaised(Fault):
    """One ``nn.Dropout``'s probability set to ``p`` (a misconfigured dropout)."""

    kind: ClassVar[str] = "dropout_raised"
    module: str
    p: float = 0.5

    def apply(self, context: FaultContext) -> None:
        dropout = context.model.get_submodule(self.module)
        if not isinstance(dropout, nn.Dropout):
            raise TypeError(f"{self.module} is {type(dropout).__name__}, not nn.Dropout")
        dropout.p = self.p

    def describe(self) -> str:
        return f"{self.module} dropout p={self.p:g}"


@dataclass(frozen=True, slots=True)
class NanWeight(Fault):
    """One entry of one module's weight set to NaN (a corrupted weight)."""

    kind: ClassVar[str] = "nan_weight"
    module: str
    index: tuple[int, ...] = (0, 0)

    def apply(self, context: FaultContext) -> None:
        with torch.no_grad():
            context.model.get_parameter(f"{self.module}.weight")[self.index] = math.nan

    def describe(self) -> str:
        return f"{self.module}.weight{list(self.index)} = NaN"


def _log1p(x: Tensor) -> Tensor:
    return torch.log1p(x)


def _sqrt(x: Tensor) -> Tensor:
    return torch.sqrt(x)


@dataclass(frozen=True, slots=True)
class NanOp(Fault):
    """A NaN-producing op applied to one module's output from the fault on.

    ``log1p`` (NaN where the output is below -1) or ``sqrt`` (NaN where it is negative):
    the module's ``forward`` is overridden on the instance, so the module (and the
    observation on it) stays in place and its output is the faulty tensor.
    """

    kind: ClassVar[str] = "nan_op"
    module: str
    op: Literal["log1p", "sqrt"] = "log1p"

    def apply(self, context: FaultContext) -> None:
        target = context.model.get_submodule(self.module)
        original = target.forward
        op = _log1p if self.op == "log1p" else _sqrt

        def forward(*args: Any, **kwargs: Any) -> Tensor:
            return op(original(*args, **kwargs))

        _override_forward(target, forward)

    def describe(self) -> str:
        return f"{self.op} applied to the output of {self.module}"


@dataclass(frozen=True, slots=True)
class GradientScaledByHook(Fault):
    """The gradient arriving at one module's output multiplied by ``gain`` (0: zeroed).

    A forward hook of ours registers a tensor hook on the module's output at every
    forward with grad enabled; tensor hooks run before the autograd node that produced
    the output, so the module and everything before it get the scaled gradient. The
    forward pass is unchanged.
    """

    kind: ClassVar[str] = "grad_hook"
    acts_on: ClassVar[ActsOn] = "backward"
    module: str
    gain: float = 0.05

    def apply(self, context: FaultContext) -> None:
        gain = self.gain

        def scale(grad: Tensor) -> Tensor:
            return grad * gain

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(scale)

        context.model.get_submodule(self.module).register_forward_hook(hook)

    def describe(self) -> str:
        return f"gradient into {self.module} output x{self.gain:g} (tensor hook, backward only)"


@dataclass(frozen=True, slots=True)
class GradientScaledByFunction(Fault):
    """An identity ``autograd.Function`` with a backward scaled by ``gain``, wrapped
    around one submodule's output (its ``forward`` overridden on the instance).

    The submodule's own output gradient is unchanged; everything inside it and before it
    gets the scaled gradient. The forward pass is unchanged.
    """

    kind: ClassVar[str] = "grad_function"
    acts_on: ClassVar[ActsOn] = "backward"
    module: str
    gain: float = 20.0

    def apply(self, context: FaultContext) -> None:
        target = context.model.get_submodule(self.module)
        original = target.forward
        gain = self.gain

        def forward(*args: Any, **kwargs: Any) -> Tensor:
            out = original(*args, **kwargs)
            scaled = GradGain.apply(out, gain)
            assert isinstance(scaled, Tensor)
            return scaled

        _override_forward(target, forward)

    def describe(self) -> str:
        return f"{self.module} wrapped in identity autograd.Function, backward x{self.gain:g}"


def _param_groups(context: FaultContext) -> list[dict[str, Any]]:
    if context.optimizer is None:
        raise ValueError("an optimizer fault needs the optimizer")
    return context.optimizer.param_groups


@dataclass(frozen=True, slots=True)
class LearningRateScaled(Fault):
    """Every parameter group's learning rate times ``factor`` from the fault on.

    With an LR scheduler (the Trainer's), its ``base_lrs`` are scaled too, so the
    schedule keeps the raised rate.
    """

    kind: ClassVar[str] = "lr_raised"
    acts_on: ClassVar[ActsOn] = "optimizer"
    factor: float = 30.0

    def apply(self, context: FaultContext) -> None:
        for group in _param_groups(context):
            group["lr"] *= self.factor
        scheduler = context.lr_scheduler
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * self.factor for lr in scheduler.base_lrs]

    def describe(self) -> str:
        return f"learning rate x{self.factor:g}"


@dataclass(frozen=True, slots=True)
class MomentumChanged(Fault):
    """SGD ``momentum`` or Adam ``betas`` set to wrong values from the fault on."""

    kind: ClassVar[str] = "momentum_broken"
    acts_on: ClassVar[ActsOn] = "optimizer"
    momentum: float | None = None
    betas: tuple[float, float] | None = None

    def apply(self, context: FaultContext) -> None:
        for group in _param_groups(context):
            if self.momentum is not None:
                group["momentum"] = self.momentum
            if self.betas is not None:
                group["betas"] = self.betas

    def describe(self) -> str:
        if self.momentum is not None:
            return f"SGD momentum={self.momentum:g}"
        return f"Adam betas={self.betas}"


@dataclass(frozen=True, slots=True)
class WeightDecayScaled(Fault):
    """Every parameter group's weight decay times ``factor`` (a decay meant as 0.05 given
    as 10: with AdamW's decoupled decay and a learning rate of 1e-3, every weight shrinks
    by 1% per step before the gradient pulls it back)."""

    kind: ClassVar[str] = "weight_decay_huge"
    acts_on: ClassVar[ActsOn] = "optimizer"
    factor: float = 200.0

    def apply(self, context: FaultContext) -> None:
        for group in _param_groups(context):
            group["weight_decay"] *= self.factor

    def describe(self) -> str:
        return f"weight decay x{self.factor:g}"
