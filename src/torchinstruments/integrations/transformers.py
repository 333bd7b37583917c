"""A Hugging Face ``TrainerCallback`` that observes the model while ``Trainer`` trains it.

Needs ``transformers`` (``pip install "torchinstruments[transformers]"``)::

    from torchinstruments.integrations.transformers import TorchInstrumentsCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[TorchInstrumentsCallback("stats")])
    trainer.train()  # stats/report.json is written before train returns

See ``docs/transformers.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as error:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "torchinstruments.integrations.transformers needs transformers: "
        'pip install "torchinstruments[transformers]"'
    ) from error

from torch import nn

from ..api import ObserverHandle
from ..config import ReportConfig
from ..errors import ConfigError
from ..sampling import SamplingPolicy
from ..sinks import Sink
from ._observation import Observation

__all__ = ["TorchInstrumentsCallback"]


class TorchInstrumentsCallback(TrainerCallback):
    """Observes the model from ``on_train_begin`` to ``on_train_end``.

    - ``on_train_begin``: :func:`~torchinstruments.inject_observer` attaches to the model
      the ``Trainer`` passes (a ``DistributedDataParallel`` wrapper is seen through, so
      names carry no ``module.`` prefix).
    - ``on_step_begin``: ``TrainerState.global_step + 1`` becomes the sinks' step
      (:meth:`~torchinstruments.ObserverHandle.set_step`): the value ``global_step``
      has when ``Trainer`` logs that optimizer step's loss, so the telemetry of every
      forward of a step (gradient accumulation included) sits at the step of its loss.
    - ``on_train_end``: the observer is removed, which writes the final report.

    Gradient checkpointing is fine: recomputed forwards inside the backward are not new
    samples. Evaluation forwards (``eval()`` mode, ``no_grad``) are not mixed into the
    training series.

    Args:
        output_dir: where ``report.json``, ``index.md`` and ``series.json`` go. Default
            ``"stats"``.
        sampling: as for :func:`~torchinstruments.inject_observer` (``None``: the default
            schedule; ``1``: every training forward).
        report_config: report limits; default ``ReportConfig()``.
        include: module name pattern(s) to observe; default every leaf and the root.
        exclude: module name pattern(s) not to observe.
        sinks: dashboard or other sinks, as for :func:`~torchinstruments.inject_observer`
            (``MetricLoggerSink(wandb.log)``, ``TensorBoardSink(writer)``).

    Attributes:
        handle: the :class:`~torchinstruments.ObserverHandle` while training runs, else
            None.

    Raises:
        ConfigError: ``output_dir``, ``sampling``, ``report_config``, ``include`` or
            ``exclude`` is one that :func:`~torchinstruments.inject_observer` refuses
            (checked here); from ``on_train_begin``, when ``Trainer`` passes no model,
            or the selection matches no module.
    """

    def __init__(
        self,
        output_dir: str | Path = "stats",
        *,
        sampling: int | SamplingPolicy | None = None,
        report_config: ReportConfig | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        sinks: Iterable[Sink] = (),
    ) -> None:
        self._observation = Observation(
            output_dir, sampling, report_config, include, exclude, sinks, type(self).__name__
        )

    @property
    def handle(self) -> ObserverHandle | None:
        """The observer's handle while training runs, else None."""
        return self._observation.handle

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(
                "TorchInstrumentsCallback.on_train_begin: expected the Trainer's model "
                f"(an nn.Module), got {type(model).__name__}"
            )
        self._observation.start(model)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._observation.set_step(state.global_step + 1)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._observation.stop()

    def __repr__(self) -> str:
        return f"TorchInstrumentsCallback(output_dir={str(self._observation.output_dir)!r})"
