"""Per-tensor reductions: a few fused scalar statistics, computed on the tensor's device.

``tensor_statistics`` turns one floating tensor of any shape, dtype and size into a short
float64 vector of partial sums (layout below) without leaving the device; the host turns
batches of such vectors into metrics with ``finish_statistics``. Raw tensors are never kept.

Numerics. Values are divided by the tensor's largest finite magnitude before any power is
taken, and accumulated in float32 (float64 inputs are divided in float64 first), so sums
of squares and fourth powers neither overflow (bfloat16 near its maximum, float64 beyond
float32's range) nor underflow (gradients of 1e-12). Non-finite elements are counted and
excluded from every scale metric.

The kernels in torch operations (one tensor's rows; the ragged batch that accelerators
reduce in about 55 operations) are in ``_reduce_device.py``; this module holds the CPU
fast paths, which read the partial sums through BLAS and plain Python, and
:func:`finish_statistics`, which turns a row into metrics on the host.

Statistics vector layout (``STAT_WIDTH`` float64 values):

====  =================  ==========================================================
idx   name               meaning
====  =================  ==========================================================
0     numel              number of elements
1     finite             number of finite elements
2     zeros              number of elements exactly equal to zero
3     max_abs            largest finite magnitude ``m``
4     sum_scaled         sum of ``x / m`` over finite elements
5     sum_abs_scaled     sum of ``|x| / m``
6     sum_sq_scaled      sum of ``(x / m)^2``
7     central2_scaled    sum of ``(x / m - mean)^2``
8     central4_scaled    sum of ``(x / m - mean)^4``
====  =================  ==========================================================
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._reduce_device import (
    STAT_WIDTH,
    _statistics_rows,
    device_statistics_batch,
    device_statistics_batch_unchecked,
)

__all__ = [
    "FLOAT8_DTYPES",
    "METRICS",
    "STAT_WIDTH",
    "cpu_statistics",
    "cpu_statistics_batch",
    "cpu_statistics_deferred",
    "cpu_statistics_matrix_",
    "cpu_statistics_subsamples",
    "cpu_statistics_unchecked",
    "device_statistics_batch",
    "device_statistics_batch_unchecked",
    "finish_statistics",
    "is_reducible",
    "reducible_when_traced",
    "skip_reason",
    "tensor_statistics",
]


#: Metric names produced by :func:`finish_statistics`, in a fixed order.
METRICS: tuple[str, ...] = (
    "rms",
    "mean_abs",
    "max_abs",
    "tail_ratio",
    "excess_kurtosis",
    "zero_fraction",
    "nonfinite_fraction",
)


_is_functorch_wrapped = getattr(
    getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda value: False
)


#: The float8 dtypes this torch has (none before 2.1): no CPU reduction takes them, so
#: tensors of these dtypes are skipped (``"float8"``), eagerly and inside compiled graphs.
FLOAT8_DTYPES: tuple[torch.dtype, ...] = tuple(
    dtype
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
)


def skip_reason(value: object) -> str | None:
    """Return why a tensor cannot be reduced (``"non_floating"``, ``"sparse"``, ...), or
    None.

    Floating and complex dense tensors with at least one element are reducible, except
    nested tensors (``"nested"``) and the float8 dtypes (``"float8"``: torch's CPU
    reductions do not take them).
    """
    if not isinstance(value, Tensor):
        return "not_a_tensor"
    if value.is_nested:  # strided or jagged
        return "nested"
    if value.layout != torch.strided:
        return "sparse"
    if value.is_meta:
        return "meta"
    if _is_functorch_wrapped(value):
        return "functorch_transform"
    if not (value.is_floating_point() or value.is_complex()):
        return "non_floating"
    if value.dtype in FLOAT8_DTYPES:
        return "float8"
    if value.numel() == 0:
        return "empty"
    return None


def is_reducible(value: object) -> bool:
    """True if :func:`tensor_statistics` accepts ``value``."""
    return skip_reason(value) is None


def reducible_when_traced(value: object) -> bool:
    """What :func:`skip_reason` accepts, in checks that Dynamo can trace (a strided
    floating or complex tensor, not float8, not empty): used inside compiled graphs,
    where a float8 tensor raised in the traced reductions and stopped training."""
    return (
        isinstance(value, Tensor)
        and value.layout == torch.strided
        and (value.is_floating_point() or value.is_complex())
        and value.dtype not in FLOAT8_DTYPES
        and value.numel() > 0
    )


@torch.no_grad()
def tensor_statistics(x: Tensor) -> Tensor:
    """Reduce one tensor to its statistics vector, on its own device.

    Args:
        x: a dense floating or complex tensor of any shape with at least one element;
            complex tensors are reduced by magnitude. It is not modified and not kept.

    Returns:
        A float64 tensor of shape ``(STAT_WIDTH,)`` on ``x.device`` (layout in the module
        docstring). No host synchronisation happens on CUDA.

    Raises:
        ValueError: ``x`` is not reducible (see :func:`skip_reason`).
    """
    reason = skip_reason(x)
    if reason is not None:
        raise ValueError(f"tensor_statistics: x must be a dense floating tensor, got {reason}")
    x = x.detach()
    if x.is_complex():
        x = x.abs()
    return _statistics_rows(x.reshape(1, -1))[0]


#: Largest ``max_abs`` for which the CPU fast path is used, given ``n`` elements: the
#: fourth-power sums must stay below float32's range (about 3.4e38) with margin.
def _fast_path_limit(numel: int) -> float:
    return (1e36 / numel) ** 0.25


#: Tensors with more elements than this get their mean |x|, kurtosis and zero fraction
#: from a subsample of about ``SUBSAMPLE_SIZE`` elements (CPU fast path).
SUBSAMPLE_ABOVE = 1 << 15
SUBSAMPLE_SIZE = 1 << 15
#: Contiguous elements per block of that subsample.
SUBSAMPLE_BLOCK = 64

#: Elements per BLAS dot product in :func:`_sum_of_squares`; the float32 partial sums are
#: added in double, so the relative error stays below about 5e-5 at any length (a single
#: dot over 16 million elements can be off by 1%).
DOT_BLOCK = 1 << 18

#: Smallest ``max_abs`` for the CPU fast path: below it fourth powers underflow float32.
_FAST_PATH_FLOOR = 1e-8


_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@functools.lru_cache(maxsize=64)
def _subsample_blocks(blocks: int) -> Tensor:
    """Indices of the blocks a large tensor's subsample is taken from (cached per count).

    Block ``k`` of the sequence sits at ``frac(k * 0.618...) * blocks`` (a Weyl sequence
    of the golden ratio): spread evenly over the tensor but with no period, so no row
    length (a hidden size of 768 is 12 blocks, a stride of 3 blocks would see a third of
    its channels) makes it skip whole channels or features.
    """
    count = min(blocks, max(1, SUBSAMPLE_SIZE // SUBSAMPLE_BLOCK))
    positions = (torch.arange(count, dtype=torch.float64) * _GOLDEN).frac_() * blocks
    return positions.long().unique()


def _sum_of_squares(flat: Tensor) -> float:
    """Sum of squares of a 1-D float32 CPU tensor in one pass (no temporary copy)."""
    total = 0.0
    for start in range(0, flat.numel(), DOT_BLOCK):
        block = flat[start : start + DOT_BLOCK]
        total += float(torch.dot(block, block))
    return total


def cpu_statistics(x: Tensor) -> list[float]:
    """Reduce one CPU tensor to its statistics row, as host floats.

    Same contract and layout as :func:`tensor_statistics`, for tensors on the CPU, where
    reading a scalar costs no device synchronisation. When every element is finite and
    the largest magnitude lies where float32 powers neither overflow nor underflow, the
    sums are taken without the scaled copy (about three times faster on small tensors);
    otherwise it falls back to :func:`tensor_statistics`. Above ``SUBSAMPLE_ABOVE``
    elements (32,768), the tensor is read twice in full (extremes, and the sum of
    squares as blocked BLAS dot products), so RMS and maximum stay exact (relative error
    of the sum of squares below about 5e-5); the mean, mean absolute value, central
    moments (excess kurtosis) and zero count are estimated on a subsample of about 32,768
    elements (blocks of 64, spread over the tensor without a period).

    Raises:
        ValueError: ``x`` is not reducible (see :func:`skip_reason`).
    """
    reason = skip_reason(x)
    if reason is not None:
        raise ValueError(f"cpu_statistics: x must be a dense floating tensor, got {reason}")
    return cpu_statistics_unchecked(x)


def cpu_statistics_unchecked(x: Tensor) -> list[float]:
    """:func:`cpu_statistics` for a tensor already known to be reducible (hooks check
    :func:`skip_reason` first). Works on a detached view, so no graph is recorded."""
    result = cpu_statistics_deferred(x)
    if isinstance(result, Subsample):
        return _subsample_rows([result], owned=True)[0]
    return result


class Subsample(NamedTuple):
    """The full-pass results of a large CPU tensor and its subsample, whose statistics
    are still to be taken (see :func:`cpu_statistics_deferred`)."""

    #: 1-D float32 copy of the subsample blocks (all finite).
    part: Tensor
    #: Elements of the whole tensor.
    numel: int
    #: Largest magnitude of the whole tensor (exact).
    max_abs: float
    #: Sum of squares of the whole tensor (blocked dot products).
    sum_sq: float
    #: Whether every value has one sign (no value below zero, or none above).
    one_signed: bool


def cpu_statistics_deferred(x: Tensor) -> list[float] | Subsample:
    """:func:`cpu_statistics_unchecked`, leaving a large tensor's subsample for later.

    A finite float tensor above ``SUBSAMPLE_ABOVE`` elements, on the fast path, gets
    its full passes (extremes, sum of squares) now and comes back as a
    :class:`Subsample`, whose row the caller takes later, in a batch with the other
    subsamples of its part length (:func:`cpu_statistics_subsamples`); it is what
    :func:`cpu_statistics` gives, to float32 rounding. Any other tensor comes back as
    its finished row.
    """
    x = x.detach()
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.is_complex():
        return tensor_statistics(x).tolist()
    # One read of the tensor for both extremes. Two reductions (amin, amax) are faster
    # on a tensor in cache, but inside a training step, where the tensor comes from
    # memory, they cost more (CNN workload, every forward sampled: 1.29x against 1.27x).
    low, high = torch.aminmax(x)
    low_value, high_value = float(low), float(high)
    numel = x.numel()
    max_abs = max(-low_value, high_value)
    if not (
        math.isfinite(low_value)
        and math.isfinite(high_value)
        and _FAST_PATH_FLOOR <= max_abs <= _fast_path_limit(numel)
    ):
        return tensor_statistics(x).tolist()
    flat = x.reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.to(torch.float32)
    one_signed = low_value >= 0.0 or high_value <= 0.0
    if numel <= SUBSAMPLE_ABOVE:
        # Pairwise torch.sum rather than torch.dot: accurate in float32 at any length.
        whole = Subsample(flat, numel, max_abs, float((flat * flat).sum()), one_signed)
        return _subsample_rows([whole], owned=False)[0]
    # A large tensor is read in full for its extremes (above) and for its sum of squares
    # (RMS stays exact). The mean, mean |x|, central moments (kurtosis) and zero count
    # come from a subsample of blocks of SUBSAMPLE_BLOCK elements, copied once so that
    # its passes stay in cache (whole blocks, so the copy reads only the memory it
    # keeps), placed without any period (see _subsample_blocks).
    sum_sq = _sum_of_squares(flat)
    blocks = numel // SUBSAMPLE_BLOCK
    rows = flat[: blocks * SUBSAMPLE_BLOCK].view(blocks, SUBSAMPLE_BLOCK)
    part = rows.index_select(0, _subsample_blocks(blocks)).reshape(-1)
    return Subsample(part, numel, max_abs, sum_sq, one_signed)


def cpu_statistics_subsamples(subsamples: Sequence[Subsample]) -> list[list[float]]:
    """Finish several :class:`Subsample` results of :func:`cpu_statistics_deferred`.

    The parts are stacked and reduced along rows, so the batch costs about a dozen tensor
    operations, not a dozen per tensor; the whole tensors' exact largest magnitude and
    sum of squares come from the subsamples. The parts' own extremes are not needed, and
    when every part is one-signed (ReLU outputs) neither is ``|x|``: ``sum |x| = |sum x|``.

    Args:
        subsamples: ``k >= 1`` results of :func:`cpu_statistics_deferred` whose parts
            have one length.

    Returns:
        ``k`` statistics rows (layout of the module docstring), in order; each is what
        :func:`cpu_statistics` gives for its tensor, to float32 rounding.

    Raises:
        ValueError: ``subsamples`` is empty or its parts differ in length.
    """
    if not subsamples:
        raise ValueError("cpu_statistics_subsamples: subsamples must hold at least one, got none")
    length = subsamples[0].part.numel()
    lengths = {subsample.part.numel() for subsample in subsamples}
    if len(lengths) != 1:
        raise ValueError(
            "cpu_statistics_subsamples: the parts must have one length, got lengths "
            f"{sorted(lengths)}"
        )
    per_stack = max(1, BATCH_MAX_ELEMENTS // length)
    rows: list[list[float]] = []
    for start in range(0, len(subsamples), per_stack):
        chunk = subsamples[start : start + per_stack]
        rows.extend(_subsample_rows(chunk, owned=len(chunk) > 1))
    return rows


@torch.no_grad()
def _subsample_rows(subsamples: Sequence[Subsample], *, owned: bool) -> list[list[float]]:
    """Rows of finite tensors from their parts (the whole tensor, or its subsample), their
    exact largest magnitudes and sums of squares. ``owned``: a single part may be used
    as workspace (several are stacked into a new matrix, which always is)."""
    length = subsamples[0].part.numel()
    if len(subsamples) > 1:
        matrix = torch.stack([subsample.part for subsample in subsamples])
        owned = True
    else:
        matrix = subsamples[0].part.unsqueeze(0)
    total = matrix.sum(dim=1)
    if all(subsample.one_signed for subsample in subsamples):
        # ReLU outputs: |x| sums to |sum x|, and sign() counts the non-zero elements
        # (sign and sum are much faster than bool().sum() or count_nonzero on the CPU).
        sum_abs = total.abs()
        nonzero = matrix.sign().sum(dim=1).abs_()
    else:
        magnitude = matrix.abs()
        sum_abs = magnitude.sum(dim=1)
        nonzero = magnitude.sign_().sum(dim=1)
    centre = (total / length).unsqueeze(1)
    centred = matrix.sub_(centre) if owned else matrix - centre
    centred.square_()
    central2 = centred.sum(dim=1)
    centred.square_()
    central4 = centred.sum(dim=1)
    table = torch.stack((total, sum_abs, nonzero, central2, central4), dim=1).tolist()
    rows: list[list[float]] = []
    for subsample, (s1, s_abs, nonzeros, c2, c4) in zip(subsamples, table, strict=True):
        numel = subsample.numel
        weight = numel / length
        rows.append(
            _finite_row(
                numel,
                (length - nonzeros) * weight,
                subsample.max_abs,
                s1 * weight,
                s_abs * weight,
                subsample.sum_sq,
                c2 * weight,
                c4 * weight,
            )
        )
    return rows


def _finite_row(
    numel: int,
    zeros: float,
    max_abs: float,
    total: float,
    sum_abs: float,
    sum_sq: float,
    central2: float,
    central4: float,
) -> list[float]:
    """The statistics row of an all-finite tensor from unscaled sums (fast paths)."""
    scale = 1.0 / max_abs
    return [
        float(numel),
        float(numel),
        float(zeros),
        max_abs,
        total * scale,
        sum_abs * scale,
        sum_sq * scale * scale,
        central2 * scale * scale,
        central4 * scale**4,
    ]


#: Most elements stacked into one matrix by :func:`cpu_statistics_batch` (1 MiB of
#: float32, so that its passes stay in a core's cache); larger groups are reduced in
#: several stacks.
BATCH_MAX_ELEMENTS = 1 << 18


def cpu_statistics_batch(flats: Sequence[Tensor]) -> list[list[float]]:
    """Reduce several 1-D float32 CPU tensors of one length to their statistics rows.

    The tensors are stacked into a ``(k, n)`` matrix and reduced along its rows, so the
    whole batch costs about fifteen tensor operations and one host read, not fifteen per
    tensor: on small tensors (a few thousand elements) PyTorch's per-operation overhead,
    not arithmetic, is what a reduction costs. Sums are taken in float32 with PyTorch's
    cascaded row sums; a row whose values are non-finite or whose largest magnitude lies
    outside the float32-safe range (see :func:`cpu_statistics`) is recomputed on its own
    with :func:`tensor_statistics`.

    Args:
        flats: ``k >= 1`` contiguous 1-D float32 CPU tensors, all with the same number
            ``n >= 1`` of elements (hooks pass detached copies of module outputs).

    Returns:
        ``k`` rows of ``STAT_WIDTH`` floats, in the order of ``flats``, with the layout
        of the module docstring; they agree with :func:`cpu_statistics` of each tensor to
        float32 rounding.

    Raises:
        ValueError: ``flats`` is empty, or its tensors differ in length or are not 1-D
            float32 CPU tensors.
    """
    if not flats:
        raise ValueError("cpu_statistics_batch: flats must hold at least one tensor, got none")
    numel = flats[0].numel()
    for flat in flats:
        if (
            flat.dim() != 1
            or flat.numel() != numel
            or flat.dtype != torch.float32
            or flat.device.type != "cpu"
            or numel == 0
        ):
            raise ValueError(
                "cpu_statistics_batch: flats must be non-empty 1-D float32 CPU tensors of "
                f"one length, got shape {tuple(flat.shape)}, dtype {flat.dtype}, device "
                f"{flat.device} next to length {numel}"
            )
    rows_per_stack = max(1, BATCH_MAX_ELEMENTS // numel)
    rows: list[list[float]] = []
    for start in range(0, len(flats), rows_per_stack):
        chunk = flats[start : start + rows_per_stack]
        if len(chunk) > 1:
            rows.extend(_matrix_rows(torch.stack(list(chunk)), overwrite=True))
        else:  # the caller's own tensor: read only
            rows.extend(_matrix_rows(chunk[0].unsqueeze(0), overwrite=False))
    return rows


def cpu_statistics_matrix_(matrix: Tensor, *, scratch: Tensor | None = None) -> list[list[float]]:
    """Reduce each row of a float32 CPU matrix to its statistics row, using the matrix as
    workspace (its values are overwritten).

    :func:`cpu_statistics_batch` for rows that already sit in one matrix (the observer
    copies small tensors into preallocated rows): no stacking copy, and with ``scratch``
    no allocation at all.

    Args:
        matrix: contiguous ``(k, n)`` float32 CPU tensor, ``k, n >= 1``; overwritten.
        scratch: optional contiguous float32 CPU tensor of at least ``k * n`` elements,
            used for ``|x|`` (also overwritten). Default: a temporary is allocated.

    Returns:
        ``k`` rows of ``STAT_WIDTH`` floats, as :func:`cpu_statistics_batch` returns them.

    Raises:
        ValueError: ``matrix`` is not a non-empty contiguous 2-D float32 CPU tensor, or
            ``scratch`` is not a contiguous float32 CPU tensor of at least ``k * n``
            elements.
    """
    if (
        matrix.dim() != 2
        or matrix.numel() == 0
        or matrix.dtype != torch.float32
        or matrix.device.type != "cpu"
        or not matrix.is_contiguous()
    ):
        raise ValueError(
            "cpu_statistics_matrix_: matrix must be a non-empty contiguous 2-D float32 CPU "
            f"tensor, got shape {tuple(matrix.shape)}, dtype {matrix.dtype}, device "
            f"{matrix.device}, contiguous {matrix.is_contiguous()}"
        )
    if scratch is not None and (
        scratch.dtype != torch.float32
        or scratch.device.type != "cpu"
        or not scratch.is_contiguous()
        or scratch.numel() < matrix.numel()
    ):
        raise ValueError(
            "cpu_statistics_matrix_: scratch must be a contiguous float32 CPU tensor of at "
            f"least {matrix.numel()} elements, got {scratch.numel()} elements of "
            f"{scratch.dtype} on {scratch.device}"
        )
    return _matrix_rows(matrix, overwrite=True, scratch=scratch)


@torch.no_grad()
def _matrix_rows(
    matrix: Tensor, *, overwrite: bool, scratch: Tensor | None = None
) -> list[list[float]]:
    """Statistics rows of a ``(k, n)`` float32 matrix; ``overwrite`` lets it be used as
    workspace (centred and raised to powers in place), ``scratch`` holds ``|x|``."""
    count, numel = matrix.shape
    # Row reductions that PyTorch vectorises on the CPU (aminmax, count_nonzero and
    # `!= 0` along a dimension are several times slower than these). A non-finite value
    # makes max |x| non-finite, which sends the row to the exact path below.
    if scratch is None:
        magnitude = matrix.abs()
    else:
        magnitude = torch.abs(matrix, out=scratch[: count * numel].view(count, numel))
    max_abs = magnitude.amax(dim=1)
    sum_abs = magnitude.sum(dim=1)
    nonzero = magnitude.sign_().sum(dim=1)
    total = matrix.sum(dim=1)
    limit = _fast_path_limit(numel)
    # Rows off the fast path are reduced exactly, before the matrix is overwritten.
    exact = {
        i: tensor_statistics(matrix[i]).tolist()
        for i, peak in enumerate(max_abs.tolist())
        if not (math.isfinite(peak) and _FAST_PATH_FLOOR <= peak <= limit)
    }
    mean = total / numel
    centre = mean.unsqueeze(1)
    centred = matrix.sub_(centre) if overwrite else matrix - centre
    centred.square_()
    central2 = centred.sum(dim=1)
    centred.square_()
    central4 = centred.sum(dim=1)
    table = torch.stack(
        (max_abs, total, sum_abs, central2, central4, nonzero, mean), dim=1
    ).tolist()
    rows: list[list[float]] = []
    for i, (max_abs, s1, s_abs, c2, c4, nonzeros, m) in enumerate(table):
        row = exact.get(i) if exact else None
        if row is not None:
            rows.append(row)
            continue
        # The sum of squares without a pass of its own: for any centre m,
        # sum(x^2) = sum((x - m)^2) + m * (2 * sum(x) - n * m), exactly; with m the
        # float32 mean both terms are non-negative, so nothing cancels.
        s2 = c2 + m * (2.0 * s1 - numel * m)
        rows.append(_finite_row(numel, numel - nonzeros, max_abs, s1, s_abs, s2, c2, c4))
    return rows


def finish_statistics(row: Sequence[float]) -> dict[str, float | None]:
    """Turn one statistics vector (already on the host) into metric values.

    Args:
        row: ``STAT_WIDTH`` floats, as returned by :func:`tensor_statistics`.

    Returns:
        A dict over :data:`METRICS`. A value is ``None`` where the metric does not exist:
        scale metrics when no element is finite, ``tail_ratio`` when the RMS is zero,
        ``excess_kurtosis`` with fewer than 4 finite elements or zero variance.

        * ``rms`` = sqrt(mean(x^2)) over finite elements;
        * ``mean_abs`` = mean(|x|); ``max_abs`` = max(|x|);
        * ``tail_ratio`` = max_abs / rms (1 for a constant tensor, sqrt(n) at most);
        * ``excess_kurtosis`` = m4 / m2^2 - 3 with central moments m2, m4 (0 for a
          Gaussian, -1.2 for a uniform distribution; Pearson's definition);
        * ``zero_fraction`` = exact zeros / finite elements;
        * ``nonfinite_fraction`` = (NaN + inf elements) / all elements.
    """
    numel, finite, zeros, max_abs, _s1, s_abs, s2, c2, c4 = (float(v) for v in row)
    values: dict[str, float | None] = dict.fromkeys(METRICS)
    values["nonfinite_fraction"] = (numel - finite) / numel if numel > 0 else None
    if finite <= 0:
        return values
    rms = max_abs * math.sqrt(max(s2, 0.0) / finite)
    values["rms"] = rms
    values["mean_abs"] = max_abs * s_abs / finite
    values["max_abs"] = max_abs
    values["tail_ratio"] = max_abs / rms if rms > 0 else None
    m2 = c2 / finite
    # In units of max_abs^2: below 1e-10 the variance is float32 rounding of a constant.
    if finite >= 4 and m2 > 1e-10:
        values["excess_kurtosis"] = (c4 / finite) / (m2 * m2) - 3.0
    values["zero_fraction"] = zeros / finite
    return values
