"""Ground truth without the library: where does a fault first change the model?

At the fault's step, just before the fault is applied to the training model, the probe
builds two fresh copies of the model (same class and config, the training model's
``state_dict``; no observer on them), applies the fault to one of them and runs both on
one fixed probe batch, in train mode (dropout and BatchNorm as in training), with the
same torch seed before each pass (the same dropout masks). Plain forward hooks on every
module record, per call, the RMS (over finite values) and the non-finite fraction of
every floating tensor of the output; tensor hooks on those outputs record the same for
the output gradient of the training loss (one backward per pass).

- ``forward`` faults: the origin is the first module call, in the order calls return
  (a leaf before the block that holds it), whose output changed by more than
  :data:`TOLERANCE` (relative RMS) or whose non-finite fraction changed.
- ``backward`` faults: no activation may change; the origin is the *last* call, in that
  order, whose output gradient changed (gradients flow backwards).
- ``optimizer`` faults: no module changes at the fault's step. Both copies get the
  training optimizer's state (a new optimizer of the same class, ``load_state_dict``)
  and take one step on the probe batch, one with the fault applied; per block of the
  family, the probe compares the parameter updates (``|d_fault - d_clean| /
  |d_clean|``). The fault is model-wide when at least :data:`MODEL_WIDE_FRACTION` of the
  blocks' updates changed by more than :data:`UPDATE_TOLERANCE`; the first module whose
  output then differs is noted too.

Everything runs inside ``torch.random.fork_rng``, so the training run's random stream
(dropout, data order through the global generator) is exactly as without the probe.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from benchmarks.faults.score import on_origin

from .data import Batch
from .faults import Fault, FaultContext
from .models import Family

__all__ = [
    "MODEL_WIDE_FRACTION",
    "MODEL_WIDE_ORIGIN",
    "TOLERANCE",
    "UPDATE_TOLERANCE",
    "ModuleChange",
    "ProbeResult",
    "probe_fault",
]

#: Relative RMS change above which a module's output (or output gradient) has changed.
#: Unchanged calls reproduce bit for bit (same parameters, batch, seed and threads).
TOLERANCE = 1e-4
#: Relative change of a block's parameter update above which an optimizer fault moved it.
UPDATE_TOLERANCE = 0.1
#: Fraction of the blocks an optimizer fault must move to count as model-wide.
MODEL_WIDE_FRACTION = 0.75
#: The origin entry of a model-wide fault (what the report should name).
MODEL_WIDE_ORIGIN = "<model>"
#: torch seed set before each probe pass (dropout masks).
PROBE_SEED = 12_345

ROOT_NAME = "<root>"


@dataclass(frozen=True, slots=True)
class TensorStats:
    """RMS over the finite values (0 when none) and the non-finite fraction of a tensor."""

    rms: float
    nonfinite_fraction: float


def _stats(tensor: Tensor) -> TensorStats:
    values = tensor.detach().float()
    finite = torch.isfinite(values)
    count = values.numel()
    kept = values[finite]
    rms = float(kept.pow(2).mean().sqrt()) if kept.numel() else 0.0
    return TensorStats(rms=rms, nonfinite_fraction=1.0 - kept.numel() / count if count else 0.0)


def _changed(before: TensorStats, after: TensorStats) -> bool:
    if before.nonfinite_fraction != after.nonfinite_fraction:
        return True
    scale = max(abs(before.rms), abs(after.rms))
    return scale > 0 and abs(after.rms - before.rms) > TOLERANCE * scale


def _floating_tensors(value: Any, path: str = "output") -> list[tuple[str, Tensor]]:
    """Floating tensors in a module output, with paths (``output[0]``, ``output['logits']``)."""
    if isinstance(value, Tensor):
        return [(path, value)] if value.is_floating_point() else []
    if isinstance(value, dict):
        found: list[tuple[str, Tensor]] = []
        for key, item in value.items():
            found += _floating_tensors(item, f"{path}[{key!r}]")
        return found
    if isinstance(value, list | tuple):
        found = []
        for index, item in enumerate(value):
            found += _floating_tensors(item, f"{path}[{index}]")
        return found
    return []


@dataclass(slots=True)
class CallRecord:
    """One module call of a probe pass: its output and output-gradient statistics."""

    module: str
    call_index: int
    activation: dict[str, TensorStats] = field(default_factory=dict)
    grad_output: dict[str, TensorStats] = field(default_factory=dict)


def _record_pass(
    model: nn.Module, batch: Batch, loss: Callable[[nn.Module, Batch], Tensor]
) -> list[CallRecord]:
    """Forward and backward of the probe batch; the calls in the order they returned."""
    records: list[CallRecord] = []
    calls: dict[str, int] = {}
    handles = []

    def hook_for(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            record = CallRecord(name, calls.get(name, 0))
            calls[name] = record.call_index + 1
            records.append(record)
            for path, tensor in _floating_tensors(output):
                record.activation[path] = _stats(tensor)
                if tensor.requires_grad:

                    def keep(grad: Tensor, path: str = path) -> None:
                        record.grad_output[path] = _stats(grad)

                    tensor.register_hook(keep)

        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(hook_for(name or ROOT_NAME)))
    try:
        torch.manual_seed(PROBE_SEED)
        model.train()
        loss(model, batch).backward()
    finally:
        for handle in handles:
            handle.remove()
    return records


@dataclass(frozen=True, slots=True)
class ModuleChange:
    """The call the probe found first (activations) or last (gradients) to change.

    Attributes:
        module, call_index: the module call (``<root>`` is the root module).
        signal: ``activation`` or ``grad_output``.
        tensor_path: the tensor of the output that changed (``output``, ``output[0]``).
        before_rms, after_rms: RMS before and after the fault (finite values).
        before_nonfinite, after_nonfinite: non-finite fractions before and after.
        reason: ``value`` or ``not called after the fault``.
    """

    module: str
    call_index: int
    signal: str
    tensor_path: str
    before_rms: float
    after_rms: float
    before_nonfinite: float
    after_nonfinite: float
    reason: str = "value"

    def describe(self) -> str:
        """``module[call] signal path rms a->b (nonfinite x->y)``."""
        text = (
            f"{self.module}[{self.call_index}] {self.signal} {self.tensor_path} "
            f"rms {self.before_rms:.4g}->{self.after_rms:.4g}"
        )
        if self.before_nonfinite or self.after_nonfinite:
            text += f" nonfinite {self.before_nonfinite:.3g}->{self.after_nonfinite:.3g}"
        if self.reason != "value":
            text += f" ({self.reason})"
        return text


def _changes(before: list[CallRecord], after: list[CallRecord], signal: str) -> list[ModuleChange]:
    """Changed calls of one signal, in the order the calls returned before the fault."""
    after_by_key = {(r.module, r.call_index): r for r in after}
    changes: list[ModuleChange] = []
    for record in before:
        old: dict[str, TensorStats] = getattr(record, signal)
        other = after_by_key.get((record.module, record.call_index))
        if other is None:
            if old:
                path, stats = next(iter(old.items()))
                changes.append(
                    ModuleChange(
                        record.module,
                        record.call_index,
                        signal,
                        path,
                        stats.rms,
                        math.nan,
                        stats.nonfinite_fraction,
                        math.nan,
                        reason="not called after the fault",
                    )
                )
            continue
        new: dict[str, TensorStats] = getattr(other, signal)
        for path, stats in old.items():
            changed = new.get(path)
            if changed is None or _changed(stats, changed):
                changes.append(
                    ModuleChange(
                        record.module,
                        record.call_index,
                        signal,
                        path,
                        stats.rms,
                        math.nan if changed is None else changed.rms,
                        stats.nonfinite_fraction,
                        math.nan if changed is None else changed.nonfinite_fraction,
                    )
                )
                break
    return changes


@dataclass(slots=True)
class ProbeResult:
    """What the probe found, and whether it agrees with the declared origin.

    Attributes:
        acts_on: ``forward``, ``backward`` or ``optimizer`` (the fault's).
        origin_found: the change that locates the fault: first changed activation
            (forward), last changed output gradient (backward), first changed activation
            after one step (optimizer; informative only).
        activations_changed, gradients_changed: changed calls of each signal.
        calls: module calls in a probe pass.
        blocks_changed: optimizer faults: the blocks whose update changed.
        blocks: optimizer faults: the family's blocks.
        model_wide: optimizer faults: at least ``MODEL_WIDE_FRACTION`` of the blocks moved.
        agrees: the probe's answer is on the declared origin.
        note: why it does not agree, or what was compared.
    """

    acts_on: str
    origin_found: ModuleChange | None
    activations_changed: int
    gradients_changed: int
    calls: int
    agrees: bool
    note: str = ""
    blocks_changed: list[str] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)
    model_wide: bool | None = None

    def found(self) -> str:
        """The module the probe names (``<model>`` for a model-wide optimizer fault)."""
        if self.acts_on == "optimizer":
            return MODEL_WIDE_ORIGIN if self.model_wide else "(not model-wide)"
        return self.origin_found.module if self.origin_found is not None else "(no change)"

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (NaN as None)."""
        data = asdict(self)
        change = data.get("origin_found")
        if isinstance(change, dict):
            for key, value in change.items():
                if isinstance(value, float) and not math.isfinite(value):
                    change[key] = None
        data["found"] = self.found()
        return data


def _pristine_copy(family: Family, model: nn.Module) -> nn.Module:
    probe_model = family.build_model()
    probe_model.load_state_dict(model.state_dict())
    probe_model.train()
    return probe_model


def _clone_optimizer(
    optimizer: torch.optim.Optimizer, source: nn.Module, target: nn.Module
) -> torch.optim.Optimizer:
    """An optimizer of the same class over ``target``'s parameters, with ``optimizer``'s
    groups and state (parameters matched by name)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    names = {id(p): name for name, p in source.named_parameters()}
    target_parameters = dict(target.named_parameters())
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [target_parameters[names[id(p)]] for p in group["params"]],
        }
        for group in inner.param_groups
    ]
    # Every optimizer class of torch takes its parameter groups first (the base class
    # takes defaults too, which the groups already carry).
    make = cast("Callable[[list[dict[str, Any]]], torch.optim.Optimizer]", type(inner))
    clone = make(groups)
    clone.load_state_dict(inner.state_dict())
    return clone


def _block_update_changes(
    family: Family, start: nn.Module, clean: nn.Module, faulty: nn.Module
) -> list[str]:
    start_parameters = dict(start.named_parameters())
    clean_parameters = dict(clean.named_parameters())
    faulty_parameters = dict(faulty.named_parameters())
    moved: list[str] = []
    for block in family.blocks:
        names = [n for n in start_parameters if n.startswith(block + ".")]
        difference = clean_norm = 0.0
        for name in names:
            clean_update = clean_parameters[name].detach() - start_parameters[name].detach()
            faulty_update = faulty_parameters[name].detach() - start_parameters[name].detach()
            difference += float((faulty_update - clean_update).pow(2).sum())
            clean_norm += float(clean_update.pow(2).sum())
        if math.sqrt(difference) > UPDATE_TOLERANCE * max(math.sqrt(clean_norm), 1e-30):
            moved.append(block)
    return moved


def probe_fault(
    family: Family,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    fault: Fault,
    origin: tuple[str, ...],
) -> ProbeResult:
    """Locate ``fault`` on copies of ``model`` (see the module docstring).

    Call it just before applying the fault to the training model. The training model,
    its optimizer and torch's random state are left as they were.

    Args:
        family: the family (builds the copies, gives the probe batch, loss and blocks).
        model: the training model, in its state just before the fault.
        optimizer: the training optimizer (needed for optimizer faults).
        fault: the fault.
        origin: the declared origin entries (exact names or prefixes ending with ``.``).
    """
    with torch.random.fork_rng(devices=[]):
        pristine = _pristine_copy(family, model)
        batch = family.probe_batch()
        clean, faulty = copy.deepcopy(pristine), copy.deepcopy(pristine)
        if fault.acts_on == "optimizer":
            if optimizer is None:
                raise ValueError("an optimizer fault needs the training optimizer")
            clean_optimizer = _clone_optimizer(optimizer, model, clean)
            faulty_optimizer = _clone_optimizer(optimizer, model, faulty)
            fault.apply(FaultContext(faulty, faulty_optimizer))
            for copy_model, copy_optimizer in (
                (clean, clean_optimizer),
                (faulty, faulty_optimizer),
            ):
                copy_optimizer.zero_grad(set_to_none=True)
                torch.manual_seed(PROBE_SEED)
                family.loss(copy_model, batch).backward()
                copy_optimizer.step()
                copy_optimizer.zero_grad(set_to_none=True)
            moved = _block_update_changes(family, pristine, clean, faulty)
            before, after = (
                _record_pass(clean, batch, family.loss),
                _record_pass(faulty, batch, family.loss),
            )
        else:
            moved = []
            fault.apply(FaultContext(faulty, None))
            before = _record_pass(clean, batch, family.loss)
            after = _record_pass(faulty, batch, family.loss)
    activation_changes = _changes(before, after, "activation")
    gradient_changes = _changes(before, after, "grad_output")
    result = ProbeResult(
        acts_on=fault.acts_on,
        origin_found=None,
        activations_changed=len(activation_changes),
        gradients_changed=len(gradient_changes),
        calls=len(before),
        agrees=False,
    )
    if fault.acts_on == "forward":
        result.origin_found = activation_changes[0] if activation_changes else None
        result.agrees = result.origin_found is not None and on_origin(
            result.origin_found.module, origin
        )
    elif fault.acts_on == "backward":
        result.origin_found = gradient_changes[-1] if gradient_changes else None
        result.agrees = (
            not activation_changes
            and result.origin_found is not None
            and on_origin(result.origin_found.module, origin)
        )
        if activation_changes:
            result.note = f"a backward-only fault changed {len(activation_changes)} activation(s)"
    else:
        result.origin_found = activation_changes[0] if activation_changes else None
        result.blocks = list(family.blocks)
        result.blocks_changed = moved
        result.model_wide = len(moved) >= MODEL_WIDE_FRACTION * len(family.blocks)
        result.agrees = bool(result.model_wide) == (MODEL_WIDE_ORIGIN in origin)
        result.note = (
            f"one step moved the updates of {len(moved)}/{len(family.blocks)} blocks "
            f"by more than {UPDATE_TOLERANCE:.0%}"
        )
    if not result.agrees and not result.note:
        result.note = f"probe names {result.found()}, declared origin {', '.join(origin)}"
    return result
