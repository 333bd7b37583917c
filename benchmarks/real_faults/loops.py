"""The three training loops: a plain torch loop, ``transformers.Trainer`` and accelerate.

Each loop trains one run of a family with the observer attached with the *default*
settings (``inject_observer(model, output_dir=...)``: the default sampling schedule) and
detaches it at the end (``remove_observer`` writes ``report.json``). At the fault's step
(before that step's forward) it calls ``at_fault(model, optimizer, lr_scheduler)``, which
runs the ground-truth probe and applies the fault.

- **plain**: ``zero_grad``, forward, loss, ``backward``, gradient norm (clipped to
  ``family.max_grad_norm`` when set), optimizer step unless the norm is not finite
  (counted as a skipped update). The observer is injected on the model before training.
- **trainer**: the observer is injected on the model before the ``Trainer`` is created;
  a ``TrainerCallback`` applies the fault in ``on_step_begin`` at the fault's
  ``global_step`` and another one records the loss that the Trainer logs at every step
  (``logging_steps=1``, ``logging_nan_inf_filter=False`` so that non-finite losses are
  kept). ``report_to=[]``, ``save_strategy="no"``, ``use_cpu=True``.
- **accelerate**: ``Accelerator(cpu=True)``; the observer is injected on the model
  *before* ``accelerator.prepare(model, optimizer, loader)`` (on the CPU, ``prepare``
  returns the model object itself); ``accelerator.backward(loss)``,
  ``accelerator.clip_grad_norm_``, the same non-finite guard as the plain loop.

Step ``k`` of every loop is training forward ``k`` (one forward per optimizer step, no
gradient accumulation, no other training forward).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchinstruments import inject_observer, remove_observer

from .models import Family

__all__ = ["AtFault", "LoopOutcome", "run_loop"]

#: ``at_fault(model, optimizer, lr_scheduler)``: probe, then apply the fault.
AtFault = Callable[[nn.Module, Any, Any], None]


@dataclass(slots=True)
class LoopOutcome:
    """What a loop returns: per-step losses (nats, NaN where not finite) and skipped steps."""

    losses: list[float] = field(default_factory=list)
    skipped_updates: int = 0


def _finite_norm(norm: torch.Tensor | float) -> bool:
    return math.isfinite(float(norm))


def run_loop(
    family: Family,
    *,
    steps: int,
    seed: int,
    output_dir: Path,
    fault_step: int | None,
    at_fault: AtFault | None,
) -> LoopOutcome:
    """Train one run of ``family`` for ``steps`` steps, observed into ``output_dir``.

    Args:
        family: the family (its ``loop`` picks the loop).
        steps: optimizer steps (= training forwards).
        seed: seed of the initialisation and of the data (examples and order).
        output_dir: the observer's ``output_dir``.
        fault_step: step before whose forward ``at_fault`` runs (None: a clean run).
        at_fault: probe and apply the fault.
    """
    if family.loop == "plain":
        return _plain(family, steps, seed, output_dir, fault_step, at_fault)
    if family.loop == "trainer":
        return _trainer(family, steps, seed, output_dir, fault_step, at_fault)
    return _accelerate(family, steps, seed, output_dir, fault_step, at_fault)


def _gradient_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    parameters = [p for p in model.parameters() if p.grad is not None]
    if max_norm is None:
        return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


def _plain(
    family: Family,
    steps: int,
    seed: int,
    output_dir: Path,
    fault_step: int | None,
    at_fault: AtFault | None,
) -> LoopOutcome:
    assert family.stream is not None, f"{family.name} has no stream"
    torch.manual_seed(seed)
    model = family.build_model()
    optimizer = family.make_optimizer(model)
    stream = family.stream(seed)
    outcome = LoopOutcome()
    inject_observer(model, output_dir=output_dir)
    try:
        model.train()
        for step in range(steps):
            if step == fault_step and at_fault is not None:
                at_fault(model, optimizer, None)
            batch = stream.next()
            optimizer.zero_grad(set_to_none=True)
            loss = family.loss(model, batch)
            loss.backward()
            if _finite_norm(_gradient_norm(model, family.max_grad_norm)):
                optimizer.step()
            else:
                outcome.skipped_updates += 1
            outcome.losses.append(loss.item())
    finally:
        remove_observer(model)
    return outcome


def _trainer(
    family: Family,
    steps: int,
    seed: int,
    output_dir: Path,
    fault_step: int | None,
    at_fault: AtFault | None,
) -> LoopOutcome:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    assert family.dataset is not None, f"{family.name} has no dataset"
    outcome = LoopOutcome()

    class ApplyFault(TrainerCallback):
        """Probes and applies the fault at the beginning of its step."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if at_fault is not None and state.global_step == fault_step:
                at_fault(kwargs["model"], kwargs["optimizer"], kwargs.get("lr_scheduler"))

    class RecordLoss(TrainerCallback):
        """Keeps the loss the Trainer logs at every step."""

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            if logs and "loss" in logs:
                outcome.losses.append(float(logs["loss"]))

    torch.manual_seed(seed)
    model = family.build_model()
    dataset = family.dataset(seed)
    inject_observer(model, output_dir=output_dir)
    try:
        with tempfile.TemporaryDirectory(prefix="real-faults-trainer-") as trainer_dir:
            arguments = TrainingArguments(
                output_dir=trainer_dir,
                max_steps=steps,
                per_device_train_batch_size=family.batch_size,
                learning_rate=family.learning_rate,
                weight_decay=family.weight_decay,
                warmup_steps=50,
                lr_scheduler_type="cosine",
                max_grad_norm=1.0,
                logging_steps=1,
                logging_nan_inf_filter=False,
                save_strategy="no",
                report_to=[],
                use_cpu=True,
                seed=seed,
                data_seed=seed,
                disable_tqdm=True,
                dataloader_num_workers=0,
            )
            trainer = Trainer(
                model=model,
                args=arguments,
                train_dataset=dataset,
                callbacks=[ApplyFault(), RecordLoss()],
            )
            trainer.remove_callback(PrinterCallback)  # it prints every step's log line
            trainer.train()
    finally:
        remove_observer(model)
    return outcome


def _accelerate(
    family: Family,
    steps: int,
    seed: int,
    output_dir: Path,
    fault_step: int | None,
    at_fault: AtFault | None,
) -> LoopOutcome:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    assert family.dataset is not None, f"{family.name} has no dataset"
    torch.manual_seed(seed)
    model = family.build_model()
    optimizer = family.make_optimizer(model)
    loader = DataLoader(
        family.dataset(seed),
        batch_size=family.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(50_000 + seed),
    )
    accelerator = Accelerator(cpu=True)
    inject_observer(model, output_dir=output_dir)
    outcome = LoopOutcome()
    try:
        prepared_model, prepared_optimizer, prepared_loader = accelerator.prepare(
            model, optimizer, loader
        )
        prepared_model.train()
        step = 0
        while step < steps:
            for batch in prepared_loader:
                if step == steps:
                    break
                if step == fault_step and at_fault is not None:
                    at_fault(accelerator.unwrap_model(prepared_model), prepared_optimizer, None)
                prepared_optimizer.zero_grad(set_to_none=True)
                loss = family.loss(prepared_model, batch)
                accelerator.backward(loss)
                max_norm = family.max_grad_norm if family.max_grad_norm is not None else math.inf
                norm = accelerator.clip_grad_norm_(prepared_model.parameters(), max_norm)
                if norm is None or _finite_norm(norm):
                    prepared_optimizer.step()
                else:
                    outcome.skipped_updates += 1
                outcome.losses.append(loss.item())
                step += 1
    finally:
        remove_observer(model)
    return outcome
