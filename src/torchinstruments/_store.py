"""The series store: the per-series trackers fed from the host batches, histograms,
loss scales, and the values handed to dashboard sinks.

    statistics buffer --(records, host rows)--> SeriesStore.process --> trackers
                                                                    --> scalar sinks

See ``docs/architecture.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

from torch import Tensor

from ._records import (
    ROOT_INDEX,
    CompiledRows,
    CompiledStatistics,
    HistogramCounts,
    LossScale,
    Record,
    SentinelSum,
    SeriesKey,
    Statistics,
)
from .histogram import Histogram, HistogramSpec
from .reduce import finish_statistics
from .series import GRAD_OUTPUT, RMS_TO_ROOT, TensorSeries
from .sinks import scalar_tag
from .track import SeriesTracker

if TYPE_CHECKING:
    from ._error_log import ErrorLog
    from .config import TrackConfig
    from .sampling import SampleForwards

__all__ = ["SeriesStore"]

#: Measured rows awaiting processing that other keys share (oldest dropped beyond).
MAX_ALIASED_ROWS = 4_096
#: Most samples whose caller step (``ObserverHandle.set_step``) is kept for the sinks.
MAX_SAMPLE_STEPS = 4096
#: Most samples whose loss scale is kept until their gradients arrive.
MAX_LOSS_SCALES = 1_024
#: Gradient values of these metrics are divided by the GradScaler loss scale (the metrics
#: in the tensor's own units; fractions and shape statistics do not change with it).
_LOSS_SCALED_METRICS = ("rms", "mean_abs", "max_abs")


class SeriesStore:
    """Every series of one observer and what feeds them.

    Args:
        names: the observed modules' names, by index (the observer's own list).
        track_config: the trackers' settings (``max_series`` bounds the series).
        histogram_specs: the requested histograms, by spec number.
        sample_forwards: the training forward of each sample (the observer's).
        errors: where sink errors are counted.
        sinks: the sinks; those with ``write_scalars`` or ``write_histogram`` get the
            values of every sample.
    """

    def __init__(
        self,
        *,
        names: list[str],
        track_config: TrackConfig,
        histogram_specs: Sequence[HistogramSpec],
        sample_forwards: SampleForwards,
        errors: ErrorLog,
        sinks: Iterable[Any],
    ) -> None:
        self._names = names
        self._track_config = track_config
        self._histogram_specs = tuple(histogram_specs)
        self._sample_forwards = sample_forwards
        self._errors = errors
        self.series: dict[SeriesKey, TensorSeries] = {}
        self.histograms: dict[tuple[int, int, str, str, int], Histogram] = {}
        #: The GradScaler loss scale over samples (log scale).
        self.loss_scale = SeriesTracker(track_config, log_scale=True, noise_floor=0.02)
        self.series_dropped = 0
        #: Keys whose rows from compiled graphs held elements since the observer last
        #: took them, and the last sample such rows came from (-1: none yet); see
        #: ``CompiledCapture.note_measured``.
        self.compiled_measured: set[SeriesKey] = set()
        #: Of those, the keys whose output gradient the graphs left untapped
        #: (:class:`~._records.TracedPath`).
        self.compiled_untapped: set[SeriesKey] = set()
        self.compiled_through = -1
        #: Tensors that compiled graphs reduced beyond a module's rows (``rows`` of
        #: :class:`~._records.CompiledRows`) in the samples read since the observer
        #: last took them: not recorded.
        self.compiled_rows_dropped = 0
        self._loss_scales: dict[int, float] = {}
        # Per measured (key, sample): the keys and forward positions that share its row.
        self._aliases: dict[tuple[SeriesKey, int], list[tuple[SeriesKey, int]]] = {}
        #: Per sample, the caller's step when it opened (bounded: oldest dropped first).
        self.sample_steps: dict[int, int] = {}
        self._scalar_sinks: list[Any] = []
        self._histogram_sinks: list[Any] = []
        self.set_sinks(sinks)

    def set_sinks(self, sinks: Iterable[Any]) -> None:
        """Hand values to these sinks from now on (after a fork: none of the parent's)."""
        sinks = list(sinks)
        self._scalar_sinks = [s for s in sinks if callable(getattr(s, "write_scalars", None))]
        self._histogram_sinks = [s for s in sinks if callable(getattr(s, "write_histogram", None))]

    @property
    def prompt(self) -> bool:
        """True if a sink's loggers accept no step below their latest (wandb): every
        sample is then handed over by the start of the next training forward."""
        return any(
            getattr(sink, "prompt", False) is True
            for sink in (*self._scalar_sinks, *self._histogram_sinks)
        )

    def note_step(self, sample: int, step: int) -> None:
        """``sample`` opened at the caller's step ``step`` (``ObserverHandle.set_step``)."""
        steps = self.sample_steps
        steps[sample] = step
        if len(steps) > MAX_SAMPLE_STEPS:
            del steps[next(iter(steps))]

    def add_alias(self, measured: SeriesKey, sample: int, key: SeriesKey, position: int) -> None:
        """Give ``key`` (at forward ``position``) the row that ``measured`` gets in
        ``sample``, when it is processed (see :meth:`process`)."""
        aliases = self._aliases
        entry = aliases.get((measured, sample))
        if entry is None:
            aliases[(measured, sample)] = [(key, position)]
            if len(aliases) > MAX_ALIASED_ROWS:
                # A row that never comes (a sample whose backward never ran).
                del aliases[next(iter(aliases))]
        else:
            entry.append((key, position))

    def process(
        self, records: list[Record], rows: Sequence[list[float] | Tensor]
    ) -> list[SentinelSum]:
        """Feed one host batch to the trackers (statistics in sample order; output
        gradients divided by their sample's loss scale and, as ``rms_to_root``, by the
        root's), add histogram counts, and hand the values to the scalar sinks.

        Args:
            records: the batch's records.
            rows: their host rows: floats, or a host tensor for a
                :class:`~._records.CompiledRows` (read with :meth:`_read_compiled`).

        Returns:
            The sentinel sums that were not finite (hits, in forward order).
        """
        if any(type(record) is CompiledRows for record in records):
            records, host_rows = self._read_compiled(records, rows)
        else:
            host_rows = cast("list[list[float]]", rows)
        hits: list[SentinelSum] = []
        grad_groups: dict[int, list[tuple[SeriesKey, dict[str, float | None]]]]
        grad_groups = {}
        loss_scales = self._loss_scales
        scalars: list[tuple[TensorSeries, int, dict[str, float | None]]] = []
        config = self._track_config
        aliases = self._aliases
        forward_of = self._sample_forwards.forward
        forwards: dict[int, int | None] = {}
        for record, row in zip(records, host_rows, strict=True):
            if not isinstance(record, Statistics):
                if isinstance(record, LossScale):
                    if row[0] > 0 and math.isfinite(row[0]):
                        loss_scales[record.sample] = row[0]
                        if len(loss_scales) > MAX_LOSS_SCALES:
                            del loss_scales[next(iter(loss_scales))]
                elif isinstance(record, HistogramCounts):
                    self._add_histogram(record, row)
                elif isinstance(record, SentinelSum) and not math.isfinite(row[0]):
                    hits.append(record)
                continue
            key, sample, position, _ = record
            if type(record) is CompiledStatistics:
                self.compiled_measured.add(key)
            values = finish_statistics(row)
            shared = aliases.pop((key, sample), None) if aliases else None
            if key[2] == GRAD_OUTPUT:
                group = grad_groups.setdefault(sample, [])
                group.append((key, values))
                if shared:
                    # Copies: each is divided by the loss scale and the root RMS later.
                    group.extend((alias, dict(values)) for alias, _ in shared)
                continue
            for series_key, series_position in ((key, position), *(shared or ())):
                series = self._series_for(series_key)
                if series is None:
                    continue
                series.forward_position = series_position
                forward = forwards.get(sample, -1)
                if forward == -1:
                    forward = forwards[sample] = forward_of(sample)
                series.update(config, sample, values, forward)
                if self._scalar_sinks:
                    scalars.append((series, sample, values))
        for sample in sorted(grad_groups):
            group = grad_groups[sample]
            forward = forward_of(sample)
            loss_scale = loss_scales.get(sample)
            if loss_scale is not None:
                self.loss_scale.update(sample, loss_scale, forward)
                for _, values in group:
                    for metric in _LOSS_SCALED_METRICS:
                        value = values[metric]
                        if value is not None:
                            values[metric] = value / loss_scale
            reference = next(
                (v["rms"] for k, v in group if k[0] == ROOT_INDEX and v["rms"] is not None),
                None,
            )
            for key, values in group:
                series = self._series_for(key)
                if series is None:
                    continue
                rms = values["rms"]
                if key[0] != ROOT_INDEX and reference and rms is not None:
                    # Net of the loss gradient: what the model between here and the
                    # output does to the gradient (loss scale and loss size cancel).
                    values[RMS_TO_ROOT] = rms / reference
                series.update(config, sample, values, forward)
                if self._scalar_sinks:
                    scalars.append((series, sample, values))
        if scalars:
            self._forward_scalars(scalars)
        return hits

    def _read_compiled(
        self, records: list[Record], rows: Sequence[list[float] | Tensor]
    ) -> tuple[list[Record], list[list[float]]]:
        """``records`` and ``rows`` with each :class:`~._records.CompiledRows` replaced
        by a :class:`~._records.CompiledStatistics` per row written in it (in forward
        order), its key made of the block's module, the row's call index and tensor
        path; tensors beyond a block's rows are counted (:attr:`compiled_rows_dropped`),
        and activation keys whose gradient the graph left untapped are collected
        (:attr:`compiled_untapped`)."""
        out_records: list[Record] = []
        out_rows: list[list[float]] = []
        for record, row in zip(records, rows, strict=True):
            if not isinstance(record, CompiledRows):
                assert not isinstance(row, Tensor)
                out_records.append(record)
                out_rows.append(row)
                continue
            assert isinstance(row, Tensor)
            sample, signal, position, modules, paths, _ = record
            if sample > self.compiled_through:
                self.compiled_through = sample
            per_module = row.shape[1] - 2
            width = row.shape[2] - 2
            if signal != GRAD_OUTPUT:
                reduced = row[:, per_module + 1, 1]
                self.compiled_rows_dropped += int((reduced - per_module).clamp(min=0).sum())
            written = row[:, :per_module, 0] != 0
            places = written.nonzero().tolist()
            values = row[:, :per_module][written].tolist()
            for (block, r), value in zip(places, values, strict=True):
                traced = paths[int(value[width + 1])]
                key = (modules[block], int(value[width]), signal, traced.path)
                if traced.gradient_untapped and signal != GRAD_OUTPUT:
                    self.compiled_untapped.add(key)
                at = -1 if position < 0 else position + block * per_module + r
                finished = value[:width]
                out_records.append(CompiledStatistics(key, sample, at, finished))
                out_rows.append(finished)
        return out_records, out_rows

    def _forward_scalars(
        self, measured: list[tuple[TensorSeries, int, dict[str, float | None]]]
    ) -> None:
        """Hand one host batch of per-sample values to each scalar sink."""
        steps: dict[int, int] = {}
        for _, sample, _ in measured:
            if sample not in steps:
                steps[sample] = self.sink_step(sample)
        for sink in self._scalar_sinks:
            wanted = getattr(sink, "metrics", ("rms",))
            batch = [
                (
                    scalar_tag(s.module, s.call_index, s.signal, s.tensor_path, metric),
                    value,
                    steps[sample],
                )
                for s, sample, values in measured
                for metric in wanted
                if (value := values.get(metric)) is not None
            ]
            try:
                sink.write_scalars(batch)
            except Exception as error:
                self._errors.record("sink", type(sink).__name__, error)

    def sink_step(self, sample: int) -> int:
        """The step that dashboard sinks log ``sample`` at: the caller's step when the
        sample opened (``ObserverHandle.set_step``), else the index of its training
        forward (0-based; the optimizer step with one forward per step), else (when
        that was not kept) the sample index."""
        step = self.sample_steps.get(sample)
        if step is not None:
            return step
        forward = self._sample_forwards.forward(sample)
        return sample if forward is None else forward

    def _add_histogram(self, record: HistogramCounts, row: list[float]) -> None:
        key, sample, number, _ = record
        index, call, signal, path = key
        histogram_key = (index, call, signal, path, number)
        histogram = self.histograms.get(histogram_key)
        if histogram is None:
            histogram = Histogram(self._histogram_specs[number])
            self.histograms[histogram_key] = histogram
        histogram.add(sample, row)
        if self._histogram_sinks:
            tag = scalar_tag(self._names[index], call, signal, path, "histogram")
            for sink in self._histogram_sinks:
                try:
                    sink.write_histogram(tag, histogram.spec.edges, row, self.sink_step(sample))
                except Exception as error:
                    self._errors.record("sink", type(sink).__name__, error)

    def _series_for(self, key: SeriesKey) -> TensorSeries | None:
        series = self.series.get(key)
        if series is not None:
            return series
        if len(self.series) >= self._track_config.max_series:
            self.series_dropped += 1
            return None
        index, call, signal, path = key
        series = TensorSeries(
            module=self._names[index],
            call_index=call,
            signal=signal,
            tensor_path=path,
            forward_position=-1,
            trackers={},
        )
        self.series[key] = series
        return series
