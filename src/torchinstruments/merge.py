"""Merge per-rank reports (``rank_policy="all"``) into one bounded global report.

    rank-000/report.json ─┐
    rank-001/report.json ─┼─ read one at a time ─> small per-series summaries ─> global-report.json
    rank-NNN/report.json ─┘                                                  └─> global-index.md

:func:`merge_rank_reports` never holds more than one rank report in memory: each report is
parsed, reduced to a few numbers per series and finding (one float and one int per rank
per series, a capped number of series), and dropped before the next is read. It does not
wait for ranks that have not finished: it reads what is on disk (each file is replaced
atomically by its writer, so every file read is a complete report) and says which ranks
were present, missing, unreadable or truncated.

Rank outliers (see :func:`merge_rank_reports` for the rules) compare each rank with the
other ranks: a series value far from the other ranks' median, measured in their spread,
or a notable finding that most other ranks lack (a non-finite value, a drift, ...).
"""

from __future__ import annotations

import math
import os
import statistics
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ._document import DEFAULT_MAX_BYTES, longest_fitting_prefix, round_number
from ._jsonio import SCHEMA as RANK_SCHEMA
from ._jsonio import atomic_write, dumps_report, float_or_none, int_or_none, read_json_object
from ._metrics import (
    MAD_TO_STD,
    METRICS,
    RANK_DEFAULT_SPREAD_FLOOR,
    RANK_LOG_SPREAD_FLOOR,
    compared_value,
    is_log_scale,
    rank_spread_floors,
)
from ._validate import require_float, require_int
from .distributed import parse_rank_directory
from .errors import ConfigError, ReportReadError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "GLOBAL_INDEX_NAME",
    "GLOBAL_REPORT_NAME",
    "GLOBAL_SCHEMA",
    "MAD_TO_STD",
    "MAX_KEYS_COMPARED",
    "MAX_SOURCE_BYTES",
    "OUTLIER_THRESHOLD",
    "leave_one_out_median_mad",
    "merge_rank_reports",
    "rank_ranges",
    "render_global_markdown",
    "spread_floor",
]

GLOBAL_SCHEMA = "torchinstruments.global-report/1"
GLOBAL_REPORT_NAME = "global-report.json"
GLOBAL_INDEX_NAME = "global-index.md"
#: Departure, in spreads, beyond which a rank's series value is an outlier.
OUTLIER_THRESHOLD = 5.0
#: Most distinct series (and, separately, findings) compared across ranks; more are
#: counted under ``coverage.series_dropped`` / ``coverage.findings_dropped``.
MAX_KEYS_COMPARED = 20_000
#: A rank report larger than this (bytes) is unreadable: no writer of ours produces one.
MAX_SOURCE_BYTES = 16 * 1024 * 1024

_KIND_ORDER = {"non_finite": 0, "series_value": 1, "rank_specific_finding": 2}
_SECTIONS = (
    "present",
    "missing",
    "unreadable",
    "truncated",
    "notes",
    "outlier_ranks",
    "outliers",
    "disagreements",
    "common_findings",
    "per_rank",
)

SeriesKey = tuple[str, int | None, str, str | None, str]
FindingKey = tuple[str, str, int | None, str, str | None, str]

GLOBAL_PROMPT = """\
You are analysing passive telemetry merged from the ranks of one distributed PyTorch
training run (torchinstruments). Each rank wrote its own report; this global report
compares them. Cite rank, module, call index, signal, tensor path, metric and values.
Treat a rank outlier as a measurement about that rank (its data shard, its device, its
inputs), not as a property of the model. Missing, unreadable or truncated ranks limit
what can be concluded: say so. End with the narrowest experiment that would confirm or
refute your leading hypothesis (for example, swap the data shards of two ranks).
"""


# ---------------------------------------------------------------------- pure statistics
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


# ---------------------------------------------------------------------- reading
def _discover(directory: Path) -> tuple[dict[int, Path], list[str], list[dict[str, Any]]]:
    """``rank-NNN`` directories under ``directory``, by rank, naming conflicts, and the
    ``rank-NNN`` symbolic links, refused (never followed: nothing outside ``directory``
    is read)."""
    found: dict[int, Path] = {}
    notes: list[str] = []
    links: list[dict[str, Any]] = []
    with os.scandir(directory) as entries:
        listed = sorted(
            (entry.name, entry.is_symlink())
            for entry in entries
            if entry.is_symlink() or entry.is_dir(follow_symlinks=False)
        )
    for name, is_link in listed:
        rank = parse_rank_directory(name)
        if rank is None:
            continue
        if is_link:
            reason = f"{name} is a symbolic link (not followed)"
            links.append({"rank": rank, "path": str(directory / name), "reason": reason})
            continue
        if rank in found:
            notes.append(
                f"rank {rank} has two directories ({found[rank].name}, {name}); read the first"
            )
            continue
        found[rank] = directory / name
    return found, notes, links


def _load(path: Path) -> dict[str, Any]:
    """Parse one rank report; raise ``ReportReadError`` saying what is wrong with it."""
    return read_json_object(
        path,
        what="a rank report",
        max_bytes=MAX_SOURCE_BYTES,
        schema=RANK_SCHEMA,
        required={"run": dict, "coverage": dict, "findings": list},
    )


def _point_value(point: object) -> tuple[float | None, int | None]:
    if not isinstance(point, dict):
        return None, None
    return float_or_none(point.get("value")), int_or_none(point.get("sample"))


@dataclass(slots=True)
class _RankSummary:
    """What is kept of one readable rank report (a few scalars)."""

    rank: int
    path: str
    reported_rank: int | None
    world_size: int | None
    samples_seen: int | None
    forwards_seen: int | None
    notable_findings: int | None
    findings_returned: int
    errors_total: int | None
    limits_hit: tuple[str, ...]
    headline: str | None
    first_non_finite: dict[str, Any] | None

    def entry(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "path": self.path,
            "world_size": self.world_size,
            "samples_seen": self.samples_seen,
            "forwards_seen": self.forwards_seen,
            "notable_findings": self.notable_findings,
            "findings_returned": self.findings_returned,
            "errors_total": self.errors_total,
            "limits_hit": list(self.limits_hit),
            "first_non_finite": self.first_non_finite,
            "headline": self.headline,
        }


@dataclass(slots=True)
class _SeriesValues:
    """Latest value (and its sample) of one series on each rank that listed it."""

    ranks: array[int] = field(default_factory=lambda: array("i"))
    values: array[float] = field(default_factory=lambda: array("d"))
    samples: array[int] = field(default_factory=lambda: array("q"))


@dataclass(slots=True)
class _FindingAcross:
    """One (category, series) finding on each rank that listed it."""

    basis: str
    ranks: array[int] = field(default_factory=lambda: array("i"))
    notable: array[int] = field(default_factory=lambda: array("b"))
    values: array[float] = field(default_factory=lambda: array("d"))
    onsets: array[int] = field(default_factory=lambda: array("q"))


class _Accumulator:
    """Small summaries of the rank reports read so far (one report at a time)."""

    def __init__(self) -> None:
        self.summaries: list[_RankSummary] = []
        self.series: dict[SeriesKey, _SeriesValues] = {}
        self.findings: dict[FindingKey, _FindingAcross] = {}
        #: Per category: ranks whose report lists every candidate of it (nothing omitted).
        self.complete: dict[str, set[int]] = {}
        self.series_dropped = 0
        self.findings_dropped = 0

    def add(self, rank: int, path: str, report: dict[str, Any]) -> None:
        run, coverage = report["run"], report["coverage"]
        raw_summary = report.get("summary")
        summary: dict[str, Any] = raw_summary if isinstance(raw_summary, dict) else {}
        headline = summary.get("headline")
        limits = coverage.get("limits_hit")
        limits_hit = tuple(str(x) for x in limits) if isinstance(limits, list) else ()
        first_nf = summary.get("first_non_finite")
        findings = [f for f in report["findings"] if isinstance(f, dict)]
        self.summaries.append(
            _RankSummary(
                rank=rank,
                path=path,
                reported_rank=int_or_none(run.get("rank")),
                world_size=int_or_none(run.get("world_size")),
                samples_seen=int_or_none(run.get("samples_seen")),
                forwards_seen=int_or_none(run.get("forwards_seen")),
                notable_findings=int_or_none(summary.get("notable_findings")),
                findings_returned=len(findings),
                errors_total=int_or_none(coverage.get("errors_total")),
                limits_hit=limits_hit,
                headline=headline if isinstance(headline, str) else None,
                first_non_finite=first_nf if isinstance(first_nf, dict) else None,
            )
        )
        omitted = coverage.get("findings_omitted")
        if isinstance(omitted, dict):
            for category, counts in omitted.items():
                # Complete: no finding left out by top-k or bytes (rows below the noise
                # floor past the few listed, "not_notable", are not evidence).
                left_out = (
                    (counts.get(k) for k in ("by_top_k", "by_bytes"))
                    if isinstance(counts, dict)
                    else ()
                )
                if isinstance(counts, dict) and not any(int_or_none(v) for v in left_out):
                    self.complete.setdefault(str(category), set()).add(rank)
        seen_series: set[SeriesKey] = set()
        seen_findings: set[FindingKey] = set()
        for finding in findings:
            self._add_finding(rank, finding, seen_series, seen_findings)

    def _add_finding(
        self,
        rank: int,
        finding: dict[str, Any],
        seen_series: set[SeriesKey],
        seen_findings: set[FindingKey],
    ) -> None:
        category, module = finding.get("category"), finding.get("module")
        signal, metric = finding.get("signal"), finding.get("metric")
        if not all(isinstance(x, str) for x in (category, module, signal, metric)):
            return
        path = finding.get("tensor_path")
        key: SeriesKey = (
            str(module),
            int_or_none(finding.get("call_index")),
            str(signal),
            path if isinstance(path, str) else None,
            str(metric),
        )
        latest, sample = _point_value(finding.get("latest"))
        if latest is not None and key not in seen_series:
            seen_series.add(key)
            values = self.series.get(key)
            if values is None and len(self.series) >= MAX_KEYS_COMPARED:
                self.series_dropped += 1
            else:
                if values is None:
                    values = self.series[key] = _SeriesValues()
                values.ranks.append(rank)
                values.values.append(latest)
                values.samples.append(sample if sample is not None else -1)
        finding_key: FindingKey = (str(category), *key)
        if finding_key in seen_findings:
            return
        seen_findings.add(finding_key)
        ranking = finding.get("ranking")
        ranking = ranking if isinstance(ranking, dict) else {}
        across = self.findings.get(finding_key)
        if across is None:
            if len(self.findings) >= MAX_KEYS_COMPARED:
                self.findings_dropped += 1
                return
            across = self.findings[finding_key] = _FindingAcross(basis=str(ranking.get("basis")))
        evidence = finding.get("evidence")
        onset = (
            int_or_none(evidence.get("first_nonfinite_sample"))
            if isinstance(evidence, dict)
            else None
        )
        value = float_or_none(ranking.get("value"))
        across.ranks.append(rank)
        across.notable.append(1 if finding.get("notable") is True else 0)
        across.values.append(value if value is not None else math.nan)
        across.onsets.append(onset if onset is not None else -1)


# ---------------------------------------------------------------------- outliers
def _series_fields(key: SeriesKey) -> dict[str, Any]:
    module, call_index, signal, tensor_path, metric = key
    return {
        "module": module,
        "call_index": call_index,
        "signal": signal,
        "tensor_path": tensor_path,
        "metric": metric,
    }


def _where(key: SeriesKey) -> str:
    module, call_index, signal, tensor_path, metric = key
    call = "" if call_index is None else f"call {call_index}"
    detail = ", ".join(x for x in (call, tensor_path or "") if x)
    return f"{module}" + (f" ({detail})" if detail else "") + f" {signal}.{metric}"


def _series_outliers(
    accumulator: _Accumulator, threshold: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Series-value outliers (three or more ranks) and two-rank disagreements."""
    outliers: list[dict[str, Any]] = []
    disagreements: list[dict[str, Any]] = []
    for key, held in accumulator.series.items():
        count = len(held.ranks)
        if count < 2:
            continue
        metric = key[4]
        floor = spread_floor(metric)
        log_scale = is_log_scale(metric)
        compared = [compared_value(metric, v) for v in held.values]
        if count == 2:
            gap = abs(compared[0] - compared[1]) / floor
            if gap > threshold:
                disagreements.append(
                    {
                        **_series_fields(key),
                        "ranks": list(held.ranks),
                        "values": [round_number(v) for v in held.values],
                        "samples": list(held.samples),
                        "departure": round_number(gap),
                        "interpretation": (
                            f"{_where(key)}: rank {held.ranks[0]} has {held.values[0]:.4g} and "
                            f"rank {held.ranks[1]} has {held.values[1]:.4g}, {gap:.1f} floor "
                            f"spreads apart; with two ranks their values alone cannot name the odd "
                            f"one."
                        ),
                    }
                )
            continue
        for index, (median, mad) in enumerate(leave_one_out_median_mad(compared)):
            spread = max(MAD_TO_STD * mad, floor)
            departure = abs(compared[index] - median) / spread
            if departure <= threshold:
                continue
            rank, value = held.ranks[index], held.values[index]
            median_value = math.exp(median) if log_scale else median
            factor = math.exp(compared[index] - median) if log_scale else None
            relation = (
                f"{factor:.3g}x the other ranks' median {median_value:.4g}"
                if factor is not None
                else f"against the other ranks' median {median_value:.4g}"
            )
            outliers.append(
                {
                    "kind": "series_value",
                    "rank": rank,
                    **_series_fields(key),
                    "value": round_number(value),
                    "sample": held.samples[index],
                    "others_median": round_number(median_value),
                    "others_spread": round_number(spread),
                    "spread_units": "natural log" if log_scale else metric,
                    "departure": round_number(departure),
                    "ranks_compared": count,
                    "interpretation": (
                        f"On rank {rank}, {_where(key)} was {value:.4g} at sample "
                        f"{held.samples[index]}: {relation}, {departure:.1f} spreads away "
                        f"(spread {spread:.3g}{' in natural log' if log_scale else ''}; "
                        f"threshold {threshold:g})."
                    ),
                }
            )
    return outliers, disagreements


def _finding_outliers(accumulator: _Accumulator) -> list[dict[str, Any]]:
    """Notable findings that more than half of the comparable other ranks lack."""
    outliers: list[dict[str, Any]] = []
    readable_count = len(accumulator.summaries)
    for finding_key, across in accumulator.findings.items():
        notable = [i for i, flag in enumerate(across.notable) if flag]
        if not notable or readable_count < 2:
            continue
        category, key = finding_key[0], finding_key[1:]
        complete = accumulator.complete.get(category, set())
        listed = set(across.ranks)
        # Comparable: every other rank that lists this finding, or whose report lists
        # every candidate of this category (so not listing it means it has none).
        comparable_total = len(listed) + len(complete - listed)
        others_values = [
            across.values[i]
            for i in range(len(across.ranks))
            if not across.notable[i] and math.isfinite(across.values[i])
        ]
        for index in notable:
            rank = across.ranks[index]
            comparable = comparable_total - 1
            lacking = comparable - (len(notable) - 1)
            if comparable < 1 or 2 * lacking <= comparable:
                continue
            value = across.values[index]
            kind = "non_finite" if category == "non_finite" else "rank_specific_finding"
            onset = across.onsets[index]
            entry: dict[str, Any] = {
                "kind": kind,
                "rank": rank,
                "category": category,
                **_series_fields(key),  # type: ignore[arg-type]
                "ranking": {"basis": across.basis, "value": round_number(value)},
                "notable_on_ranks": len(notable),
                "lacking_on_ranks": lacking,
                "ranks_compared": comparable,
            }
            if kind == "non_finite" and onset >= 0:
                entry["first_nonfinite_sample"] = onset
            elif others_values:
                entry["others_median_ranking_value"] = round_number(
                    statistics.median(others_values)
                )
            what = (
                f"non-finite values from sample {onset}"
                if kind == "non_finite" and onset >= 0
                else f"a notable {category} finding ({across.basis} = {value:.4g})"
            )
            entry["interpretation"] = (
                f"On rank {rank}, {_where(key)} has {what}; {lacking} of the {comparable} "
                f"other ranks that could show it lack it."
            )
            outliers.append(entry)
    return outliers


def _strength(entry: dict[str, Any]) -> float:
    if entry["kind"] == "series_value":
        return float(entry["departure"] or 0.0)
    return float(entry["lacking_on_ranks"]) / max(float(entry["ranks_compared"]), 1.0)


def _outlier_sort_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    return (
        _KIND_ORDER[entry["kind"]],
        -_strength(entry),
        entry["rank"],
        entry.get("category", ""),
        entry["module"],
        entry["call_index"] if entry["call_index"] is not None else -1,
        entry["signal"],
        entry["tensor_path"] or "",
        entry["metric"],
    )


def _outlier_ranks(outliers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per outlier rank: counts per kind, its strongest outlier, what to try."""
    counts: dict[int, dict[str, int]] = {}
    strongest: dict[int, str] = {}
    for entry in outliers:  # already sorted: the first entry of a rank is its strongest
        rank = entry["rank"]
        if rank not in counts:
            counts[rank] = dict.fromkeys(_KIND_ORDER, 0)
            strongest[rank] = entry["interpretation"]
        counts[rank][entry["kind"]] += 1
    order = sorted(
        counts,
        key=lambda r: (
            -counts[r]["non_finite"],
            -(counts[r]["series_value"] + counts[r]["rank_specific_finding"]),
            r,
        ),
    )
    return [
        {
            "rank": rank,
            **counts[rank],
            "strongest": strongest[rank],
            "next_experiment": (
                f"Compare rank {rank}'s inputs with another rank's at the same samples (data "
                f"shard, preprocessing, device); then swap the two ranks' data shards, same "
                f"seed: if the outlier follows the shard, the data is the cause, if it stays on "
                f"rank {rank}, its device or process is."
            ),
        }
        for rank in order
    ]


def _common_findings(accumulator: _Accumulator) -> list[dict[str, Any]]:
    """Per (category, series): on how many ranks it was listed and notable, strongest where."""
    rows = []
    for finding_key, across in accumulator.findings.items():
        best = max(
            range(len(across.ranks)),
            key=lambda i: (
                across.values[i] if math.isfinite(across.values[i]) else -math.inf,
                -across.ranks[i],
            ),
        )
        rows.append(
            (
                -sum(across.notable),
                -len(across.ranks),
                finding_key[0],
                -across.values[best] if math.isfinite(across.values[best]) else math.inf,
                finding_key,
                across,
                best,
            )
        )
    rows.sort(key=lambda row: (*row[:4], tuple("" if x is None else str(x) for x in row[4])))
    out = []
    for _, _, category, _, finding_key, across, best in rows:
        out.append(
            {
                "category": category,
                **_series_fields(finding_key[1:]),  # type: ignore[arg-type]
                "listed_on_ranks": len(across.ranks),
                "notable_on_ranks": sum(across.notable),
                "basis": across.basis,
                "strongest": {
                    "rank": across.ranks[best],
                    "value": round_number(across.values[best]),
                },
            }
        )
    return out


# ---------------------------------------------------------------------- assembling
@dataclass(slots=True)
class _Merged:
    """Everything the global report is built from (small; lists are cut to fit)."""

    directory: str
    world_size: int | None
    world_size_source: str
    present: list[int]
    #: Ranges (``"4-7"``) of the ranks in ``0 .. world_size - 1`` without a report, and
    #: how many ranks they hold (counted, never enumerated: a world size can be huge).
    missing: list[str]
    missing_count: int
    unreadable: list[dict[str, Any]]
    truncated: list[dict[str, Any]]
    notes: list[str]
    outliers: list[dict[str, Any]]
    disagreements: list[dict[str, Any]]
    common_findings: list[dict[str, Any]]
    per_rank: list[dict[str, Any]]
    threshold: float
    series_compared: int
    series_dropped: int
    findings_compared: int
    findings_dropped: int
    samples_seen: list[int]

    def sections(self) -> dict[str, list[Any]]:
        return {
            "present": rank_ranges(self.present),
            "missing": self.missing,
            "unreadable": self.unreadable,
            "truncated": self.truncated,
            "notes": self.notes,
            "outlier_ranks": _outlier_ranks(self.outliers),
            "outliers": self.outliers,
            "disagreements": self.disagreements,
            "common_findings": self.common_findings,
            "per_rank": self.per_rank,
        }


def _headline(merged: _Merged, outlier_ranks: Sequence[dict[str, Any]]) -> str:
    expected = merged.world_size
    parts = [
        f"{len(merged.present)} of {expected if expected is not None else '?'} ranks present",
    ]
    if merged.missing_count:
        parts.append(f"{merged.missing_count} missing")
    if merged.unreadable:
        parts.append(f"{len(merged.unreadable)} unreadable")
    truncated = sum(_count_ranges(group["ranks"]) for group in merged.truncated)
    if truncated:
        parts.append(f"{truncated} truncated")
    status = ", ".join(parts) + "."
    if len(merged.present) < 2:
        return status + " Fewer than two readable rank reports: no rank can be compared."
    if not outlier_ranks:
        return status + " No rank departs from the others by more than the outlier rule allows."
    names = ", ".join(str(s["rank"]) for s in outlier_ranks[:8])
    more = f" and {len(outlier_ranks) - 8} more" if len(outlier_ranks) > 8 else ""
    top = outlier_ranks[0]
    return f"{status} Rank outliers: rank {names}{more}. Strongest: {top['strongest']}"


def _count_ranges(ranges: Sequence[str]) -> int:
    total = 0
    for text in ranges:
        low, _, high = text.partition("-")
        total += (int(high) if high else int(low)) - int(low) + 1
    return total


def _assemble(merged: _Merged, keep: int, generated_at: str) -> dict[str, Any]:
    full = merged.sections()
    cut = {name: items[:keep] for name, items in full.items()}
    omitted = {name: len(full[name]) - len(cut[name]) for name in _SECTIONS}
    limits_hit = []
    if any(omitted.values()):
        limits_hit.append("max_bytes")
    if merged.series_dropped or merged.findings_dropped:
        limits_hit.append("max_keys_compared")
    outlier_counts = {kind: 0 for kind in _KIND_ORDER}
    for entry in merged.outliers:
        outlier_counts[entry["kind"]] += 1
    truncated_count = sum(_count_ranges(group["ranks"]) for group in merged.truncated)
    return {
        "schema": GLOBAL_SCHEMA,
        "generated_at": generated_at,
        "source_directory": merged.directory,
        "ranks": {
            "world_size": merged.world_size,
            "world_size_source": merged.world_size_source,
            "present_count": len(merged.present),
            "missing_count": merged.missing_count,
            "unreadable_count": len(merged.unreadable),
            "truncated_count": truncated_count,
            "present": cut["present"],
            "missing": cut["missing"],
            "unreadable": cut["unreadable"],
            "truncated": cut["truncated"],
            "notes": cut["notes"],
        },
        "summary": {
            "headline": _headline(merged, full["outlier_ranks"]),
            "outlier_rank_count": len(full["outlier_ranks"]),
            "outlier_ranks": rank_ranges(sorted(s["rank"] for s in full["outlier_ranks"]))[:keep],
            "samples_seen": (
                {"min": min(merged.samples_seen), "max": max(merged.samples_seen)}
                if merged.samples_seen
                else None
            ),
        },
        "outlier_rule": {
            "series_value": (
                "x = latest value (natural log for scale metrics); m, MAD = median and median "
                "absolute deviation of the other ranks' x; departure = |x - m| / max(1.4826 MAD, "
                "floor); outlier if departure > threshold; needs 3 or more ranks"
            ),
            "rank_specific_finding": (
                "notable on this rank and not notable on more than half of the other ranks "
                "that list it or list every candidate of its category"
            ),
            "threshold": merged.threshold,
            "spread_floors": {
                "scale metrics (natural log)": RANK_LOG_SPREAD_FLOOR,
                **rank_spread_floors(),
                "other": RANK_DEFAULT_SPREAD_FLOOR,
            },
        },
        "outlier_ranks": cut["outlier_ranks"],
        "outliers": cut["outliers"],
        "disagreements": cut["disagreements"],
        "common_findings": cut["common_findings"],
        "per_rank": cut["per_rank"],
        "coverage": {
            "rank_reports_read": len(merged.per_rank),
            "series_compared": merged.series_compared,
            "series_dropped": merged.series_dropped,
            "findings_compared": merged.findings_compared,
            "findings_dropped": merged.findings_dropped,
            "outliers_found": outlier_counts,
            "disagreements_found": len(merged.disagreements),
            "omitted_by_bytes": omitted,
            "limits_hit": limits_hit,
        },
    }


def _bounded(merged: _Merged, max_bytes: int) -> dict[str, Any]:
    """The largest per-section prefix (same length for every list) that fits ``max_bytes``."""
    generated_at = datetime.now(UTC).isoformat(timespec="seconds")
    longest = max((len(items) for items in merged.sections().values()), default=0)
    best = longest_fitting_prefix(
        lambda keep: _assemble(merged, keep, generated_at), longest, max_bytes
    )
    if len(dumps_report(best)) > max_bytes:  # not even with every list empty
        raise ConfigError(
            f"merge_rank_reports: max_bytes must leave room for the report skeleton, "
            f"got {max_bytes} < {len(dumps_report(best))} bytes"
        )
    return best


# ---------------------------------------------------------------------- markdown
def render_global_markdown(report: dict[str, Any]) -> str:
    """Render a global report dict as ``global-index.md`` for people.

    Args:
        report: a dict as written to ``global-report.json``.

    Returns:
        Markdown text: ranks present, missing, unreadable and truncated; rank outliers;
        the findings most ranks share; one line per rank; a prompt for an LLM.
    """
    ranks, summary, coverage = report["ranks"], report["summary"], report["coverage"]
    world = ranks["world_size"] if ranks["world_size"] is not None else "unknown"
    lines = [
        "# torchinstruments global report",
        "",
        f"Merged from `{report['source_directory']}`; world size {world} "
        f"(from {ranks['world_size_source']}); generated {report['generated_at']}.",
        "",
        "## Summary",
        "",
        summary["headline"],
        "",
        "## Ranks",
        "",
        f"- Present ({ranks['present_count']}): {', '.join(ranks['present']) or 'none'}.",
        f"- Missing, no `rank-NNN/report.json` ({ranks['missing_count']}): "
        f"{', '.join(ranks['missing']) or 'none'}.",
        f"- Unreadable ({ranks['unreadable_count']}): "
        + ("; ".join(f"rank {u['rank']}: {u['reason']}" for u in ranks["unreadable"]) or "none")
        + ".",
        f"- Truncated sources, whose own limits removed evidence ({ranks['truncated_count']}): "
        + (
            "; ".join(
                f"ranks {', '.join(t['ranks'])} ({', '.join(t['limits_hit'])})"
                for t in ranks["truncated"]
            )
            or "none"
        )
        + ".",
    ]
    lines += [f"- Note: {note}" for note in ranks["notes"]]
    lines.append("")
    if report["outlier_ranks"]:
        lines += ["## Rank outliers", ""]
        for entry in report["outlier_ranks"]:
            lines += [
                f"### Rank {entry['rank']}",
                "",
                f"{entry['non_finite']} non-finite, {entry['series_value']} series-value and "
                f"{entry['rank_specific_finding']} rank-specific-finding outliers. Strongest: "
                f"{entry['strongest']}",
                "",
                f"- Next experiment: {entry['next_experiment']}",
                "",
            ]
        lines += [
            "| kind | rank | category | series | departure, or other ranks lacking it |",
            "| --- | --- | --- | --- | --- |",
        ]
        for entry in report["outliers"][:40]:
            where = (
                f"`{entry['module']}` call {entry['call_index']} "
                f"{entry['signal']}.{entry['metric']}"
            )
            strength = (
                f"{entry['departure']} spreads"
                if entry["kind"] == "series_value"
                else f"{entry['lacking_on_ranks']} of {entry['ranks_compared']}"
            )
            lines.append(
                f"| {entry['kind']} | {entry['rank']} | {entry.get('category', '')} | {where} "
                f"| {strength} |"
            )
        lines.append("")
    if report["disagreements"]:
        lines += ["## Two-rank disagreements (values alone cannot name the odd rank)", ""]
        for entry in report["disagreements"][:20]:
            lines.append(f"- {entry['interpretation']}")
        lines.append("")
    if report["common_findings"]:
        lines += [
            "## Findings across ranks",
            "",
            "| category | series | notable on | listed on | strongest (rank: value) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for entry in report["common_findings"][:30]:
            strongest = entry["strongest"]
            lines.append(
                f"| {entry['category']} | `{entry['module']}` call {entry['call_index']} "
                f"{entry['signal']}.{entry['metric']} | {entry['notable_on_ranks']} "
                f"| {entry['listed_on_ranks']} | {strongest['rank']}: {strongest['value']} |"
            )
        lines.append("")
    if report["per_rank"]:
        lines += [
            "## Per rank",
            "",
            "| rank | samples | notable findings | hook errors | limits hit |",
            "| --- | --- | --- | --- | --- |",
        ]
        for entry in report["per_rank"]:
            lines.append(
                f"| {entry['rank']} | {entry['samples_seen']} | {entry['notable_findings']} "
                f"| {entry['errors_total']} | {', '.join(entry['limits_hit']) or 'none'} |"
            )
        lines.append("")
    omitted = {k: v for k, v in coverage["omitted_by_bytes"].items() if v}
    lines += [
        "## Coverage and limits",
        "",
        f"- Rank reports read: {coverage['rank_reports_read']}; series compared: "
        f"{coverage['series_compared']} ({coverage['series_dropped']} dropped); findings "
        f"compared: {coverage['findings_compared']} ({coverage['findings_dropped']} dropped).",
        f"- Left out to fit the byte bound: {omitted or 'nothing'}.",
        "",
        "## Outlier rule",
        "",
        f"- Series value: {report['outlier_rule']['series_value']} "
        f"(threshold {report['outlier_rule']['threshold']}).",
        f"- Rank-specific finding: {report['outlier_rule']['rank_specific_finding']}.",
        "",
        "## Prompt for an LLM",
        "",
        "Send `global-report.json` (and the `rank-NNN/report.json` of any outlier rank) with "
        "this prompt:",
        "",
        "```text",
        GLOBAL_PROMPT.rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- entry point
def _iter_reports(
    sources: dict[int, Path], unreadable: list[dict[str, Any]], missing_files: list[int]
) -> Iterator[tuple[int, Path, dict[str, Any]]]:
    """Yield ``(rank, path, report)`` per readable report, one parsed report at a time.

    Ranks without ``report.json`` go to ``missing_files``; unreadable ones to
    ``unreadable`` with the reason.
    """
    for rank in sorted(sources):
        path = sources[rank] / "report.json"
        if not os.path.lexists(path):
            missing_files.append(rank)
            continue
        try:
            report = _load(path)
        except ReportReadError as error:
            unreadable.append(
                {"rank": rank, "path": str(path), "reason": str(error).removeprefix(f"{path}: ")}
            )
            continue
        yield rank, path, report
        del report  # before the next parse: one rank report in memory at a time


def merge_rank_reports(
    directory: str | os.PathLike[str],
    *,
    output_dir: str | os.PathLike[str] | None = None,
    world_size: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    threshold: float = OUTLIER_THRESHOLD,
) -> Path:
    """Merge the ``rank-NNN/report.json`` files under ``directory`` into a global report.

    Reads one rank report at a time and keeps only a few numbers per series and finding,
    so memory stays near one report's size whatever the number of ranks. Writes
    ``global-report.json`` (at most ``max_bytes`` bytes as written, indented UTF-8 JSON:
    lists are cut to the longest common prefix that fits and what was left out is counted
    under ``coverage.omitted_by_bytes``) and ``global-index.md``, atomically. Does not wait
    for ranks that have not written yet.

    The global report states the ranks present, missing (no report in ``0 ..
    world_size - 1``), unreadable (not JSON, not a rank report, too large) and truncated
    (the rank report's ``coverage.limits_hit`` is not empty), and names rank outliers by
    two rules:

    - **Series value** (needs three or more ranks listing the series). For each series
      ``(module, call_index, signal, tensor_path, metric)`` in the rank reports' findings,
      ``x_r`` is its ``latest`` value on rank ``r`` (``ln`` of it for scale metrics:
      ``rms``, ``mean_abs``, ``max_abs``, ``tail_ratio``, ``rms_to_root``,
      ``loss_scale``). With ``m_r`` and ``MAD_r`` the median and the median absolute
      deviation of the *other* ranks' values (leave-one-out, so the outlier does not
      inflate its own yardstick)::

          departure_r = |x_r - m_r| / max(1.4826 * MAD_r, floor(metric))

      and rank ``r`` is an outlier on that series when ``departure_r > threshold``
      (default 5). ``1.4826 * MAD`` estimates a standard deviation robustly; the floor
      (:func:`spread_floor`: 0.1 in natural log, about 10%, for scale metrics) keeps
      batch-to-batch noise from counting when the other ranks agree by chance. With
      exactly two ranks the odd one cannot be told apart: a gap above ``threshold``
      floors is listed under ``disagreements`` with both ranks.
    - **Rank-specific finding** (two or more ranks). A finding that is notable on rank
      ``r`` (above its rule's noise floor) is a rank outlier when more than half of the
      other ranks that could show it do not have it notable. A rank could show it when
      it lists that finding, or when its report omitted no candidate of that category
      (so not listing it means it has none). Non-finite values on one rank (kind
      ``non_finite``) are the prime case.

    Args:
        directory: the ``output_dir`` given to ``inject_observer(...,
            rank_policy="all")``, holding ``rank-NNN/`` directories.
        output_dir: where to write the two files. Default: ``directory``.
        world_size: the expected number of ranks. Default: the world size most rank
            reports state (``run.world_size``), else the highest rank directory plus one.
        max_bytes: bound on ``global-report.json`` in bytes, at least 4,096. Default
            256,000 (as ``ReportConfig.max_bytes``).
        threshold: series-value departure, in spreads, beyond which a rank is an outlier.
            Default 5.0.

    Returns:
        The path of ``global-report.json``.

    Raises:
        ReportReadError: ``directory`` is not a directory, or holds no ``rank-NNN``
            directory (a single report written with ``rank_policy="rank0"`` has nothing
            to merge).
        ConfigError: ``world_size``, ``max_bytes`` or ``threshold`` is out of range.
        OSError: the output files cannot be written.

    Example:
        >>> path = merge_rank_reports("stats")  # doctest: +SKIP
        >>> path.name  # doctest: +SKIP
        'global-report.json'
    """
    if not isinstance(directory, str | os.PathLike) or str(directory) == "":
        raise ConfigError(
            f"merge_rank_reports: directory must be a non-empty path, got {directory!r}"
        )
    if world_size is not None:
        require_int("merge_rank_reports", "world_size", world_size, minimum=1)
    require_int("merge_rank_reports", "max_bytes", max_bytes, minimum=4_096)
    limit = require_float(
        "merge_rank_reports", "threshold", threshold, minimum=0.0, exclusive_minimum=True
    )
    source = Path(directory)
    if not source.is_dir():
        raise ReportReadError(
            f"merge_rank_reports: directory must be an existing directory of rank-NNN "
            f"reports, got {str(source)!r} (not a directory)"
        )
    sources, notes, links = _discover(source)
    if not sources and not links:
        raise ReportReadError(
            f"merge_rank_reports: directory must hold rank-NNN/ directories written with "
            f"rank_policy='all', got {str(source)!r} with none"
        )

    accumulator = _Accumulator()
    unreadable: list[dict[str, Any]] = [link for link in links if link["rank"] not in sources]
    no_report: list[int] = []
    stated_world: dict[int, int] = {}
    for rank, path, report in _iter_reports(sources, unreadable, no_report):
        accumulator.add(rank, str(path), report)
        del report
        summary = accumulator.summaries[-1]
        if summary.world_size is not None:
            stated_world[summary.world_size] = stated_world.get(summary.world_size, 0) + 1
        if summary.reported_rank is not None and summary.reported_rank != rank:
            notes.append(
                f"{sources[rank].name} holds a report of rank {summary.reported_rank}; "
                f"merged as rank {rank}"
            )

    if world_size is not None:
        world, world_source = world_size, "argument"
    elif stated_world:
        world = max(stated_world, key=lambda w: (stated_world[w], w))
        world_source = "reports"
    else:
        world, world_source = max(sources) + 1, "rank directories"
    if len(stated_world) > 1:
        notes.append(
            "rank reports state different world sizes: "
            + ", ".join(f"{w} ({n} reports)" for w, n in sorted(stated_world.items()))
        )
    if no_report:
        notes.append(
            "rank directories without report.json (not finished yet, or stopped before the "
            f"first write): {', '.join(rank_ranges(no_report))}"
        )
    beyond = [rank for rank in sources if rank >= world]
    if beyond:
        notes.append(
            f"rank directories beyond world size {world}: {', '.join(rank_ranges(sorted(beyond)))}"
        )

    present = [s.rank for s in accumulator.summaries]
    accounted = set(present) | {u["rank"] for u in unreadable}
    missing_count, missing = _missing_ranges(accounted, world)
    truncated_groups: dict[tuple[str, ...], list[int]] = {}
    for summary in accumulator.summaries:
        if summary.limits_hit:
            truncated_groups.setdefault(tuple(sorted(summary.limits_hit)), []).append(summary.rank)
    truncated = [
        {"limits_hit": list(limits), "ranks": rank_ranges(ranks)}
        for limits, ranks in sorted(truncated_groups.items())
    ]

    series_outliers, disagreements = _series_outliers(accumulator, limit)
    outliers = sorted(series_outliers + _finding_outliers(accumulator), key=_outlier_sort_key)
    disagreements.sort(key=lambda e: (-(e["departure"] or 0.0), e["module"], e["metric"]))
    merged = _Merged(
        directory=str(source),
        world_size=world,
        world_size_source=world_source,
        present=present,
        missing=missing,
        missing_count=missing_count,
        unreadable=unreadable,
        truncated=truncated,
        notes=notes,
        outliers=outliers,
        disagreements=disagreements,
        common_findings=_common_findings(accumulator),
        per_rank=[s.entry() for s in accumulator.summaries],
        threshold=limit,
        series_compared=len(accumulator.series),
        series_dropped=accumulator.series_dropped,
        findings_compared=len(accumulator.findings),
        findings_dropped=accumulator.findings_dropped,
        samples_seen=[s.samples_seen for s in accumulator.summaries if s.samples_seen is not None],
    )
    report = _bounded(merged, max_bytes)
    target = Path(output_dir) if output_dir is not None else source
    report_path = target / GLOBAL_REPORT_NAME
    atomic_write(report_path, dumps_report(report))
    atomic_write(target / GLOBAL_INDEX_NAME, render_global_markdown(report).encode())
    return report_path
