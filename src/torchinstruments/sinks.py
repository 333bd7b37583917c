"""⑥ sinks: where reports go.

A sink has three methods, in the order of TensorBoard's ``SummaryWriter``: ``write``
takes a finished report dict, ``flush`` pushes anything buffered, ``close`` releases
resources and may be called twice. Sinks work as context managers.

:class:`DirectorySink` owns every file write of the library: ``report.json`` (the exact
bytes whose size the report builder bounded) and ``index.md``, each replaced atomically,
so a run killed at any moment leaves the last complete report.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

from ._jsonio import atomic_write
from ._series_file import series_file_bytes
from .report import dumps_report, render_markdown

__all__ = [
    "DirectorySink",
    "MemorySink",
    "MetricLoggerSink",
    "ScalarSink",
    "Sink",
    "TensorBoardSink",
    "scalar_tag",
]


@runtime_checkable
class Sink(Protocol):
    """Receives finished reports. ``close`` must tolerate a second call."""

    def write(self, report: dict[str, Any]) -> None:
        """Take one report (a JSON-safe dict, see docs/report.md)."""
        ...

    def flush(self) -> None:
        """Push anything buffered."""
        ...

    def close(self) -> None:
        """Release resources; a second call does nothing."""
        ...


@runtime_checkable
class ScalarSink(Protocol):
    """Receives transient per-sample measurements, in host batches.

    ``write_scalars`` gets ``(tag, value, step)`` triples, in ``SummaryWriter``
    argument order, once per flush (never one call per value). ``metrics`` names the
    metrics it wants (``"rms"``, ``"nonfinite_fraction"``, ...).

    The step lines up with the caller's own metrics: the caller's step when one was
    given (``ObserverHandle.set_step``, which the Lightning and Transformers
    integrations call with the trainer's ``global_step``), else the 0-based index of the
    sample's training forward (the optimizer step when there is one forward per step).
    A sink may also carry ``prompt = True``: each sample then reaches it by the start of
    the next training forward, for loggers that refuse a step below their latest
    (``wandb.log``); otherwise flushes come every 128 training forwards.
    """

    metrics: tuple[str, ...]

    def write_scalars(self, scalars: Sequence[tuple[str, float, int]]) -> None:
        """Take a batch of ``(tag, value, step)`` triples."""
        ...


def scalar_tag(module: str, call_index: int, signal: str, tensor_path: str, metric: str) -> str:
    """``torchinstruments/<module>/<signal>/<metric>``, with the call and tensor path
    added only where they are not the usual ``0`` and ``output``.

    Example:
        >>> scalar_tag("blocks.2.fc1", 0, "activation", "output", "rms")
        'torchinstruments/blocks.2.fc1/activation/rms'
        >>> scalar_tag("", 1, "grad_output", "output[0]", "rms")
        'torchinstruments/<root>@call1/grad_output[0]/rms'
    """
    name = module if module else "<root>"
    if call_index:
        name += f"@call{call_index}"
    signal_part = signal + (tensor_path[len("output") :] if tensor_path != "output" else "")
    return f"torchinstruments/{name}/{signal_part}/{metric}"


def _metrics_argument(owner: str, metrics: Iterable[str]) -> tuple[str, ...]:
    from .errors import ConfigError
    from .reduce import METRICS
    from .series import RMS_TO_ROOT

    chosen = tuple(metrics) if not isinstance(metrics, str) else (metrics,)
    known = (*METRICS, RMS_TO_ROOT)
    unknown = sorted(set(chosen) - set(known))
    if not chosen or unknown:
        raise ConfigError(
            f"{owner}: metrics must be a non-empty selection of {known}, got {chosen!r}"
        )
    return chosen


class _SinkBase:
    def flush(self) -> None:
        """Nothing is buffered."""

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def atomic_write_together(files: Sequence[tuple[Path, bytes]]) -> list[OSError]:
    """Write several files atomically, staging all before replacing any.

    Each file's temporary copy is written in full first; then the files are replaced
    in order, one right after the other. A file whose copy cannot be written (or
    replaced) keeps its previous content, and the others are written all the same.

    Returns:
        The errors met, one per file that was not written.
    """
    errors: list[OSError] = []
    staged: list[tuple[str, Path]] = []
    for path, data in files:
        temporary = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(handle, "wb") as stream:
                stream.write(data)
            os.chmod(temporary, 0o644)  # mkstemp creates 0600; reports are for reading
            staged.append((temporary, path))
        except OSError as error:
            errors.append(error)
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
    for temporary, path in staged:
        try:
            os.replace(temporary, path)
        except OSError as error:
            errors.append(error)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    return errors


#: Files whose temporary copies :func:`remove_stale_temporaries` may delete.
_OWN_FILES = ("report.json", "index.md", "series.json", "details.json")


def remove_stale_temporaries(directory: Path) -> int:
    """Delete the temporary copies (``.report.json.<random>`` and the like) that an
    earlier run killed in the middle of a write left in ``directory``; return how many.

    Each killed write can leave one per file, and on a nearly full disk they take the
    space the next write needs. Only names that :func:`atomic_write_together` makes for
    this library's own files are touched, and only regular files.
    """
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        own = any(
            name.startswith(f".{base}.") and len(name) == len(base) + 10 for base in _OWN_FILES
        )
        if own and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed += 1
    return removed


class DirectorySink(_SinkBase):
    """Writes ``report.json`` and ``index.md`` into a directory, atomically.

    Args:
        output_dir: directory to write into; created on first write.
        write_full_details: also write ``details.json``: every live series with its full
            tracker state (EMAs, CUSUM, change points, history). For local debugging:
            it is not bounded (about 2 kB per series and metric) and not meant for an
            LLM. Default False. Pass such a sink as ``inject_observer(..., sinks=[...])``
            with the same directory as ``output_dir``; it then replaces the default one.
        plots: also write ``plots/*.png``, one per event, linked from
            ``index.md`` (needs the ``plots`` extra, matplotlib). Default False.
        write_series_summary: also write ``series.json``, a compact per-series summary
            bounded by ``ReportConfig.series_summary_max_bytes``, which
            ``compare_runs`` reads. Default True.

    Raises:
        OSError: from :meth:`write`, when the directory cannot be written. The observer
            catches it, warns once, counts it in the report and retries at the next write.

    Example:
        >>> import tempfile, json, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> DirectorySink(folder).path == folder.resolve()
        True
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        write_full_details: bool = False,
        plots: bool = False,
        write_series_summary: bool = True,
    ) -> None:
        from .errors import ConfigError

        for name, value in (
            ("write_full_details", write_full_details),
            ("plots", plots),
            ("write_series_summary", write_series_summary),
        ):
            if not isinstance(value, bool):
                raise ConfigError(f"DirectorySink: {name} must be a bool, got {value!r}")
        if plots:
            from .plots import require_matplotlib

            require_matplotlib()
        self.path = Path(output_dir)
        self._cleaned = False
        self.write_full_details = write_full_details
        self.plots = plots
        self.write_series_summary = write_series_summary

    @property
    def details_path(self) -> Path:
        """Where ``details.json`` is written (with ``write_full_details=True``)."""
        return self.path / "details.json"

    @property
    def series_path(self) -> Path:
        """Where ``series.json`` (the per-series summary for comparisons) is written."""
        return self.path / "series.json"

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``series.json`` atomically (compact JSON, UTF-8)."""
        atomic_write(self.series_path, series_file_bytes(summary))

    def write_details(self, details: dict[str, Any]) -> None:
        """Write ``details.json`` atomically (compact JSON, UTF-8)."""
        data = json.dumps(details, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        atomic_write(self.details_path, data.encode())

    @property
    def report_path(self) -> Path:
        """Where ``report.json`` is written."""
        return self.path / "report.json"

    @property
    def index_path(self) -> Path:
        """Where ``index.md`` is written."""
        return self.path / "index.md"

    def write(self, report: dict[str, Any]) -> None:
        """Write ``report.json`` and ``index.md`` (and the pictures, with ``plots``).

        Each file is written on its own: one that fails does not stop the others, and
        the first error is raised once all were tried. Pictures are written first;
        both texts are then staged in full and the two files replaced one right after
        the other, ``report.json`` first, so that ``index.md`` renders the same report
        as ``report.json`` except after a kill in the instant between the two
        replacements, when it is an earlier one. Both state the report's
        ``run.report_number``, so a reader can tell.
        """
        failures: list[Exception] = []
        shown = report
        if self.plots:
            from .plots import write_plots

            # Pictures are linked from index.md only (report.json stays as bounded).
            shown = {**report, "events": [dict(e) for e in report.get("events", [])]}
            write_plots(self.path, shown, atomic_write, failures)
        texts: list[tuple[Path, bytes]] = []
        for path, render in (
            (self.report_path, lambda: dumps_report(report)),
            (self.index_path, lambda: render_markdown(shown).encode()),
        ):
            try:
                texts.append((path, render()))
            except Exception as error:
                failures.append(error)
        if not self._cleaned:
            self._cleaned = True
            remove_stale_temporaries(self.path)
        errors = atomic_write_together(texts)
        full = any(error.errno == errno.ENOSPC for error in errors)
        # On a full disk, what earlier killed writes left may be what is missing.
        if full and remove_stale_temporaries(self.path):
            errors = atomic_write_together(texts)
        failures.extend(errors)
        if failures:
            raise failures[0]

    def __repr__(self) -> str:
        details = ", write_full_details=True" if self.write_full_details else ""
        plots = ", plots=True" if self.plots else ""
        return f"DirectorySink({str(self.path)!r}{details}{plots})"


class MemorySink(_SinkBase):
    """Keeps every report it receives in ``reports`` (a test double).

    Example:
        >>> sink = MemorySink()
        >>> sink.write({"schema": "x"})
        >>> len(sink.reports)
        1
    """

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.closed = False

    def write(self, report: dict[str, Any]) -> None:
        self.reports.append(report)

    def close(self) -> None:
        self.closed = True

    @property
    def latest(self) -> dict[str, Any] | None:
        """The last report received, or None."""
        return self.reports[-1] if self.reports else None


class TensorBoardSink(_SinkBase):
    """Forwards per-sample scalars to a ``SummaryWriter`` that the caller owns.

    Tags are ``torchinstruments/<module>/<signal>/<metric>`` (see :func:`scalar_tag`) and
    ``global_step`` is the step of :class:`ScalarSink`: the caller's step when given
    (``ObserverHandle.set_step``), else the sample's training-forward index (0-based),
    so the telemetry sits beside the caller's own curves. The writer is flushed by
    :meth:`flush` and never closed by us.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (anything with
            ``add_scalar(tag, value, global_step)``).
        metrics: which metrics to forward. Default ``("rms",)``.
        prompt: hand each sample over by the start of the next training forward
            instead of every 128 forwards. Default False: event files take any step order.

    Raises:
        ConfigError: ``writer`` has no ``add_scalar``, ``metrics`` names an unknown metric,
            or ``prompt`` is not a bool.
    """

    def __init__(
        self, writer: Any, *, metrics: Iterable[str] = ("rms",), prompt: bool = False
    ) -> None:
        from .errors import ConfigError

        if not callable(getattr(writer, "add_scalar", None)):
            raise ConfigError(
                "TensorBoardSink: writer must have add_scalar(tag, value, global_step), "
                f"got {type(writer).__name__}"
            )
        if not isinstance(prompt, bool):
            raise ConfigError(f"TensorBoardSink: prompt must be a bool, got {prompt!r}")
        self.writer = writer
        self.metrics = _metrics_argument("TensorBoardSink", metrics)
        self.prompt = prompt

    def write(self, report: dict[str, Any]) -> None:
        """Reports are not forwarded; TensorBoard gets the per-sample scalars."""

    def write_scalars(self, scalars: Sequence[tuple[str, float, int]]) -> None:
        add = self.writer.add_scalar
        for tag, value, step in scalars:
            add(tag, value, step)

    def write_histogram(
        self, tag: str, edges: Sequence[float], counts: Sequence[float], step: int
    ) -> None:
        """One sample's histogram with fixed ``edges`` (``bins + 1``) and ``counts``
        (``bins`` in range, then underflow, overflow, non-finite), pre-binned, at
        ``step`` (as for scalars)."""
        add_raw = getattr(self.writer, "add_histogram_raw", None)
        if not callable(add_raw):
            return
        bins = len(edges) - 1
        inside = list(counts[:bins])
        total = sum(inside)
        if total <= 0:
            return
        centres = [(edges[i] + edges[i + 1]) / 2 for i in range(bins)]
        add_raw(
            tag,
            min=edges[0],
            max=edges[-1],
            num=total,
            sum=sum(c * n for c, n in zip(centres, inside, strict=True)),
            sum_squares=sum(c * c * n for c, n in zip(centres, inside, strict=True)),
            bucket_limits=list(edges[1:]),
            bucket_counts=inside,
            global_step=step,
        )

    def flush(self) -> None:
        flush = getattr(self.writer, "flush", None)
        if callable(flush):
            flush()

    def __repr__(self) -> str:
        return f"TensorBoardSink({type(self.writer).__name__}, metrics={self.metrics!r})"


class MetricLoggerSink(_SinkBase):
    """Forwards per-sample scalars to a metric logger that the caller owns.

    Accepts an object with ``log_metrics(metrics: dict[str, float], step: int)`` (the
    Lightning logger interface) or a plain callable called as ``fn(metrics, step=step)``
    (``wandb.log``, ``mlflow.log_metrics``). One call per step, with every selected
    series of the samples at that step (where several samples share a caller step, the
    last one's value per tag). The step is that of :class:`ScalarSink`: the caller's step
    when given (``ObserverHandle.set_step``), else the sample's training-forward index
    (0-based), so a loop that logs its loss at ``step=i`` for its ``i``-th training
    forward gets the telemetry at the same ``i``. The logger is never closed by us.

    ``wandb.log`` drops a step below the latest one it was given, so by default
    (``prompt=True``) each sample is handed over by the start of the next training
    forward: after the caller logged that step, before it logs a later one. That costs
    one flush per sample (on CUDA, one wait for the sample's statistics); with the
    default sampling schedule, a few in the first thousand forwards and then one in 256.

    Args:
        logger: the logger or callable.
        metrics: which metrics to forward. Default ``("rms",)``.
        prompt: deliver each sample by the next training forward. Default True; False
            batches them every 128 training forwards (fine for loggers that take any
            step order: TensorBoard, MLflow, CSV).

    Raises:
        ConfigError: ``logger`` is neither, ``metrics`` names an unknown metric, or
            ``prompt`` is not a bool.
    """

    def __init__(
        self, logger: Any, *, metrics: Iterable[str] = ("rms",), prompt: bool = True
    ) -> None:
        from .errors import ConfigError

        if not isinstance(prompt, bool):
            raise ConfigError(f"MetricLoggerSink: prompt must be a bool, got {prompt!r}")
        self.prompt = prompt

        log_metrics = getattr(logger, "log_metrics", None)
        if callable(log_metrics):
            self._log: Callable[[dict[str, float], int], None] = lambda values, step: log_metrics(
                values, step
            )
        elif callable(logger):
            self._log = lambda values, step: logger(values, step=step)
        else:
            raise ConfigError(
                "MetricLoggerSink: logger must have log_metrics(metrics, step) or be "
                f"callable, got {type(logger).__name__}"
            )
        self.logger = logger
        self.metrics = _metrics_argument("MetricLoggerSink", metrics)

    def write(self, report: dict[str, Any]) -> None:
        """Reports are not forwarded; the logger gets the per-sample scalars."""

    def write_scalars(self, scalars: Sequence[tuple[str, float, int]]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for tag, value, step in scalars:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            self._log(by_step[step], step)

    def __repr__(self) -> str:
        return f"MetricLoggerSink({type(self.logger).__name__}, metrics={self.metrics!r})"
