"""Matching the series of two runs for ``compare``: the departure statistic, the
baseline's noise, and one value comparison per series with its interpretation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._compare_align import _Axis, _describe_when
from ._document import number_text, round_number
from ._metrics import (
    COMPARISON_FRACTION_FLOOR,
    COMPARISON_LOG_FLOOR,
    IDENTICAL_FRACTION_FLOOR,
    IDENTICAL_LOG_FLOOR,
    MAD_TO_STD,
    TINY,
)
from ._series_file import SeriesFile, SeriesKey, SeriesRow
from .series import ACTIVATION, GRAD_OUTPUT

#: Departure, in noise units, beyond which a series has notably diverged.
DIVERGENCE_THRESHOLD = 5.0
#: Consecutive compared points (same sign) a departure must last to count.
PERSISTENCE_POINTS = 2
#: Compared points at which every common series must agree exactly for the runs to be
#: taken as identical before their first difference (a same-seed pair).
MIN_IDENTICAL_POINTS = 3
#: ``[sample, baseline, candidate]`` points carried by each category entry.
POINTS_PER_ENTRY = 12
#: Category -> the (signal, metric) series it compares. Scale categories compare
#: activation ``rms`` and output-gradient ``rms_to_root`` (net of the loss gradient, as
#: the report ranks them); ``non_finite`` compares the first non-finite sample.
CATEGORIES: dict[str, tuple[tuple[str, str], ...]] = {
    "non_finite": ((ACTIVATION, "nonfinite_fraction"), (GRAD_OUTPUT, "nonfinite_fraction")),
    "activation_scale": ((ACTIVATION, "rms"),),
    "gradient_scale": ((GRAD_OUTPUT, "rms_to_root"),),
    "zero_fraction": ((ACTIVATION, "zero_fraction"), (GRAD_OUTPUT, "zero_fraction")),
}
TensorKey = tuple[str, int, str, str]


def noise_floor(metric: str, *, log_scale: bool) -> float:
    """Smallest run-to-run noise assumed for ``metric``, in compared units.

    Args:
        metric: the metric name (``rms``, ``rms_to_root``, ``zero_fraction``, ...).
        log_scale: whether the metric is compared in natural log (scale metrics).

    Returns:
        0.1 (natural log, about 10%) for scale metrics; 0.02 for fractions and anything
        else. One run cannot show how much a different initialisation or data order moves
        a series' level (in the example, healthy runs with different seeds differ by up to
        about 35% in activation RMS while each run's own per-sample noise is 1-3%); the
        floor stands for that part of the run-to-run noise.

    Example:
        >>> noise_floor("rms", log_scale=True), noise_floor("zero_fraction", log_scale=False)
        (0.1, 0.02)
    """
    del metric
    return COMPARISON_LOG_FLOOR if log_scale else COMPARISON_FRACTION_FLOOR


def sustained_departure(
    departures: Sequence[float], *, persistence: int = PERSISTENCE_POINTS
) -> float:
    """The largest departure held, with one sign, over ``persistence`` consecutive points.

    Args:
        departures: signed departures (candidate minus baseline, in noise units) at the
            compared points, in time order.
        persistence: consecutive points the departure must last (at least 1).

    Returns:
        ``max`` over windows of ``persistence`` consecutive points whose departures share
        a sign of the smallest absolute departure in the window; 0.0 when there is no
        such window. A one-point spike does not count; a step that stays does.

    Example:
        >>> sustained_departure([0.0, 9.0, 0.0, 6.0, 7.0, -8.0])
        6.0
    """
    best = 0.0
    for start in range(len(departures) - persistence + 1):
        window = departures[start : start + persistence]
        if all(d > 0 for d in window) or all(d < 0 for d in window):
            best = max(best, min(abs(d) for d in window))
    return best


def _first_departure(departures: Sequence[float], threshold: float, persistence: int) -> int | None:
    """Index of the first point that starts ``persistence`` same-sign departures beyond
    ``threshold``."""
    for start in range(len(departures) - persistence + 1):
        window = departures[start : start + persistence]
        if all(d >= threshold for d in window) or all(d <= -threshold for d in window):
            return start
    return None


@dataclass(slots=True)
class _Noise:
    sigma: float
    basis: str
    parts: dict[str, float]


def _detrended_spread(times: Sequence[int], values: Sequence[float]) -> float:
    """Robust per-point noise of a trending series: the median absolute deviation of each
    point from the straight line through its two neighbours (at their own times), scaled
    to a standard deviation (``MAD_TO_STD``) and divided by sqrt(1.5), the deviation's
    standard deviation in units of the points' own for independent noise at even
    spacing. A smooth trend of any slope leaves it small, where differences between
    consecutive points would grow with the slope."""
    deviations: list[float] = []
    for i in range(1, len(values) - 1):
        t0, t1, t2 = times[i - 1], times[i], times[i + 1]
        if t2 == t0:
            continue
        line = values[i - 1] + (values[i + 1] - values[i - 1]) * (t1 - t0) / (t2 - t0)
        deviations.append(abs(values[i] - line))
    if not deviations:
        return 0.0
    return MAD_TO_STD * statistics.median(deviations) / math.sqrt(1.5)


def _noise(
    series: SeriesRow,
    metric: str,
    times: Sequence[int],
    values: Sequence[float],
    *,
    identical_before: bool = False,
) -> _Noise:
    """The run-to-run noise of one baseline series, in compared units: the largest of a
    floor, the series' own trend-residual spread, its residual volatility and the
    detrended spread of the compared points (``times`` in the comparison's axis, values
    in compared units). All but the floor follow a trend, so that a series that drifts
    steeply in early training does not hide a later step behind an inflated spread
    (files without a residual spread fall back on the warm-up standard deviation).
    ``identical_before``: the runs agreed exactly before (a same-seed pair up to their
    first difference): their difference had no noise at all until then, so the series'
    own variability over time (its trend residuals, volatility and point spread) says
    nothing about it; only a tenth of the floor applies."""
    floor = noise_floor(metric, log_scale=series.log_scale)
    if identical_before:
        floor = IDENTICAL_LOG_FLOOR if series.log_scale else IDENTICAL_FRACTION_FLOOR
        return _Noise(floor, "floor", {"floor": floor})
    parts = {
        "floor": floor,
        "residual_spread": (
            series.residual_spread
            if series.residual_spread is not None
            else series.baseline_std or 0.0
        ),
        "volatility": series.volatility or 0.0,
        "point_spread": _detrended_spread(times, values),
    }
    basis = max(parts, key=lambda k: parts[k])
    return _Noise(parts[basis], basis, parts)


@dataclass(slots=True)
class _Event:
    """A divergence: one series (or tensor) departs, stops, appears or goes non-finite."""

    key: int
    kind: str
    side: str | None
    module: str
    call_index: int
    signal: str
    tensor_path: str
    metric: str | None
    position: int
    fields: dict[str, Any]

    def order(self) -> tuple[Any, ...]:
        gradient = self.signal == GRAD_OUTPUT
        return (
            self.key,
            1 if gradient else 0,
            -self.position if gradient else self.position,
            self.module,
            self.call_index,
            self.tensor_path,
            self.metric or "",
        )


@dataclass(slots=True)
class _ValueResult:
    key: SeriesKey
    position: int
    score: float
    notable: bool
    entry: dict[str, Any]
    first_key: int | None


def _series_name(key: SeriesKey | TensorKey) -> str:
    module, call, signal, path = key[:4]
    metric = f".{key[4]}" if len(key) > 4 else ""
    return f"`{module}` call {call} {signal}{metric} ({path})"


def _difference_text(series: SeriesRow, baseline: float, candidate: float) -> str:
    if series.log_scale:
        ratio = max(candidate, TINY) / max(baseline, TINY)
        return f"{number_text(baseline)} -> {number_text(candidate)} ({number_text(ratio)}x)"
    return f"{number_text(baseline)} -> {number_text(candidate)} ({candidate - baseline:+.4g})"


def _downsample(rows: list[list[Any]], limit: int) -> list[list[Any]]:
    if len(rows) <= limit:
        return rows
    step = (len(rows) - 1) / (limit - 1)
    return [rows[round(i * step)] for i in range(limit)]


def _points(series: SeriesRow, axis: _Axis, side: str) -> dict[int, float]:
    """A series' kept points by axis key, through the compared end."""
    points = {}
    for sample, value in zip(series.samples, series.values, strict=True):
        k = axis.key(side, sample)
        if k is not None and k <= axis.end:
            points[k] = value
    return points


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _first_difference(
    baseline: SeriesFile, candidate: SeriesFile, keys: Sequence[SeriesKey], axis: _Axis
) -> int | None:
    """The first axis key at which any common series differs between the runs, when
    every common series agreed exactly at the ``MIN_IDENTICAL_POINTS`` or more compared
    points before it (a same-seed pair whose runs were identical until then); else None
    (the runs differ from the start, or never)."""
    first: int | None = None
    agreeing: set[int] = set()
    for key in keys:
        points_b = _points(baseline.series[key], axis, "baseline")
        points_c = _points(candidate.series[key], axis, "candidate")
        for k in sorted(points_b.keys() & points_c.keys()):
            if first is not None and k >= first:
                break
            if not _same(points_b[k], points_c[k]):
                first = k
                break
            agreeing.add(k)
    if first is None:
        return None
    if sum(1 for k in agreeing if k < first) < MIN_IDENTICAL_POINTS:
        return None
    return first


def _compare_values(
    key: SeriesKey,
    base: SeriesRow,
    cand: SeriesRow,
    axis: _Axis,
    threshold: float,
    warmup: tuple[int | None, int | None],
    first_difference: int | None = None,
) -> _ValueResult | None:
    points_b = _points(base, axis, "baseline")
    points_c = _points(cand, axis, "candidate")
    common = sorted(points_b.keys() & points_c.keys())
    if not common:
        return None
    compared_b = [base.compared(points_b[k]) for k in common]
    noise = _noise(base, key[4], common, compared_b)
    sigmas = [noise.sigma] * len(common)
    identical: _Noise | None = None
    if first_difference is not None:
        # The runs were identical before their first difference: there, and for the
        # persistence window after it, the departure is judged without the run-to-run
        # floor (later points, where a same-seed pair drifts apart, keep it).
        identical = _noise(base, key[4], common, compared_b, identical_before=True)
        at = [i for i, k in enumerate(common) if k >= first_difference][:PERSISTENCE_POINTS]
        for i in at:
            sigmas[i] = identical.sigma
    departures = [
        (base.compared(points_c[k]) - compared_b[i]) / sigmas[i] for i, k in enumerate(common)
    ]
    score = sustained_departure(departures)
    first = _first_departure(departures, threshold, PERSISTENCE_POINTS)
    largest = max(range(len(common)), key=lambda i: abs(departures[i]))
    notable = first is not None
    warm_b, warm_c = warmup
    entry: dict[str, Any] = {
        "module": key[0],
        "call_index": key[1],
        "signal": key[2],
        "tensor_path": key[3],
        "metric": key[4],
        "forward_position": base.forward_position,
        "notable": notable,
        "sustained_departure": round_number(score),
        "points_compared": len(common),
    }
    if first is not None:
        k = common[first]
        beyond = sum(1 for d in departures[first:] if abs(d) >= threshold)
        entry["first_divergence"] = {
            **axis.when(k),
            "last_agreeing": axis.when(common[first - 1]) if first > 0 else None,
            "baseline": round_number(points_b[k]),
            "candidate": round_number(points_c[k]),
            "departure": round_number(departures[first]),
            "noise": {
                "sigma": round_number(sigmas[first]),
                "basis": "floor at first difference"
                if identical is not None and sigmas[first] == identical.sigma
                else noise.basis,
            },
            "points_beyond_threshold_after": beyond,
            "points_after": len(common) - first,
        }
    k = common[largest]
    entry["largest"] = {
        **axis.when(k),
        "baseline": round_number(points_b[k]),
        "candidate": round_number(points_c[k]),
        "departure": round_number(departures[largest]),
    }
    noise_entry: dict[str, Any] = {
        "sigma": round_number(noise.sigma),
        "basis": noise.basis,
        "units": "natural log" if base.log_scale else "absolute",
        **{name: round_number(value) for name, value in noise.parts.items()},
    }
    entry["noise"] = noise_entry
    if identical is not None:
        noise_entry["at_first_difference"] = {
            "sigma": round_number(identical.sigma),
            "basis": identical.basis,
            "points": PERSISTENCE_POINTS,
        }
    entry["end"] = {
        "baseline_ema_fast": round_number(base.ema_fast),
        "candidate_ema_fast": round_number(cand.ema_fast),
    }
    entry["warmup_complete"] = {
        "baseline": None if warm_b is None else base.count >= warm_b,
        "candidate": None if warm_c is None else cand.count >= warm_c,
    }
    rows = [[k, round_number(points_b[k]), round_number(points_c[k])] for k in common]
    entry["points_axis"] = "sample" if axis.mode == "sample" else "forward"
    entry["points"] = _downsample(rows, POINTS_PER_ENTRY)
    return _ValueResult(
        key,
        base.forward_position,
        score,
        notable,
        entry,
        common[first] if first is not None else None,
    )


def _value_interpretation(entry: dict[str, Any], base: SeriesRow, threshold: float) -> str:
    name = _series_name(
        (
            entry["module"],
            entry["call_index"],
            entry["signal"],
            entry["tensor_path"],
            entry["metric"],
        )
    )
    noise = entry["noise"]
    first = entry.get("first_divergence")
    largest = entry["largest"]
    units = "ln" if base.log_scale else "absolute"
    noise_text = f"noise {number_text(noise['sigma'])} {units}, from {noise['basis']}"
    if first is None:
        return (
            f"{name} stays within {threshold:g} noise units of the baseline for "
            f"{PERSISTENCE_POINTS} consecutive compared points; its largest single departure "
            f"is {number_text(largest['departure'])} units at {_describe_when(largest)} "
            f"({_difference_text(base, largest['baseline'] or 0.0, largest['candidate'] or 0.0)}; "
            f"{noise_text})."
        )
    at_first = first.get("noise")
    if isinstance(at_first, dict):
        noise_text = f"noise {number_text(at_first['sigma'])} {units}, from {at_first['basis']}"
    agreeing = first.get("last_agreeing")
    after = f", after agreeing at {_describe_when(agreeing)}" if agreeing else ""
    return (
        f"{name}: the candidate departs from the baseline from {_describe_when(first)}{after}: "
        f"{_difference_text(base, first['baseline'] or 0.0, first['candidate'] or 0.0)}, "
        f"{number_text(first['departure'])} noise units ({noise_text}); "
        f"{first['points_beyond_threshold_after']} of the {first['points_after']} compared "
        f"points from there stay beyond {threshold:g} units."
    )


def _neighbour_text(
    event: _Event, neighbours: dict[tuple[str, int], TensorKey], earliest: dict[TensorKey, int]
) -> tuple[str, str | None]:
    """What the call before (activations) or after (gradients) in forward order did.

    Returns:
        A sentence, and the neighbour's name when it departed at or before ``event``
        (then ``event`` is likely its echo), else None.
    """
    gradient = event.signal == GRAD_OUTPUT
    neighbour = neighbours.get((event.signal, event.position + (1 if gradient else -1)))
    relation = (
        "the call after it in forward order (before it in the backward pass)"
        if gradient
        else "the call before it in forward order"
    )
    if neighbour is None:
        edge = "last" if gradient else "first"
        return f"It is the {edge} observed call in forward order.", None
    when = earliest.get(neighbour)
    name = f"`{neighbour[0]}` call {neighbour[1]}"
    if when is None or when > event.key:
        return (
            f"{name}, {relation}, still agrees there: the change enters at `{event.module}`.",
            None,
        )
    timing = "departs at the same point" if when == event.key else "departed earlier"
    return f"{name}, {relation}, {timing}: `{event.module}` may be its echo.", name


def _value_experiment(event: _Event, when: str, neighbour: tuple[str, str | None]) -> str:
    sentence, origin = neighbour
    if origin is not None:
        return (
            f"{sentence} Follow {origin}'s divergence first; if `{event.module}` call "
            f"{event.call_index} still departs from the baseline after {when} once {origin} "
            f"agrees, undo the modification only at `{event.module}` (same seed, data order "
            f"and precision) and compare again."
        )
    direction = (
        "downstream (later in forward order)"
        if event.signal == ACTIVATION
        else "upstream (earlier in forward order)"
    )
    return (
        f"{sentence} Rerun the candidate with the same seed, data order and precision, "
        f"undoing the modification only at `{event.module}` (its code, weights or the input "
        f"it receives); if `{event.module}` call {event.call_index} then stays within noise "
        f"of the baseline past {when}, the change there is the cause and later departures "
        f"{direction} are its echoes. Observe both runs with inject_observer(..., "
        f"sampling=1) around {when} to pin the exact training forward."
    )
