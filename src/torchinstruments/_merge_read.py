"""Reading rank reports for ``merge``, one at a time: the ``rank-NNN`` directories, and
the few numbers kept per rank, series and finding (:class:`_Accumulator`).
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._jsonio import MAX_REPORT_FILE_BYTES, float_or_none, int_or_none, read_json_object
from ._jsonio import SCHEMA as RANK_SCHEMA
from .distributed import parse_rank_directory
from .errors import ReportReadError

#: Most distinct series (and, separately, findings) compared across ranks; more are
#: counted under ``coverage.series_dropped`` / ``coverage.findings_dropped``.
MAX_KEYS_COMPARED = 20_000
#: A rank report larger than this (bytes) is unreadable: no writer of ours produces one.
MAX_SOURCE_BYTES = MAX_REPORT_FILE_BYTES
SeriesKey = tuple[str, int | None, str, str | None, str]
FindingKey = tuple[str, str, int | None, str, str | None, str]


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
