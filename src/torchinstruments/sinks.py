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
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

from ._generations import MODE_LINKED, MODE_REPLACE, symlinks_work
from ._jsonio import atomic_write
from ._report_files import ReportFiles, write_new
from ._series_file import series_file_bytes
from .report import dumps_report, render_markdown

#: Written beside the report files when a report could not be put in place (the files
#: there are an earlier report, or none), removed when the next one is
#: (:meth:`DirectorySink.note_failed_write`).
WRITE_FAILED_NAME = "WRITE_FAILED.txt"

__all__ = [
    "WRITE_FAILED_NAME",
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

    A path inside the output (``output[0]``, ``output.logits``) follows the signal with
    the leading ``output`` dropped; any other path (``attention_logits``) is a level of
    its own between the signal and the metric. A ``/`` inside a module name or a tensor
    path (a dict key such as ``output['a/b']``) is written ``%2F`` (and ``%`` as ``%25``),
    so that every tag has the same levels: TensorBoard and wandb group tags by ``/``.

    Example:
        >>> scalar_tag("blocks.2.fc1", 0, "activation", "output", "rms")
        'torchinstruments/blocks.2.fc1/activation/rms'
        >>> scalar_tag("", 1, "grad_output", "output[0]", "rms")
        'torchinstruments/<root>@call1/grad_output[0]/rms'
        >>> scalar_tag("h.0.attn", 0, "activation", "attention_logits", "rms")
        'torchinstruments/h.0.attn/activation/attention_logits/rms'
        >>> scalar_tag("head", 0, "activation", "output['a/b']", "rms")
        "torchinstruments/head/activation['a%2Fb']/rms"
    """
    name = _tag_level(module) if module else "<root>"
    if call_index:
        name += f"@call{call_index}"
    if tensor_path == "output":
        signal_part = signal
    elif tensor_path.startswith(("output[", "output.")):
        signal_part = signal + _tag_level(tensor_path[len("output") :])
    else:
        signal_part = f"{signal}/{_tag_level(tensor_path)}"
    return f"torchinstruments/{name}/{signal_part}/{metric}"


def _tag_level(text: str) -> str:
    """``text`` with no ``/``: ``%`` and ``/`` percent-encoded (``%25``, ``%2F``)."""
    return text.replace("%", "%25").replace("/", "%2F") if "/" in text or "%" in text else text


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


class DirectorySink(_SinkBase):
    """Writes ``report.json`` and ``index.md`` (and ``series.json``, ``details.json``,
    ``plots/``) into a directory, all switched in at once.

    Where the file system has symbolic links, each report's files go into a fresh
    directory ``.generation-NNNNNN`` in ``output_dir``, and one ``rename`` of the link
    ``.current`` switches them in; ``report.json``, ``index.md``, ``series.json``,
    ``details.json`` and ``plots`` are relative links through ``.current`` (see
    :mod:`torchinstruments._generations`), so a run killed at any moment leaves the
    files of one complete report. Elsewhere (tried once, at the first write: Windows
    without the privilege, some network and FUSE file systems) each file is replaced on
    its own, and a kill between two replacements can leave ``index.md`` one report
    behind ``report.json``. :attr:`write_mode` says which (the report's
    ``coverage.file_write_mode``).

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
        self._files = ReportFiles(Path(output_dir))
        self.write_full_details = write_full_details
        self.plots = plots
        self.write_series_summary = write_series_summary
        self._mode: str | None = None
        #: ``(run.report_number, generated_at)`` of the last report put in place.
        self._last_written: tuple[object, object] | None = None

    @property
    def path(self) -> Path:
        """The directory written into (``output_dir``)."""
        return self._files.path

    @path.setter
    def path(self, path: Path) -> None:
        self._files.path = path

    @property
    def write_mode(self) -> str | None:
        """``"linked_generations"`` (the files of a report are switched in through the
        link ``.current``), ``"replace_each"`` (no symbolic links there: each file is
        replaced on its own), or None before the first write decided it."""
        return self._mode

    def choose_write_mode(self) -> str:
        """Decide :attr:`write_mode` (once: creates the directory and tries a link).

        Raises:
            OSError: the directory cannot be created.
        """
        if self._mode is None:
            self.path.mkdir(parents=True, exist_ok=True)
            self._mode = MODE_LINKED if symlinks_work(self.path) else MODE_REPLACE
        return self._mode

    @property
    def details_path(self) -> Path:
        """Where ``details.json`` is written (with ``write_full_details=True``)."""
        return self.path / "details.json"

    @property
    def series_path(self) -> Path:
        """Where ``series.json`` (the per-series summary for comparisons) is written."""
        return self.path / "series.json"

    @property
    def report_path(self) -> Path:
        """Where ``report.json`` is written."""
        return self.path / "report.json"

    @property
    def index_path(self) -> Path:
        """Where ``index.md`` is written."""
        return self.path / "index.md"

    # ------------------------------------------------------------------ staleness
    @property
    def failed_write_path(self) -> Path:
        """Where :meth:`note_failed_write` says that the report here is not the latest
        (``WRITE_FAILED.txt``)."""
        return self.path / WRITE_FAILED_NAME

    @property
    def written_once(self) -> bool:
        """True once a report of this run was put in place here."""
        return self._last_written is not None

    def note_failed_write(self, report: dict[str, Any], error: BaseException) -> None:
        """Say beside the files that ``report`` could not be put in place: the report
        there is an earlier one (named by number and time), or there is none yet.

        Best effort (a few hundred bytes written directly, which a nearly full disk
        may still take where a report does not); errors are ignored. The observer
        calls it after a failed write; :meth:`note_written` removes the file.
        """
        number, generated = _report_identity(report)
        shown = self._last_written
        kept = (
            f"report.json and index.md here are still report {shown[0]} of this run, "
            f"generated {shown[1]}."
            if shown is not None
            else "No report of this run has been written here yet; files here, if any, "
            "are from an earlier run."
        )
        text = (
            f"Report {number} of this run (generated {generated}) could "
            f"not be written here: {str(error)[:500]}\n{kept}\nThe observer retries at "
            "each rewrite and removes this file once a report is written.\n"
        )
        with contextlib.suppress(OSError):
            self.failed_write_path.write_text(text, encoding="utf-8")

    def note_written(self, report: dict[str, Any]) -> None:
        """Record that ``report`` was put in place, and remove the file of
        :meth:`note_failed_write` if there is one."""
        self._last_written = _report_identity(report)
        path = self.failed_write_path
        with contextlib.suppress(OSError):
            if path.is_file():  # (a stat; nothing is removed when nothing failed)
                path.unlink()

    # ------------------------------------------------------------------ one generation
    def begin(self) -> None:
        """Gather the next :meth:`write`, :meth:`write_summary` and :meth:`write_details`
        into one generation, switched in by :meth:`commit` (the observer calls both
        around each report). Without it each of those methods switches in its own
        generation, carrying the other files of the current one over. A generation
        begun and never committed (a write interrupted by an exception) is deleted here.
        """
        self._files.begin()

    def commit(self) -> None:
        """Switch in the generation begun by :meth:`begin`; nothing if none was written.

        A generation into which no file could be written is deleted, not switched in.
        Files the generation lacks are carried over from the current one (hard links),
        only those this sink wrote earlier (never an earlier run's): ``series.json`` and
        ``details.json`` each on its own, ``report.json``, ``index.md`` and ``plots/``
        together, and only when :meth:`write` did not write them (so ``index.md`` never
        comes from another report than ``report.json``). A visible link whose file the
        new generation lacks is removed after the switch. The previous generation is
        deleted after the switch. In the ``replace_each`` mode there is nothing to do.

        Raises:
            OSError: the switch failed (the current generation stays; on a full disk,
                after one retry once stale temporaries were removed).
        """
        self._files.commit()

    # ------------------------------------------------------------------ the files
    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``series.json`` (compact JSON, UTF-8)."""
        data = series_file_bytes(summary)
        if self.choose_write_mode() == MODE_REPLACE:
            atomic_write(self.series_path, data)
        else:
            self._files.write_part("series.json", data)

    def write_details(self, details: dict[str, Any]) -> None:
        """Write ``details.json`` (compact JSON, UTF-8)."""
        data = json.dumps(details, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        if self.choose_write_mode() == MODE_REPLACE:
            atomic_write(self.details_path, data.encode())
        else:
            self._files.write_part("details.json", data.encode())

    def write(self, report: dict[str, Any]) -> None:
        """Write ``report.json`` and ``index.md`` (and the pictures, with ``plots``).

        Each file is written on its own: one that fails does not stop the others, and
        the first error is raised once all were tried. Pictures are written first (one
        that fails is left out, and its event shows no picture). In the
        ``linked_generations`` mode the files go into the generation, switched in here
        or, after :meth:`begin`, by :meth:`commit`; a file that cannot be written (an
        ``OSError``) keeps ``report.json``, ``index.md`` and ``plots/`` all at the
        previous report. In the ``replace_each`` mode both texts are staged in full and
        the two files replaced one right after the other, ``report.json`` first, so that
        ``index.md`` renders the same report as ``report.json`` except after a kill
        between the two replacements, when it is an earlier one. Both state the report's
        ``run.report_number``, so a reader can tell.
        """
        failures: list[Exception] = []
        if self.choose_write_mode() == MODE_LINKED:
            self._files.within(lambda: self._write_generation(report, failures))
        else:
            failures.extend(self._files.replace_each(self._texts(report, self.path, failures)))
        if failures:
            raise failures[0]

    def _texts(
        self, report: dict[str, Any], directory: Path, failures: list[Exception]
    ) -> list[tuple[Path, bytes]]:
        shown = report
        if self.plots:
            from .plots import write_plots

            # Pictures are linked from index.md only (report.json stays as bounded).
            shown = {**report, "events": [dict(e) for e in report.get("events", [])]}
            write = atomic_write if directory == self.path else write_new
            write_plots(directory, shown, write, failures)
        texts: list[tuple[Path, bytes]] = []
        for name, render in (
            ("report.json", lambda: dumps_report(report)),
            ("index.md", lambda: render_markdown(shown).encode()),
        ):
            try:
                texts.append((directory / name, render()))
            except Exception as error:
                failures.append(error)
        return texts

    def _write_generation(self, report: dict[str, Any], failures: list[Exception]) -> None:
        generation = self._files.generation()
        if self.plots:
            (generation / "plots").mkdir(exist_ok=True)
        texts = self._texts(report, generation, failures)
        self._files.write_report_texts(texts, self.plots, failures)

    def __repr__(self) -> str:
        details = ", write_full_details=True" if self.write_full_details else ""
        plots = ", plots=True" if self.plots else ""
        return f"DirectorySink({str(self.path)!r}{details}{plots})"


def _report_identity(report: dict[str, Any]) -> tuple[object, object]:
    """``(run.report_number, generated_at)`` of a report (None where absent)."""
    run = report.get("run")
    return (run.get("report_number") if isinstance(run, dict) else None), report.get("generated_at")


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
