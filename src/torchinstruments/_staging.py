"""The statistics buffer: staging copies of observed tensors, choosing their reduction,
and moving the statistics rows to the host in batches.

    capture --measure()--> staged copies / slabs / pending rows --launch()--> in flight
            --arrived()--> (records, host rows) for the series store

Small tensors are copied and reduced later, many at a time; larger ones are reduced at
once to a device vector (no synchronisation); every row reaches the host in one
stacked copy per device at a flush. See ``docs/architecture.md``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ._records import CompiledRows, Record, SeriesKey, Statistics, sample_order
from .reduce import (
    BATCH_MAX_ELEMENTS,
    Subsample,
    cpu_statistics_batch,
    cpu_statistics_deferred,
    cpu_statistics_matrix_,
    cpu_statistics_subsamples,
    cpu_statistics_unchecked,
    device_statistics_batch_unchecked,
    skip_reason,
    tensor_statistics,
)

if TYPE_CHECKING:
    from ._error_log import ErrorLog

__all__ = [
    "DEVICE_STAGE_MAX_ELEMENTS",
    "DEVICE_STAGE_MAX_NUMEL",
    "MAX_PENDING_RECORDS",
    "SLAB_MAX_ROWS",
    "STAGE_MAX_ELEMENTS",
    "STAGE_MAX_NUMEL",
    "Slab",
    "StatisticsBuffer",
]

#: Records kept on the device before a flush moves them to the host.
MAX_PENDING_RECORDS = 4_096
#: CPU tensors of at most this many elements are copied (as float32) when observed and
#: reduced later in batches (see StatisticsBuffer.measure); larger ones at once.
STAGE_MAX_NUMEL = 1 << 15
#: Most rows of one staging slab (see Slab): a slab holds at most
#: ``BATCH_MAX_ELEMENTS`` elements (1 MiB), and no more rows than this.
SLAB_MAX_ROWS = 256
#: Accelerator (CUDA) tensors of at most this many elements are staged the same way:
#: each tensor operation there costs a kernel launch, several microseconds of host time,
#: so one ragged batch (all staged tensors of a device, any lengths, about 55 operations)
#: saves about 35 launches per tensor.
DEVICE_STAGE_MAX_NUMEL = 1 << 20
#: Staged CPU elements (float32) after which the staged copies are reduced (16 MiB);
#: also the bound on the elements of all staging slabs together.
STAGE_MAX_ELEMENTS = 1 << 22
#: The same for accelerator copies (32 MiB): fewer, larger batches save launches; while
#: one is reduced, about four times its size is held on the device.
DEVICE_STAGE_MAX_ELEMENTS = 1 << 23
_STAGED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: (series key, sample, position) of a row filled in a slab.
Meta = tuple[SeriesKey, int, int]
#: A staged copy awaiting a batch: (key, sample, position, flat float32 copy, or the
#: subsample of a large CPU tensor whose full passes are done).
Staged = tuple[SeriesKey, int, int, "Tensor | Subsample"]


class Slab:
    """Preallocated rows for the float32 copies of small CPU tensors of one length.

    A copy goes into the next free row and the rows are reduced in place when the slab
    is full or at a flush (:func:`~torchinstruments.reduce.cpu_statistics_matrix_`), then
    reused. Compared with one fresh tensor per copy, stacked at the flush, this saves
    the stacking copy and, above all, the allocator's churn: piles of fresh copies were
    handed back to the system after each flush and faulted in again (a copy of 16,384
    elements cost 15 us inside a training step; in a microbenchmark, 35 us against
    4.5 us once 64 or more copies were alive).
    """

    __slots__ = ("capacity", "matrix", "records", "rows", "used")

    def __init__(self, numel: int) -> None:
        self.capacity = self.capacity_for(numel)
        self.matrix = torch.empty(self.capacity, numel)
        #: One view per row, made on first use and kept (``select`` views: a row of
        #: ``unbind`` is a multi-output view, slower to view again).
        self.rows: list[Tensor] = []
        #: (key, sample, position) of the rows filled so far, in row order.
        self.records: list[Meta] = []
        #: Whether a row was filled since the last flush (others may be freed).
        self.used = True

    @staticmethod
    def capacity_for(numel: int) -> int:
        """Rows of a slab for tensors of ``numel`` elements."""
        return max(1, min(SLAB_MAX_ROWS, BATCH_MAX_ELEMENTS // numel))

    def next_row(self) -> Tensor:
        """The view of the next free row."""
        filled = len(self.records)
        rows = self.rows
        if filled == len(rows):
            rows.append(self.matrix[filled])
        return rows[filled]


class StatisticsBuffer:
    """Statistics on their way from the hooks to the host.

    Args:
        names: the observed modules' names, by index (the observer's own list, which
            grows when parents are adopted); used to name errors.
        errors: where errors of reductions and transfers are counted.
    """

    def __init__(self, names: list[str], errors: ErrorLog) -> None:
        self._names = names
        self._errors = errors
        #: False once the observer is detached: the next reduction frees the slabs.
        self.attached = True
        #: Records whose rows are made, awaiting the next :meth:`launch`.
        self.pending: list[Record] = []
        # A deque: hooks on worker threads append while a flush pops (both atomic).
        self.staged: deque[Staged] = deque()
        self.staged_elements = 0
        self._device_staged_elements = 0
        #: Staging slabs of small CPU tensors by length (see Slab); the lock orders
        #: hooks of several threads that fill them and the flush that reduces them.
        self.slabs: dict[int, Slab] = {}
        self.slab_elements = 0
        self.slab_records = 0
        self.lock = threading.Lock()
        self.slab_scratch: Tensor | None = None
        #: Lengths of small CPU tensors met without a slab since the last flush.
        self._lengths_seen: dict[int, None] = {}
        #: Device types that take the accelerator path: tensors up to
        #: ``DEVICE_STAGE_MAX_NUMEL`` elements are staged and reduced together, whatever
        #: their lengths, by ``device_statistics_batch_unchecked``; sentinel sums are read
        #: at the next flush; nothing is read back inside a hook. Tests add "cpu" to run
        #: that path without a GPU.
        self.device_path_types: frozenset[str] = frozenset({"cuda"})
        #: CUDA streams that made staged copies or pending device rows since the last
        #: flush: work on another stream that reads them must wait for these.
        self.producer_streams: set[Any] = set()
        self._in_flight: list[_InFlight] = []
        #: Staged float32 copies of output gradients, by (key, sample), while they are
        #: not reduced yet: a later backward pass over the same sample adds into them
        #: (see add_repeated). Cleared whenever staged copies are reduced.
        self._grad_buffers: dict[tuple[SeriesKey, int], Tensor] = {}
        self._last_staged: Tensor | None = None

    def measure(self, key: SeriesKey, sample: int, position: int, tensor: Tensor) -> None:
        """Reduce one observed tensor, or stage a float32 copy of it for a batch.

        Small tensors are copied and reduced later, many at a time (per-operation
        overhead, not arithmetic, is what reducing them costs: PyTorch's dispatch on the
        CPU, a kernel launch on CUDA): on the CPU into a row of the staging slab of their
        length (:class:`Slab`), reduced when it is full or at a flush; on CUDA into a
        ragged device batch (:meth:`reduce_staged`). The copy is needed: the tensor may
        be changed in place after the hook returns (``out += residual``, ``relu_``).
        Larger CPU tensors get their full passes at once and their subsample staged
        (:class:`~torchinstruments.reduce.Subsample`), and larger CUDA tensors are reduced
        to a device vector (no synchronisation).
        """
        numel = tensor.numel()
        device_type = tensor.device.type
        if (
            device_type in self.device_path_types
            and numel <= DEVICE_STAGE_MAX_NUMEL
            and tensor.dtype in _STAGED_DTYPES
        ):
            copy = tensor.detach().to(
                torch.float32, memory_format=torch.contiguous_format, copy=True
            )
            self.staged.append((key, sample, position, copy.view(-1)))
            if device_type == "cuda":
                self.producer_streams.add(torch.cuda.current_stream(tensor.device))
            self._device_staged_elements += numel
            self._last_staged = copy.view(-1)
            if self._device_staged_elements > DEVICE_STAGE_MAX_ELEMENTS:
                self.reduce_staged()
            return
        if device_type != "cpu":
            if device_type == "cuda":
                self.producer_streams.add(torch.cuda.current_stream(tensor.device))
            self.pending.append(Statistics(key, sample, position, tensor_statistics(tensor)))
            return
        if numel <= STAGE_MAX_NUMEL and tensor.dtype in _STAGED_DTYPES:
            with self.lock:
                slab = self.slabs.get(numel)
                if slab is None:
                    slab = self._new_slab(numel)
                if slab is not None:
                    # Copied (as float32, in logical order) into the slab's next free row.
                    row = slab.next_row()
                    if tensor.is_contiguous():
                        row.copy_(tensor.detach().view(-1))
                    else:
                        row.view(tensor.shape).copy_(tensor.detach())
                    records = slab.records
                    records.append((key, sample, position))
                    slab.used = True
                    self.slab_records += 1
                    self._last_staged = row
                    if len(records) == slab.capacity:
                        self._reduce_slab(slab)
                    return
            # More lengths than slabs (dynamic shapes): a copy of its own, reduced at the
            # flush with the other copies of its length.
            copy = tensor.detach().to(
                torch.float32, memory_format=torch.contiguous_format, copy=True
            )
            self.staged.append((key, sample, position, copy.view(-1)))
            self.staged_elements += numel
            self._last_staged = copy.view(-1)
            if self.staged_elements > STAGE_MAX_ELEMENTS:
                self.reduce_staged()
            return
        result = cpu_statistics_deferred(tensor)
        if isinstance(result, Subsample):
            # The full passes are done; the subsample's own statistics (about ten small
            # operations) are taken in a batch with the other staged tensors.
            self.staged.append((key, sample, position, result))
            self.staged_elements += result.part.numel()
            if self.staged_elements > STAGE_MAX_ELEMENTS:
                self.reduce_staged()
            return
        self.pending.append(Statistics(key, sample, position, result))

    def _new_slab(self, numel: int) -> Slab | None:
        """A slab for tensors of ``numel`` elements (lock held), or None: then the tensor
        is copied on its own.

        A length gets a slab the second time it is met between two flushes (with dynamic
        shapes most lengths come and go, and a slab is worth its making only for one
        that recurs); slabs then stay while they are used. While the slabs would exceed
        ``STAGE_MAX_ELEMENTS``, slabs unused since the last flush are freed; if that is
        not enough, None. Evicting busy slabs for new lengths made and dropped a slab per
        copy once a step had more lengths than fit (17 and more), four times the cost of
        a copy of its own.
        """
        seen = self._lengths_seen
        if numel not in seen:
            if len(seen) >= 4 * SLAB_MAX_ROWS:
                seen.clear()
            seen[numel] = None
            return None
        size = Slab.capacity_for(numel) * numel
        slabs = self.slabs
        if self.slab_elements + size > STAGE_MAX_ELEMENTS:
            for length, stale in list(slabs.items()):
                if not stale.used and not stale.records:
                    del slabs[length]
                    self.slab_elements -= stale.matrix.numel()
                    if self.slab_elements + size <= STAGE_MAX_ELEMENTS:
                        break
            if self.slab_elements + size > STAGE_MAX_ELEMENTS:
                return None
        slab = Slab(numel)
        self.slabs[numel] = slab
        self.slab_elements += slab.matrix.numel()
        return slab

    def _reduce_slab(self, slab: Slab) -> None:
        """Reduce the filled rows of ``slab`` into pending host rows (lock held)."""
        records = slab.records
        if not records:
            return
        self._grad_buffers.clear()  # rows are reused: no gradient may be added any more
        self._last_staged = None
        slab.records = []
        self.slab_records -= len(records)
        matrix = slab.matrix[: len(records)]
        try:
            scratch = self.slab_scratch
            if scratch is None:
                scratch = self.slab_scratch = torch.empty(BATCH_MAX_ELEMENTS)
            rows = cpu_statistics_matrix_(matrix, scratch=scratch)
        except Exception as error:
            # The rows are workspace now: nothing to retry; the error is counted.
            self._errors.record("reduce", self._names[records[0][0][0]], error)
            return
        pending = self.pending
        for (key, sample, position), row in zip(records, rows, strict=True):
            pending.append(Statistics(key, sample, position, row))

    def _reduce_slabs(self) -> None:
        """Reduce every slab (a flush); free them all once the observer is detached."""
        with self.lock:
            self._lengths_seen.clear()
            slabs = self.slabs
            for slab in slabs.values():
                self._reduce_slab(slab)
                slab.used = False
            if not self.attached:
                slabs.clear()
                self.slab_elements = 0
                self.slab_scratch = None

    def reduce_staged(self) -> None:
        """Reduce the staged copies, grouped by length, into pending host rows."""
        if self.slabs or self._lengths_seen:
            self._reduce_slabs()
        staged = self.staged
        self._grad_buffers.clear()  # reduced below: no gradient may be added any more
        self._last_staged = None
        # Pop rather than swap lists: worker threads may be appending meanwhile.
        taken = [staged.popleft() for _ in range(len(staged))]
        self.staged_elements = self._device_staged_elements = 0
        if not taken:
            return
        # Subsamples of large CPU tensors and copies of small ones (lengths without a
        # slab) are batched by length; a device batch takes copies of any lengths.
        groups: dict[tuple[bool, torch.device, int], list[int]] = {}
        device_path_types = self.device_path_types
        for i, record in enumerate(taken):
            value = record[3]
            if isinstance(value, Subsample):
                key = (True, value.part.device, value.part.numel())
            elif value.device.type in device_path_types:
                key = (False, value.device, 0)
            else:
                key = (False, value.device, value.numel())
            groups.setdefault(key, []).append(i)
        pending = self.pending
        for (subsamples, device, length), indices in groups.items():
            rows: Sequence[Tensor | list[float] | None]
            values = [taken[i][3] for i in indices]
            try:
                if subsamples:
                    rows = cpu_statistics_subsamples(values)  # type: ignore[arg-type]
                elif length:
                    rows = cpu_statistics_batch(values)  # type: ignore[arg-type]
                else:
                    if device.type == "cuda":
                        self._order_streams(device, values)  # type: ignore[arg-type]
                    rows = device_statistics_batch_unchecked(values).unbind(0)  # type: ignore[arg-type]
            except Exception:
                # One bad value must not cost the whole batch: reduce them one by one.
                rows = [self._reduce_one(taken[i]) for i in indices]
            for i, row in zip(indices, rows, strict=True):
                if row is not None:
                    key, sample, position, _ = taken[i]
                    pending.append(Statistics(key, sample, position, row))

    def _order_streams(self, device: torch.device, tensors: Sequence[Tensor]) -> None:
        """Make the current CUDA stream wait (on the device, no host sync) for the other
        streams that made ``tensors``, and keep their memory until it has used them
        (the caching allocator would otherwise hand it back to the making stream)."""
        current = torch.cuda.current_stream(device)
        others = [s for s in self.producer_streams if s.device == device and s != current]
        if not others:
            return
        for stream in others:
            current.wait_stream(stream)
        for tensor in tensors:
            tensor.record_stream(current)

    def order_pending(self, pending: Sequence[Record]) -> None:
        """:meth:`_order_streams` for the device rows about to be stacked and copied."""
        by_device: dict[torch.device, list[Tensor]] = {}
        for record in pending:
            row = record.row
            if isinstance(row, Tensor) and row.is_cuda:
                by_device.setdefault(row.device, []).append(row)
        for device, rows in by_device.items():
            self._order_streams(device, rows)

    def _reduce_one(self, record: Staged) -> Tensor | list[float] | None:
        try:
            flat = record[3]
            if isinstance(flat, Subsample):
                return cpu_statistics_subsamples([flat])[0]
            return cpu_statistics_unchecked(flat) if flat.is_cpu else tensor_statistics(flat)
        except Exception as error:
            self._errors.record("reduce", self._names[record[0][0]], error)
            return None

    def append(self, record: Record) -> None:
        """Add a record whose row is made already (histogram counts, a sentinel sum, a
        loss scale), noting the CUDA stream that made it."""
        row = record.row
        if isinstance(row, Tensor) and row.is_cuda:
            self.producer_streams.add(torch.cuda.current_stream(row.device))
        self.pending.append(record)

    def measure_gradient(self, key: SeriesKey, sample: int, grad: Tensor) -> None:
        """:meth:`measure` for an output gradient; its staged copy, if any, is kept so
        that a later backward pass over the same sample adds into it
        (:meth:`add_repeated`)."""
        self._last_staged = None
        self.measure(key, sample, -1, grad)
        if self._last_staged is not None:
            buffers = self._grad_buffers
            buffers[(key, sample)] = self._last_staged
            self._last_staged = None
            if len(buffers) > MAX_PENDING_RECORDS:
                del buffers[next(iter(buffers))]

    def add_repeated(self, key: SeriesKey, sample: int, grad: Tensor) -> bool:
        """Add ``grad`` to the staged copy of the gradient of ``key`` in ``sample``
        (another backward pass, ``retain_graph=True``); False if that copy is reduced
        already (or never was staged), or the shapes differ."""
        buffer = self._grad_buffers.get((key, sample))
        if buffer is None or buffer.numel() != grad.numel() or skip_reason(grad) is not None:
            return False
        with self.lock:
            buffer.view(grad.shape).add_(grad.detach())
        return True

    def waiting(self) -> int:
        """Records not yet on their way to the host (pending, staged, in slabs)."""
        return len(self.pending) + len(self.staged) + self.slab_records

    def launch(self) -> None:
        """Reduce the staged copies and start moving every pending row to the host
        (one stacked copy per device, non-blocking into pinned memory on CUDA)."""
        self.reduce_staged()
        pending = self.pending
        if not pending:
            return
        self.pending = []
        # Trackers need each series in sample order; rows of small tensors (staged)
        # come after rows of large ones (reduced at once) of later samples.
        pending.sort(key=sample_order)
        try:
            if self.producer_streams:
                ordered = set(self.producer_streams)
                self.order_pending(pending)
                # What those streams made so far is ordered now; a stream another
                # thread added meanwhile stays for the next flush.
                self.producer_streams -= ordered
            self._in_flight.append(_launch_transfer(pending))
        except Exception as error:
            self._errors.record("flush", "", error)

    def arrived(self, *, block: bool) -> Iterator[tuple[list[Record], list[list[float] | Tensor]]]:
        """The batches on the host, oldest first, each as (records, host rows); with
        ``block=False`` only batches whose copy has completed (no wait on the device)."""
        in_flight = self._in_flight
        while in_flight:
            batch = in_flight[0]
            if not block and not batch.ready():
                return
            in_flight.pop(0)
            try:
                rows = batch.rows()
            except Exception as error:
                self._errors.record("flush", "", error)
                continue
            yield batch.meta, rows


class _InFlight:
    """One batch of statistics on its way to the host."""

    __slots__ = ("_events", "_host", "meta")

    def __init__(
        self,
        meta: list[Record],
        host: list[tuple[list[int], Tensor | list[list[float]]]],
        events: list[Any],
    ) -> None:
        self.meta = meta
        self._host = host
        self._events = events

    def ready(self) -> bool:
        return all(event.query() for event in self._events)

    def rows(self) -> list[list[float] | Tensor]:
        """The host rows, by record: floats, or for a :class:`CompiledRows` its host
        tensor (the series store reads only the rows written in it)."""
        for event in self._events:
            event.synchronize()
        rows: list[list[float] | Tensor] = [[] for _ in range(len(self.meta))]
        meta = self.meta
        for positions, host in self._host:
            if isinstance(host, Tensor) and type(meta[positions[0]]) is CompiledRows:
                values: Sequence[list[float] | Tensor] = host.unbind(0)
            else:
                values = host.tolist() if isinstance(host, Tensor) else host
            for i, row in zip(positions, values, strict=True):
                rows[i] = row
        return rows


def _launch_transfer(records: list[Record]) -> _InFlight:
    """Stack the pending device vectors per device and start one host copy per device.

    Rows already on the host (CPU tensors are reduced to host floats) pass through.
    """
    meta = records
    stats = [record.row for record in records]
    by_device: dict[tuple[torch.device, int, bool], list[int]] = {}
    host_rows: list[int] = []
    for i, item in enumerate(stats):
        if isinstance(item, Tensor):
            group = (item.device, item.numel(), type(records[i]) is CompiledRows)
            by_device.setdefault(group, []).append(i)
        else:
            host_rows.append(i)
    host: list[tuple[list[int], Tensor | list[list[float]]]] = []
    if host_rows:
        host.append((host_rows, [stats[i] for i in host_rows]))  # type: ignore[misc]
    events: list[Any] = []
    for (device, _, _), positions in by_device.items():
        stacked = torch.stack([stats[i] for i in positions])  # type: ignore[misc]
        if device.type == "cuda":
            buffer = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            buffer.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
            host.append((positions, buffer))
        else:
            host.append((positions, stacked.cpu()))
    return _InFlight(meta, host, events)
