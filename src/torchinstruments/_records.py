"""Typed records: what capture hands to the statistics buffer, one class per kind.

Each record carries one row for the host: a device vector (moved to the host in
batches, see ``_staging.py``) or host floats. Hooks add a record with a single
``list.append``, which is atomic, so worker threads of one forward never interleave
half records. After the transfer the series store tells the kinds apart by class
(``type(record) is Statistics``), never by a string.

- :class:`Statistics`: the ``STAT_WIDTH`` partial statistics of one tensor
  (``reduce.py``), read by the trackers of its series;
- :class:`CompiledRows`: the rows that compiled graphs wrote in one sample, for every
  observed module (``_compiled_capture.py``); the series store reads each written row
  as a :class:`CompiledStatistics`;
- :class:`HistogramCounts`: the counts per bin of one histogram spec, added to the
  histogram of its series;
- :class:`SentinelSum`: one sum, non-finite where the checked tensor held a non-finite
  value, read by the sentinel;
- :class:`LossScale`: the GradScaler loss scale, then zeros, which divides the
  gradients of its sample.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = [
    "ROOT_INDEX",
    "CompiledRows",
    "CompiledStatistics",
    "HistogramCounts",
    "LossScale",
    "Record",
    "Row",
    "SentinelSum",
    "SeriesKey",
    "Statistics",
    "sample_order",
]

#: (module index, call index, signal, tensor path) of one observed tensor.
SeriesKey = tuple[int, int, str, str]
#: Module index of the root (``select_modules`` puts it first).
ROOT_INDEX = 0
#: A row on its way to the host: a device vector, or host floats.
Row = Tensor | list[float]


class Statistics(NamedTuple):
    """The statistics row of one tensor: series ``key`` in ``sample``, measured at
    forward ``position`` (the module call's place in the forward; -1 for gradients)."""

    key: SeriesKey
    sample: int
    position: int
    row: Row


class CompiledStatistics(Statistics):
    """A :class:`Statistics` row written inside a compiled graph (read from a
    :class:`CompiledRows`): the series store notes its key
    (``SeriesStore.compiled_measured``)."""

    __slots__ = ()


class TracedPath(NamedTuple):
    """A tensor path that a compiled graph reduced (its index in ``CompiledRows.paths``
    is a constant of the graph), and whether the graph left that tensor's output
    gradient untapped (an output that is one of the module's inputs, or a tensor in a
    dict, a list inside the output, a dataclass: see ``traced_activation``)."""

    path: str
    gradient_untapped: bool


class CompiledRows(NamedTuple):
    """What compiled graphs wrote for signal ``signal`` in ``sample``: ``row`` is a float64
    ``(len(modules), rows + 2, STAT_WIDTH + 2)`` tensor, block ``m`` module
    ``modules[m]``'s (modules in forward order). Row ``r < rows`` of a block, where its
    element count (column 0) is not 0, is the statistics row of one tensor, then its
    call index and the index of its :class:`TracedPath` in ``paths``; row ``rows`` takes the
    tensors beyond ``rows``, and row ``rows + 1`` holds the module's hook calls and
    tensors reduced in the sample (activation rows only). Forward positions are
    ``position + m * rows + r`` (-1 for output gradients)."""

    sample: int
    signal: str
    position: int
    modules: tuple[int, ...]
    paths: list[TracedPath]
    row: Tensor


class HistogramCounts(NamedTuple):
    """The bin counts of histogram spec number ``spec`` for series ``key`` in ``sample``."""

    key: SeriesKey
    sample: int
    spec: int
    row: Row


class SentinelSum(NamedTuple):
    """A sentinel's check of the output at ``key`` in unsampled training forward
    ``forward`` (0-based); ``next_sample`` is the index the next sample takes."""

    key: SeriesKey
    forward: int
    next_sample: int
    row: Row


class LossScale(NamedTuple):
    """The GradScaler loss scale that the gradients of ``sample`` carry (``row[0]``)."""

    sample: int
    row: Row


Record = Statistics | CompiledRows | HistogramCounts | SentinelSum | LossScale


def sample_order(record: Record) -> int:
    """Sort key that puts each series' rows in sample order: the sample of statistics
    and histogram counts, -1 (first) for sentinel sums and loss scales, which belong
    to no series. Sorting is stable, so sentinel sums keep their forward order."""
    return record.sample if isinstance(record, Statistics | CompiledRows | HistogramCounts) else -1
