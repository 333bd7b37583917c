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

This module merges and bounds; its parts: ``_merge_read`` (rank directories, the
per-rank summaries), ``_merge_stats`` (leave-one-out median and MAD, rank ranges),
``_merge_outliers`` (the two outlier rules, shared findings) and ``_merge_render``
(``global-index.md``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ._document import DEFAULT_MAX_BYTES, longest_fitting_prefix
from ._jsonio import atomic_write, dumps_report
from ._merge_outliers import (
    _KIND_ORDER,
    _common_findings,
    _finding_outliers,
    _outlier_ranks,
    _outlier_sort_key,
    _series_outliers,
)
from ._merge_read import MAX_KEYS_COMPARED, MAX_SOURCE_BYTES, _Accumulator, _discover, _iter_reports
from ._merge_render import render_global_markdown
from ._merge_stats import (
    _count_ranges,
    _missing_ranges,
    leave_one_out_median_mad,
    rank_ranges,
    spread_floor,
)
from ._metrics import (
    MAD_TO_STD,
    RANK_DEFAULT_SPREAD_FLOOR,
    RANK_LOG_SPREAD_FLOOR,
    rank_spread_floors,
)
from ._validate import require_float, require_int
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


#: The note (first in ``ranks.notes``) when every rank report states world size 1.
SEPARATE_RUNS_NOTE = (
    "the {count} reports look like separate runs, not ranks of one: each states world size 1"
    " (a single-process run, rank 0); merged as ranks of one run all the same, numbered by"
    " their directories (give the world size to merge them as ranks without this note). To"
    " compare two runs, use `torchinstruments compare BASELINE CANDIDATE`"
)


# ---------------------------------------------------------------------- assembling
@dataclass(slots=True)
class _Merged:
    """Everything the global report is built from (small; lists are cut to fit)."""

    directory: str
    #: Every rank report states world size 1: separate runs, not ranks of one.
    separate_runs: bool
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
    if merged.separate_runs:
        status += (
            " These look like separate runs, not ranks of one: every report states world size 1."
        )
    if len(merged.present) < 2:
        return status + " Fewer than two readable rank reports: no rank can be compared."
    if not outlier_ranks:
        return status + " No rank departs from the others by more than the outlier rule allows."
    names = ", ".join(str(s["rank"]) for s in outlier_ranks[:8])
    more = f" and {len(outlier_ranks) - 8} more" if len(outlier_ranks) > 8 else ""
    top = outlier_ranks[0]
    return f"{status} Rank outliers: rank {names}{more}. Strongest: {top['strongest']}"


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
            "separate_runs": merged.separate_runs,
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


# ---------------------------------------------------------------------- entry point


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
            Where it is not given and every report (two or more) states world size 1,
            they are single-process runs put in ``rank-NNN`` directories: they are merged
            all the same, as many ranks as the directories say, and the global report
            says so (``ranks.separate_runs``, the first of ``ranks.notes``, the headline).
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

    # Single-process runs put in rank-NNN directories: each states world size 1 (and
    # rank 0), so the stated world size would be 1 with every directory beyond it.
    separate = (
        world_size is None
        and len(accumulator.summaries) >= 2
        and all(s.world_size == 1 and s.reported_rank in (0, None) for s in accumulator.summaries)
    )
    if separate:
        notes[:] = [n for n in notes if "holds a report of rank" not in n]
        notes.insert(0, SEPARATE_RUNS_NOTE.format(count=len(accumulator.summaries)))
    if world_size is not None:
        world, world_source = world_size, "argument"
    elif separate:
        world, world_source = max(sources) + 1, "rank directories"
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
        separate_runs=separate,
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
