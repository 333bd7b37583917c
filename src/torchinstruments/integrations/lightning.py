"""A PyTorch Lightning ``Callback`` that observes the ``LightningModule`` during ``fit``.

Needs ``lightning`` (``pip install "torchinstruments[lightning]"``)::

    from torchinstruments.integrations.lightning import TorchInstrumentsCallback

    trainer = Trainer(callbacks=[TorchInstrumentsCallback("stats")])
    trainer.fit(model)  # stats/report.json is written before fit returns

See ``docs/lightning.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as error:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "torchinstruments.integrations.lightning needs PyTorch Lightning (the lightning "
        'package): pip install "torchinstruments[lightning]"'
    ) from error

from ..api import ObserverHandle
from ..config import ReportConfig
from ..errors import ConfigError
from ..sampling import SamplingPolicy
from ..sinks import MetricLoggerSink, Sink, TensorBoardSink, _metrics_argument
from ._observation import Observation

__all__ = ["TorchInstrumentsCallback"]


class TorchInstrumentsCallback(Callback):
    """Observes the ``LightningModule`` from ``on_fit_start`` to ``on_fit_end``.

    - ``on_fit_start``: the strategy has moved the model to its device and the loggers
      exist; :func:`~torchinstruments.inject_observer` attaches to the ``LightningModule``
      (the root), with a dashboard sink per trainer logger (``log_to_loggers``).
    - ``on_train_batch_start``: ``trainer.global_step`` (optimizer steps taken so far)
      becomes the sinks' step (:meth:`~torchinstruments.ObserverHandle.set_step`), the
      step at which Lightning logs that batch's ``self.log(..., on_step=True)`` values.
    - ``on_fit_end`` and ``on_exception``: the observer is removed, which writes the
      final report and flushes the last telemetry into loggers that are still open.

    Training forwards are those that ``training_step`` makes through ``self(x)`` (or any
    call of an observed module); validation forwards, in ``eval()`` mode under
    ``no_grad``, are not mixed into the training series.

    Args:
        output_dir: where ``report.json``, ``index.md`` and ``series.json`` go. Default
            ``"stats"``.
        sampling: as for :func:`~torchinstruments.inject_observer` (``None``: the default
            schedule; ``1``: every training forward).
        report_config: report limits; default ``ReportConfig()``.
        include: module name pattern(s) to observe; default every leaf and the root.
        exclude: module name pattern(s) not to observe.
        metrics: metrics forwarded to the loggers. Default ``("rms",)``.
        log_to_loggers: forward per-sample scalars to every logger of the trainer: a
            ``TensorBoardSink`` for a logger whose ``experiment`` is a ``SummaryWriter``
            (``TensorBoardLogger``), a ``MetricLoggerSink`` through ``log_metrics`` for
            the others (CSV, Weights & Biases, MLflow). Default True.
        sinks: further sinks, as for :func:`~torchinstruments.inject_observer`.

    Attributes:
        handle: the :class:`~torchinstruments.ObserverHandle` while ``fit`` runs, else None.

    Raises:
        ConfigError: ``log_to_loggers`` is not a bool, ``metrics`` is a str (not a
            sequence of names) or names an unknown metric, or ``output_dir``,
            ``sampling``, ``report_config``, ``include`` or ``exclude`` is one that
            :func:`~torchinstruments.inject_observer` refuses (checked here); a
            selection that matches no module at ``on_fit_start``.
    """

    def __init__(
        self,
        output_dir: str | Path = "stats",
        *,
        sampling: int | SamplingPolicy | None = None,
        report_config: ReportConfig | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        metrics: Sequence[str] = ("rms",),
        log_to_loggers: bool = True,
        sinks: Iterable[Sink] = (),
    ) -> None:
        if not isinstance(log_to_loggers, bool):
            raise ConfigError(
                f"TorchInstrumentsCallback: log_to_loggers must be a bool, got {log_to_loggers!r}"
            )
        if isinstance(metrics, str):
            raise ConfigError(
                "TorchInstrumentsCallback: metrics must be a sequence of metric names, as "
                f"('rms',), got the str {metrics!r}"
            )
        self._observation = Observation(
            output_dir, sampling, report_config, include, exclude, sinks, type(self).__name__
        )
        self.metrics = _metrics_argument(type(self).__name__, metrics)
        self.log_to_loggers = log_to_loggers

    @property
    def handle(self) -> ObserverHandle | None:
        """The observer's handle while ``fit`` runs, else None."""
        return self._observation.handle

    def _logger_sinks(self, trainer: Trainer) -> list[Sink]:
        sinks: list[Sink] = []
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if callable(getattr(experiment, "add_scalar", None)):
                sinks.append(TensorBoardSink(experiment, metrics=self.metrics))
            elif callable(getattr(logger, "log_metrics", None)):
                # Lightning loggers take any step order (WandbLogger logs the step as
                # trainer/global_step): batched delivery is enough.
                sinks.append(MetricLoggerSink(logger, metrics=self.metrics, prompt=False))
        return sinks

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._observation.start(
            pl_module, self._logger_sinks(trainer) if self.log_to_loggers else ()
        )

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._observation.set_step(trainer.global_step)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._observation.stop()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._observation.stop()  # a failed run still leaves its report

    def __repr__(self) -> str:
        return f"TorchInstrumentsCallback(output_dir={str(self._observation.output_dir)!r})"
