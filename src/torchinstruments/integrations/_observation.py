"""What both framework callbacks keep between training start and end: the observer's
settings, and the handle of the observer they injected."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from torch import nn

from ..api import (
    ObserverHandle,
    _as_patterns,
    _check_output_dir,
    _checked_sinks,
    _typed,
    inject_observer,
)
from ..config import ReportConfig
from ..errors import ConfigError
from ..sampling import SamplingPolicy, resolve_sampling
from ..sinks import Sink


class Observation:
    """The settings of :func:`~torchinstruments.inject_observer` that a callback takes,
    the observer's handle while training runs (``handle``, else None), and the start
    and end of the observation.

    Args: as for :func:`~torchinstruments.inject_observer`, checked here as it checks
    them (a mistake shows when the callback is made, not when training starts);
    ``sinks`` are the caller's own, always added; ``caller`` names the callback in
    errors.

    Raises:
        ConfigError: an argument that ``inject_observer`` would refuse, with the message
            it would give, naming ``caller``.
    """

    def __init__(
        self,
        output_dir: str | Path,
        sampling: int | SamplingPolicy | None,
        report_config: ReportConfig | None,
        include: str | Sequence[str] | None,
        exclude: str | Sequence[str] | None,
        sinks: Iterable[Sink],
        caller: str,
    ) -> None:
        try:
            _check_output_dir(output_dir)
            resolve_sampling(sampling)
            _typed("report_config", report_config, ReportConfig)
            _as_patterns("include", include)
            _as_patterns("exclude", exclude)
            sink_list = _checked_sinks(sinks)
        except ConfigError as error:
            message = str(error).removeprefix("inject_observer: ")
            raise ConfigError(f"{caller}: {message}") from None
        self.output_dir = Path(output_dir)
        self.sampling = sampling
        self.report_config = report_config
        self.include = include
        self.exclude = exclude
        self.sinks = sink_list
        self.handle: ObserverHandle | None = None

    def start(self, model: nn.Module, extra_sinks: Sequence[Sink] = ()) -> None:
        """Inject the observer into ``model`` with the caller's sinks and ``extra_sinks``."""
        self.handle = inject_observer(
            model,
            output_dir=self.output_dir,
            sampling=self.sampling,
            report_config=self.report_config,
            include=self.include,
            exclude=self.exclude,
            sinks=[*self.sinks, *extra_sinks],
        )

    def set_step(self, step: int) -> None:
        """The sinks' step from now on (see :meth:`ObserverHandle.set_step`)."""
        if self.handle is not None:
            self.handle.set_step(step)

    def stop(self) -> None:
        """Remove the observer (writing the final report); nothing if none is injected."""
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()
