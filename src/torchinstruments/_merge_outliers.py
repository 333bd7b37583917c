"""Rank outliers for ``merge``: series values far from the other ranks' median, findings
notable on one rank that most others lack, and the findings ranks share.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ._document import round_number
from ._merge_read import SeriesKey, _Accumulator
from ._merge_stats import leave_one_out_median_mad, spread_floor
from ._metrics import MAD_TO_STD, compared_value, is_log_scale

_KIND_ORDER = {"non_finite": 0, "series_value": 1, "rank_specific_finding": 2}


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
