"""The pure statistics of ``merge``: leave-one-out median and MAD, the spread floor per
metric, and ranks written as ranges.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._metrics import METRICS, RANK_DEFAULT_SPREAD_FLOOR
from .errors import ConfigError


def _median_without(sorted_values: Sequence[float], skip: int) -> float:
    """Median of ``sorted_values`` with the element at position ``skip`` left out."""
    count = len(sorted_values) - 1

    def at(position: int) -> float:
        return sorted_values[position if position < skip else position + 1]

    if count % 2:
        return at(count // 2)
    return (at(count // 2 - 1) + at(count // 2)) / 2


def _sorted_positions(values: Sequence[float]) -> tuple[list[float], list[int]]:
    order = sorted(range(len(values)), key=values.__getitem__)
    positions = [0] * len(values)
    for position, index in enumerate(order):
        positions[index] = position
    return [values[i] for i in order], positions


def leave_one_out_median_mad(values: Sequence[float]) -> list[tuple[float, float]]:
    """For each value: the median of the other values and their median absolute deviation.

    Exact, in O(n log n): leaving one value out moves the median to one of at most three
    order statistics, so the deviations are sorted at most three times.

    Args:
        values: at least two finite numbers (one per rank).

    Returns:
        ``[(median_i, mad_i), ...]`` where ``median_i`` is the median of all values but
        ``values[i]`` and ``mad_i`` the median of ``|values[j] - median_i|`` over ``j != i``.

    Raises:
        ConfigError: fewer than two values.

    Example:
        >>> leave_one_out_median_mad([1.0, 2.0, 10.0])
        [(6.0, 4.0), (5.5, 4.5), (1.5, 0.5)]
    """
    if len(values) < 2:
        raise ConfigError(
            f"leave_one_out_median_mad: values must hold at least 2 numbers, got {len(values)}"
        )
    sorted_values, positions = _sorted_positions(values)
    by_median: dict[float, tuple[list[float], list[int]]] = {}
    result: list[tuple[float, float]] = []
    for index, value_position in enumerate(positions):
        median = _median_without(sorted_values, value_position)
        deviations = by_median.get(median)
        if deviations is None:
            deviations = _sorted_positions([abs(v - median) for v in values])
            by_median[median] = deviations
        result.append((median, _median_without(deviations[0], deviations[1][index])))
    return result


def spread_floor(metric: str) -> float:
    """Smallest spread used when comparing ``metric`` across ranks, in compared units.

    Args:
        metric: a metric name from a report finding (``rms``, ``zero_fraction``, ...).

    Returns:
        0.1 (natural log, about 10%) for scale metrics, which are compared as logs; 0.02
        for ``zero_fraction`` and ``nonfinite_fraction``; 1.0 for ``excess_kurtosis``;
        0.1 for anything else. Different ranks see different batches, so a single
        sample's value varies between ranks even in a healthy run; the floor keeps that
        sampling noise from being called an outlier when the other ranks happen to agree
        closely.

    Example:
        >>> spread_floor("rms"), spread_floor("zero_fraction")
        (0.1, 0.02)
    """
    properties = METRICS.get(metric)
    return properties.rank_spread_floor if properties is not None else RANK_DEFAULT_SPREAD_FLOOR


def rank_ranges(ranks: Sequence[int]) -> list[str]:
    """Compress sorted ranks into ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``["0-2", "5", "7-8"]``.

    Args:
        ranks: ranks in increasing order, without repeats.

    Returns:
        One string per run of consecutive ranks.

    Example:
        >>> rank_ranges([0, 1, 2, 5, 7, 8])
        ['0-2', '5', '7-8']
    """
    out: list[str] = []
    start = previous = None
    for rank in ranks:
        if start is not None and previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            out.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    if start is not None:
        out.append(str(start) if start == previous else f"{start}-{previous}")
    return out


def _missing_ranges(accounted: set[int], world: int) -> tuple[int, list[str]]:
    """How many ranks of ``0 .. world - 1`` are not in ``accounted``, and their ranges.

    Works on the gaps between accounted ranks, so its cost does not grow with ``world``.

    Example:
        >>> _missing_ranges({0, 2, 3}, 10**12)
        (999999999997, ['1', '4-999999999999'])
    """
    count, ranges, start = 0, [], 0
    for rank in [*sorted(r for r in accounted if r < world), world]:
        if rank > start:
            ranges.append(str(start) if rank - 1 == start else f"{start}-{rank - 1}")
            count += rank - start
        start = rank + 1
    return count, ranges


def _count_ranges(ranges: Sequence[str]) -> int:
    total = 0
    for text in ranges:
        low, _, high = text.partition("-")
        total += (int(high) if high else int(low)) - int(low) + 1
    return total
