"""The reduction kernels in torch operations, for any device: one tensor's rows of
partial sums (:func:`_statistics_rows`) and the ragged batch of accelerators
(:func:`device_statistics_batch`). Layout and numerics: ``reduce.py``'s docstring.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch
from torch import Tensor

STAT_WIDTH = 9


def device_statistics_batch(flats: Sequence[Tensor]) -> Tensor:
    """Reduce several 1-D floating tensors of any lengths, on one device, to statistics rows.

    The batched form of :func:`tensor_statistics` for accelerators, where each tensor
    operation costs a kernel launch (several microseconds of host time) whatever its
    size. The tensors are laid end to end in one ``(blocks, b)`` matrix, each padded with
    NaN to a whole number of rows (``b`` is a power of two from 256 to 65,536, chosen so
    that the longest tensor spans at most 64 rows, up to 4M elements); the rows are
    reduced, and per-row partial results are gathered per tensor through a cached
    ``(k, s)`` layout, ``s`` the rows of the longest tensor (an ``index_copy_``, then a sum
    or maximum along it: no atomics, so the result does not depend on scheduling and
    ``torch.use_deterministic_algorithms`` is honoured). About 55
    operations reduce the whole batch, whatever ``k`` and the lengths, instead of about 35
    per tensor. The numerics are those of :func:`tensor_statistics`: non-finite elements
    (the padding among them) are masked and counted, values are divided by the tensor's
    largest finite magnitude, sums accumulate in float32 within a row and in float64
    across rows. Nothing is read back to the host, so no synchronisation happens on CUDA
    (the layout of a new set of lengths goes to the device by one non-blocking copy from
    pinned memory).

    Args:
        flats: ``k >= 1`` 1-D real floating tensors of one dtype on one device, each with
            at least one element. They are not modified.

    Returns:
        A float64 tensor of shape ``(k, STAT_WIDTH)`` on that device, row ``i`` the
        statistics of ``flats[i]``.

    Raises:
        ValueError: ``flats`` is empty, or its tensors are not non-empty 1-D real floating
            tensors of one dtype and device.
    """
    if not flats:
        raise ValueError("device_statistics_batch: flats must hold at least one tensor, got none")
    first = flats[0]
    for flat in flats:
        if (
            flat.dim() != 1
            or flat.numel() == 0
            or flat.dtype != first.dtype
            or flat.device != first.device
            or not flat.is_floating_point()
        ):
            raise ValueError(
                "device_statistics_batch: flats must be non-empty 1-D real floating tensors "
                f"of one dtype and device, got shape {tuple(flat.shape)}, dtype "
                f"{flat.dtype}, device {flat.device} next to dtype {first.dtype}, device "
                f"{first.device}"
            )
    with torch.no_grad():
        return device_statistics_batch_unchecked([f.detach() for f in flats])


#: Most rows (blocks) the longest tensor of a ragged batch spans; the block length is the
#: smallest power of two in [_MIN_BLOCK, _MAX_BLOCK] that keeps to it.
_BLOCKS_PER_TENSOR = 64
_MIN_BLOCK = 1 << 8
_MAX_BLOCK = 1 << 16


class _RaggedLayout:
    """Index tensors of one ragged batch shape (lengths on a device), built once."""

    __slots__ = ("block", "numel", "owner", "ready", "slot", "slots", "stream")

    def __init__(self, lengths: tuple[int, ...], device: torch.device) -> None:
        longest = max(lengths)
        block = _MIN_BLOCK
        while block < _MAX_BLOCK and block * _BLOCKS_PER_TENSOR < longest:
            block *= 2
        owner: list[int] = []
        slot: list[int] = []
        spans = [-(-n // block) for n in lengths]
        slots = max(spans)
        for i, span in enumerate(spans):
            owner.extend([i] * span)
            slot.extend(range(i * slots, i * slots + span))
        host = torch.tensor([owner, slot], dtype=torch.int64)
        numel = torch.tensor(lengths, dtype=torch.float64)
        if device.type == "cuda":
            # Pinned and non-blocking: a pageable copy to the device would synchronise.
            host, numel = host.pin_memory(), numel.pin_memory()
        host, numel = host.to(device, non_blocking=True), numel.to(device, non_blocking=True)
        self.block, self.slots = block, slots
        self.owner, self.slot, self.numel = host[0], host[1], numel
        self.stream = self.ready = None
        if device.type == "cuda":
            self.stream = torch.cuda.current_stream(device)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def tensors_for(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        if self.stream is not None and self.ready is not None:
            current = torch.cuda.current_stream(device)
            if current != self.stream:
                # Used on another stream than the one that copied them: wait (on the
                # device) for the copy, and keep their memory until this stream is done,
                # should the layout be evicted meanwhile.
                current.wait_event(self.ready)
                for tensor in (self.owner, self.slot, self.numel):
                    tensor.record_stream(current)
        return self.owner, self.slot, self.numel


_MAX_LAYOUTS = 32
_layouts: dict[tuple[torch.device, tuple[int, ...]], _RaggedLayout] = {}
_layouts_lock = threading.Lock()
_nan_blocks: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _ragged_layout(device: torch.device, lengths: tuple[int, ...]) -> _RaggedLayout:
    key = (device, lengths)
    with _layouts_lock:
        layout = _layouts.pop(key, None)
        if layout is None:
            layout = _RaggedLayout(lengths, device)
            if len(_layouts) >= _MAX_LAYOUTS:
                del _layouts[next(iter(_layouts))]  # least recently used
        _layouts[key] = layout
    return layout


def _nan_block(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A cached row of ``_MAX_BLOCK`` NaNs (the padding; never written)."""
    pad = _nan_blocks.get((device, dtype))
    if pad is None:
        pad = torch.full((_MAX_BLOCK,), math.nan, dtype=dtype, device=device)
        _nan_blocks[(device, dtype)] = pad
    return pad


def _segments(partial: Tensor, slot: Tensor, tensors: int, slots: int, amax: bool) -> Tensor:
    """Per-tensor sums (or maxima, of non-negative values) of per-row ``partial``."""
    table = partial.new_zeros((tensors * slots, *partial.shape[1:]))
    table.index_copy_(0, slot, partial)
    table = table.view(tensors, slots, *partial.shape[1:])
    return table.amax(dim=1) if amax else table.sum(dim=1)


@torch.no_grad()
def device_statistics_batch_unchecked(flats: Sequence[Tensor]) -> Tensor:
    """:func:`device_statistics_batch` without its argument checks, for callers whose
    tensors meet them by construction (the observer's staged float32 copies)."""
    device, dtype = flats[0].device, flats[0].dtype
    lengths = tuple(flat.numel() for flat in flats)
    layout = _ragged_layout(device, lengths)
    owner, slot, numel = layout.tensors_for(device)
    block, slots, k = layout.block, layout.slots, len(flats)
    pad = _nan_block(device, dtype)
    pieces: list[Tensor] = []
    for flat, n in zip(flats, lengths, strict=True):
        pieces.append(flat)
        if n % block:
            pieces.append(pad[: block - n % block])
    x = torch.cat(pieces).view(-1, block)
    finite_mask = torch.isfinite(x)
    x = torch.where(finite_mask, x, torch.zeros((), dtype=dtype, device=device))
    low, high = torch.aminmax(x, dim=1)
    max_abs = _segments(torch.maximum(low.abs(), high.abs()), slot, k, slots, amax=True)
    divisor = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    row_divisor = divisor.index_select(0, owner).unsqueeze(1)
    counts = torch.stack((finite_mask.sum(dim=1), x.bool().sum(dim=1)), dim=1)
    if dtype == torch.float64:
        scaled = (x / row_divisor).to(torch.float32)
    else:
        scaled = x.to(torch.float32)  # x is our own copy (torch.where made it)
        scaled.div_(row_divisor.to(torch.float32))
    # torch.sum adds pairwise within each row; rows are added in float64.
    sums = torch.stack(
        (scaled.sum(dim=1), scaled.abs().sum(dim=1), (scaled * scaled).sum(dim=1)), dim=1
    )
    totals = _segments(
        torch.cat((counts.to(torch.float64), sums.to(torch.float64)), dim=1),
        slot,
        k,
        slots,
        amax=False,
    )
    finite = totals[:, 0]
    mean = (totals[:, 2] / finite.clamp_min(1.0)).to(torch.float32)
    scaled.sub_(mean.index_select(0, owner).unsqueeze(1))
    # Masked positions (and the padding) hold 0 - mean now: zero them, so that they add
    # nothing to the central moments.
    scaled.mul_(finite_mask)
    scaled.square_()
    central2 = scaled.sum(dim=1)
    scaled.square_()
    central4 = scaled.sum(dim=1)
    central = _segments(
        torch.stack((central2, central4), dim=1).to(torch.float64), slot, k, slots, amax=False
    )
    return torch.cat(
        (
            numel.unsqueeze(1),
            finite.unsqueeze(1),
            (finite - totals[:, 1]).unsqueeze(1),
            max_abs.to(torch.float64).unsqueeze(1),
            totals[:, 2:],
            central.clamp_min(0.0),
        ),
        dim=1,
    )


def _statistics_rows(x: Tensor, masked: bool | None = None, kept: Tensor | None = None) -> Tensor:
    """Statistics rows of a ``(k, n)`` real floating matrix, one per row, on its device.

    ``masked`` selects the path that excludes non-finite elements; ``None`` decides by
    reading the extremes, which only the CPU does for free (on CUDA it would synchronise,
    so CUDA always masks). ``kept``, a boolean ``(k, n)`` tensor, restricts each row to
    the elements it marks (the masked path): the row is then that of the kept elements
    alone (its element count theirs), as if the others were not there.
    """
    rows, numel = x.shape
    low, high = torch.aminmax(x, dim=1)
    if kept is not None:
        masked = True
    if masked is None:
        # On the CPU reading the extremes costs nothing; take the cheap path when all
        # values are finite (a non-finite value makes the extremes non-finite).
        masked = x.device.type != "cpu" or not bool(
            torch.isfinite(low).all() and torch.isfinite(high).all()
        )
    finite_mask: Tensor | None = None
    if masked:
        finite_mask = torch.isfinite(x)
        if kept is not None:
            finite_mask &= kept
        finite = finite_mask.sum(dim=1)
        x = torch.where(finite_mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
        low, high = torch.aminmax(x, dim=1)
    else:
        finite = torch.full((rows,), numel, dtype=torch.int64, device=x.device)
    max_abs = torch.maximum(low.abs(), high.abs())
    divisor = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs)).unsqueeze(1)
    if x.dtype == torch.float64:
        scaled = (x / divisor).to(torch.float32)
    else:
        scaled = x.to(torch.float32, copy=True)
        scaled.div_(divisor.to(torch.float32))
    nonzero = x.bool().sum(dim=1)
    # torch.sum adds pairwise (accurate in float32 for any length); torch.dot and
    # vector_norm accumulate sequentially and lose digits beyond ~1e6 elements.
    sum_scaled = scaled.sum(dim=1)
    sum_abs = scaled.abs().sum(dim=1)
    sum_sq = (scaled * scaled).sum(dim=1)
    finite32 = finite.to(torch.float32)
    mean = sum_scaled / finite32.clamp_min(1.0)
    scaled.sub_(mean.unsqueeze(1))
    if finite_mask is not None:
        # Masked positions hold 0 - mean now: zero them, so that they add nothing to the
        # central moments (subtracting their share afterwards cancels catastrophically
        # when most of a row is non-finite).
        scaled.mul_(finite_mask)
    scaled.square_()
    central2 = scaled.sum(dim=1)
    scaled.square_()
    central4 = scaled.sum(dim=1)
    counts = torch.stack((finite, finite - nonzero), dim=1)
    sums = torch.stack(
        (sum_scaled, sum_abs, sum_sq, central2.clamp_min(0.0), central4.clamp_min(0.0)), dim=1
    )
    return torch.cat(
        (
            # torch.full launches a fill kernel; torch.tensor(..., device=cuda) would
            # copy from the host and synchronise.
            torch.full((rows, 1), float(numel), dtype=torch.float64, device=x.device)
            if kept is None
            else kept.sum(dim=1, keepdim=True).to(torch.float64),
            counts.to(torch.float64),
            max_abs.to(torch.float64).unsqueeze(1),
            sums.to(torch.float64),
        ),
        dim=1,
    )
