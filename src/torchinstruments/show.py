"""The terminal view of a report (``torchinstruments show DIR``).

What ``coverage report`` is to coverage.py: the headline, the notable findings in a few
lines each, and the coverage and limits, read from ``report.json`` (one process, or one
rank) or ``global-report.json`` (written by ``torchinstruments merge``). Only the
standard library: it reads JSON and does not import torch.

Every string of the report is written on one line with control characters escaped
(:func:`~torchinstruments._jsonio.one_line`), so a module name cannot move the cursor or
forge lines; every field is read defensively, so a report of another version or a
damaged one shows what it holds and ``?`` where a field is missing or of another type.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._jsonio import MAX_REPORT_FILE_BYTES, SCHEMA, int_or_none, one_line, read_json_object
from .errors import ReportReadError
from .merge import GLOBAL_REPORT_NAME, GLOBAL_SCHEMA

__all__ = [
    "MAX_NOTABLE_SHOWN",
    "REPORT_NAME",
    "WIDTH",
    "render_global_text",
    "render_report_text",
    "show_directory",
]

REPORT_NAME = "report.json"
#: Notable findings shown (the report's order: round-robin over categories, strongest
#: first); the rest are counted.
MAX_NOTABLE_SHOWN = 10
#: Width that text is wrapped to, in characters.
WIDTH = 100
#: Entries shown of each list of a global report (outliers, common findings, ...).
_MAX_LIST_SHOWN = 5
_UNKNOWN = "?"


def _text(value: object, limit: int = 300) -> str:
    """A field as one safe line: strings escaped, numbers with 6 significant digits."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if value is None:
        return _UNKNOWN
    return one_line(str(value), limit)


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _wrapped(text: str, indent: str, lines: int = 2) -> list[str]:
    """``text`` wrapped to :data:`WIDTH` with ``indent``, at most ``lines`` lines."""
    return textwrap.wrap(
        text,
        width=WIDTH,
        initial_indent=indent,
        subsequent_indent=indent,
        max_lines=lines,
        placeholder=" ...",
    ) or [indent.rstrip()]


def _point(point: object) -> str:
    entry = _dict(point)
    return f"{_text(entry.get('value'))} @{_text(entry.get('sample'))}"


def _series_name(entry: dict[str, Any]) -> str:
    """``module`` call N signal.metric (path), as far as the entry says."""
    module = _text(entry.get("module"), 120)
    call = int_or_none(entry.get("call_index"))
    signal, metric = _text(entry.get("signal"), 40), entry.get("metric")
    path = entry.get("tensor_path")
    where = f"`{module}`" + (f" call {call}" if call is not None else "")
    measured = f"{signal}.{_text(metric, 40)}" if isinstance(metric, str) else signal
    suffix = f" ({_text(path, 80)})" if isinstance(path, str) else ""
    return f"{where} {measured}{suffix}"


def _facts_and_texts(
    entry: dict[str, Any], facts: list[str], *, interpretation_lines: int
) -> list[str]:
    """The facts (with the warm-up caveat), the interpretation and the next experiment of
    a finding or event, wrapped and indented."""
    if entry.get("warmup_complete") is False:
        facts.append("warm-up not complete (weak evidence)")
    lines = _wrapped("; ".join(facts), "     ", 2)
    interpretation = entry.get("interpretation")
    if isinstance(interpretation, str):
        lines += _wrapped(one_line(interpretation, 2000), "     ", interpretation_lines)
    experiment = entry.get("next_experiment")
    if isinstance(experiment, str):
        lines += _wrapped("next: " + one_line(experiment, 2000), "     ", 1)
    return lines


def _finding_lines(number: int, finding: dict[str, Any]) -> list[str]:
    """A notable finding in at most five lines."""
    category = _text(finding.get("category"), 60)
    lines = [f"{number:>3}. {category} #{_text(finding.get('rank'))}: {_series_name(finding)}"]
    facts = []
    change = int_or_none(finding.get("change_sample"))
    if change is not None:
        forward = int_or_none(finding.get("change_forward"))
        at_forward = f" (training forward {forward})" if forward is not None else ""
        facts.append(f"change at sample {change}{at_forward}")
    facts.append(f"first {_point(finding.get('first'))}, latest {_point(finding.get('latest'))}")
    ranking = _dict(finding.get("ranking"))
    if ranking:
        facts.append(f"ranked by {_text(ranking.get('basis'), 60)} = {_text(ranking.get('value'))}")
    return lines + _facts_and_texts(finding, facts, interpretation_lines=2)


def _event_lines(number: int, event: dict[str, Any]) -> list[str]:
    """An event (``report.json`` schema 2) in at most seven lines."""
    shape = _text(event.get("shape"), 40)
    lines = [f"{number:>3}. {_text(event.get('id'), 20)} {shape}: {_series_name(event)}"]
    facts = []
    onset = _dict(event.get("onset"))
    sample = int_or_none(onset.get("sample"))
    if sample is not None:
        forward = int_or_none(onset.get("forward"))
        facts.append(
            f"onset at sample {sample}"
            + (f" (training forward {forward})" if forward is not None else "")
        )
    facets = [
        f"{_text(f.get('category'), 60)} #{_text(f.get('rank'))}"
        for f in _list(event.get("findings"))
        if isinstance(f, dict)
    ]
    if facets:
        facts.append("findings " + ", ".join(facets))
    return lines + _facts_and_texts(event, facts, interpretation_lines=3)


def _events_lines(events: Sequence[object], findings: Sequence[object]) -> list[str]:
    rows = [e for e in events if isinstance(e, dict)]
    notable = sum(1 for f in findings if isinstance(f, dict) and f.get("notable") is True)
    lines = [f"Events: {len(rows)} ({notable} notable findings refer to them)"]
    for number, event in enumerate(rows[:MAX_NOTABLE_SHOWN], start=1):
        lines += _event_lines(number, event)
    if len(rows) > MAX_NOTABLE_SHOWN:
        lines.append(f"  ... {len(rows) - MAX_NOTABLE_SHOWN} more in report.json")
    if not rows:
        lines.append("  none: no finding above its noise floor")
    return lines


def _notable_lines(findings: Sequence[object]) -> list[str]:
    rows = [f for f in findings if isinstance(f, dict)]
    notable = [f for f in rows if f.get("notable") is True]
    lines = [f"Notable findings: {len(notable)} of {len(rows)} listed"]
    for number, finding in enumerate(notable[:MAX_NOTABLE_SHOWN], start=1):
        lines += _finding_lines(number, finding)
    if len(notable) > MAX_NOTABLE_SHOWN:
        lines.append(f"  ... {len(notable) - MAX_NOTABLE_SHOWN} more in report.json")
    if not notable:
        lines.append("  none above their noise floor")
    return lines


def _limits_line(coverage: dict[str, Any]) -> str:
    limits = [_text(x, 60) for x in _list(coverage.get("limits_hit"))]
    if not limits:
        return "Limits: none hit (no evidence was removed)"
    return f"Limits hit (evidence was removed): {', '.join(limits)}"


def _sum_counts(value: object) -> int | None:
    counts = [int_or_none(v) for v in _dict(value).values()]
    return sum(c for c in counts if c is not None) if counts else None


def _omitted_total(value: object) -> int | None:
    # Left out by top-k and bytes; rows below the noise floor past the few listed
    # ("not_notable") are not counted.
    totals = [
        _sum_counts({k: n for k, n in _dict(v).items() if k != "not_notable"})
        for v in _dict(value).values()
    ]
    return sum(t for t in totals if t is not None) if totals else None


def _coverage_lines(report: dict[str, Any]) -> list[str]:
    run, coverage = _dict(report.get("run")), _dict(report.get("coverage"))
    c = coverage.get
    not_observed = [_text(m, 80) for m in _list(c("modules_not_observed"))]
    unobserved = (
        f"; not observed: {', '.join(not_observed[:_MAX_LIST_SHOWN])}"
        + (f" and {len(not_observed) - _MAX_LIST_SHOWN} more" if len(not_observed) > 5 else "")
        if not_observed
        else ""
    )
    skipped = _dict(c("tensors_skipped"))
    skipped_text = (
        ", ".join(f"{_text(k, 60)} {_text(v)}" for k, v in list(skipped.items())[:8]) or "none"
    )
    lines = [
        "Coverage",
        f"  modules    {_text(c('modules_observed'))} observed of "
        f"{_text(c('modules_selected'))} selected{unobserved}",
        f"  series     {_text(c('series'))} ({_text(c('tensor_series'))} tensor series, "
        f"{_text(c('tensor_paths_observed'))} tensor paths); dropped "
        f"{_text(c('series_dropped'))}, paths dropped {_text(c('paths_dropped'))}",
        f"  samples    {_text(run.get('samples_seen'))} of {_text(run.get('forwards_seen'))} "
        f"training forwards ({_text(c('backward_samples_observed'))} with a backward); "
        f"eval or no-grad forwards skipped {_text(c('eval_forwards_skipped'))}",
        f"  findings   {_text(_sum_counts(c('findings_returned')))} returned, "
        f"{_text(_omitted_total(c('findings_omitted')))} omitted (top-k and bytes)",
        f"  tensors skipped  {skipped_text}",
        f"  hook errors      {_text(c('errors_total'))}",
    ]
    for error in [e for e in _list(report.get("errors")) if isinstance(e, dict)][:3]:
        lines += _wrapped(
            f"{_text(error.get('stage'), 40)} `{_text(error.get('module'), 80)}`: "
            f"{_text(error.get('error_type'), 60)}: {_text(error.get('message'))} "
            f"({_text(error.get('count'))}x)",
            "    ",
            1,
        )
    lines.append(_limits_line(coverage))
    return lines


def render_report_text(report: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """A ``report.json`` dict as terminal text: headline, events (schema 2; the notable
    findings of schema 1), coverage.

    Args:
        report: the parsed report (any version of schema ``torchinstruments.report``).
        path: where it was read from, for the first line.

    Returns:
        Lines of at most about :data:`WIDTH` characters, ending with a newline.
    """
    run, summary = _dict(report.get("run")), _dict(report.get("summary"))
    world = int_or_none(run.get("world_size"))
    where = (
        "single process"
        if world == 1
        else f"rank {_text(run.get('rank'))} of world size {_text(run.get('world_size'))}"
    )
    lines = [
        f"torchinstruments report: {one_line(str(path))}",
        f"{where}; generated {_text(report.get('generated_at'), 40)}",
        "",
        *_wrapped(_text(summary.get("headline"), 1000), "", 3),
    ]
    first = _dict(summary.get("first_non_finite"))
    if first:
        sample = int_or_none(first.get("sample"))
        when = (
            f"sample {sample}"
            if sample is not None
            else f"training forward {_text(first.get('forward_index'))} (between samples)"
        )
        recovered = " (the run recovered)" if first.get("recovered") is True else ""
        lines.append(f"First non-finite value: {when}, {_series_name(first)}{recovered}")
    findings = _list(report.get("findings"))
    if "events" in report:
        body = _events_lines(_list(report.get("events")), findings)
    else:  # schema 1: every notable finding in full
        body = _notable_lines(findings)
    lines += ["", *body, "", *_coverage_lines(report)]
    return "\n".join(lines) + "\n"


def _entry_lines(entry: dict[str, Any]) -> list[str]:
    """An outlier, a disagreement or a common finding in at most three lines."""
    rank = int_or_none(entry.get("rank"))
    ranks = entry.get("ranks")
    if rank is not None:
        who = f"rank {rank}: "
    elif isinstance(ranks, list):
        who = f"ranks {', '.join(_text(r, 20) for r in ranks[:8])}: "
    else:
        who = ""
    kind = entry.get("kind") or entry.get("category")
    head = f"{who}{_text(kind, 60)} " if kind is not None else who
    lines = _wrapped(head + _series_name(entry), "  ", 1)
    listed, notable = (
        int_or_none(entry.get("listed_on_ranks")),
        int_or_none(entry.get("notable_on_ranks")),
    )
    if listed is not None:
        lines.append(f"    listed on {listed} rank(s), notable on {_text(notable)}")
    interpretation = entry.get("interpretation")
    if isinstance(interpretation, str):
        lines += _wrapped(one_line(interpretation, 2000), "    ", 2)
    return lines


def render_global_text(report: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """A ``global-report.json`` dict as terminal text: ranks, outliers, coverage.

    Args:
        report: the parsed global report (schema ``torchinstruments.global-report``).
        path: where it was read from, for the first line.

    Returns:
        Lines of at most about :data:`WIDTH` characters, ending with a newline.
    """
    ranks, summary = _dict(report.get("ranks")), _dict(report.get("summary"))
    coverage = _dict(report.get("coverage"))
    missing = ", ".join(_text(r, 40) for r in _list(ranks.get("missing"))[:_MAX_LIST_SHOWN])
    lines = [
        f"torchinstruments global report: {one_line(str(path))}",
        f"merged from {_text(report.get('source_directory'), 200)}; generated "
        f"{_text(report.get('generated_at'), 40)}",
        "",
        *_wrapped(_text(summary.get("headline"), 1000), "", 3),
        "",
        f"Ranks: {_text(ranks.get('present_count'))} of {_text(ranks.get('world_size'))} "
        f"present; missing: {missing or 'none'}",
    ]
    unreadable = [u for u in _list(ranks.get("unreadable")) if isinstance(u, dict)]
    for entry in unreadable[:_MAX_LIST_SHOWN]:
        lines += _wrapped(
            f"unreadable: rank {_text(entry.get('rank'))}: {_text(entry.get('reason'))}", "  ", 1
        )
    if len(unreadable) > _MAX_LIST_SHOWN:
        lines.append(f"  ... {len(unreadable) - _MAX_LIST_SHOWN} more unreadable")
    for entry in [t for t in _list(ranks.get("truncated")) if isinstance(t, dict)][:3]:
        limits = ", ".join(_text(x, 40) for x in _list(entry.get("limits_hit")))
        lines.append(f"  truncated: ranks {_text(entry.get('ranks'), 80)} ({limits})")
    outlier_ranks = [r for r in _list(report.get("outlier_ranks")) if isinstance(r, dict)]
    lines += ["", f"Outlier ranks: {len(outlier_ranks)}"]
    for entry in outlier_ranks[:_MAX_LIST_SHOWN]:
        lines += _wrapped(
            f"rank {_text(entry.get('rank'))}: {_text(entry.get('strongest'), 2000)}", "  ", 2
        )
        experiment = entry.get("next_experiment")
        if isinstance(experiment, str):
            lines += _wrapped("next: " + one_line(experiment, 2000), "    ", 1)
    for title, key in (
        ("Outliers", "outliers"),
        ("Disagreements (two ranks)", "disagreements"),
        ("Findings common to ranks", "common_findings"),
    ):
        entries = [e for e in _list(report.get(key)) if isinstance(e, dict)]
        lines += ["", f"{title}: {len(entries)}"]
        for entry in entries[:_MAX_LIST_SHOWN]:
            lines += _entry_lines(entry)
        if len(entries) > _MAX_LIST_SHOWN:
            lines.append(f"  ... {len(entries) - _MAX_LIST_SHOWN} more in {GLOBAL_REPORT_NAME}")
    c = coverage.get
    lines += [
        "",
        "Coverage",
        f"  rank reports read  {_text(c('rank_reports_read'))}",
        f"  series compared    {_text(c('series_compared'))} "
        f"(dropped {_text(c('series_dropped'))})",
        f"  findings compared  {_text(c('findings_compared'))} "
        f"(dropped {_text(c('findings_dropped'))})",
        _limits_line(coverage),
    ]
    return "\n".join(lines) + "\n"


def _read(path: Path, schema: str, what: str) -> dict[str, Any]:
    return read_json_object(
        path, what=what, max_bytes=MAX_REPORT_FILE_BYTES, schema=schema, required={}
    )


def show_directory(path: str | os.PathLike[str]) -> str:
    """The terminal view of the reports in ``path``.

    Args:
        path: an ``output_dir`` holding ``report.json`` and/or ``global-report.json``
            (both are shown, the global one first), or one of those files; a symbolic
            link to such a directory is followed.

    Returns:
        The text (see :func:`render_report_text` and :func:`render_global_text`).

    Raises:
        ReportReadError: nothing to show, or a report cannot be read (missing, a symbolic
            link, larger than 16 MiB, nested deeper than 64 levels, not JSON, not a
            report); the one-line message names the path.
    """
    root = Path(path)
    # A link to a directory, named here, is followed (the user's choice, as in compare
    # and merge); a link to a file, and the links inside, are read as any report.
    if root.is_file() or (root.is_symlink() and not root.is_dir()):
        if root.name == GLOBAL_REPORT_NAME:
            return render_global_text(_read(root, GLOBAL_SCHEMA, "a global report"), root)
        return render_report_text(_read(root, SCHEMA, "a report"), root)
    if not root.is_dir():
        raise ReportReadError(
            one_line(f"{root}: expected a directory holding {REPORT_NAME}, got nothing there")
        )
    parts = []
    global_path, report_path = root / GLOBAL_REPORT_NAME, root / REPORT_NAME
    if global_path.exists() or global_path.is_symlink():
        report = _read(global_path, GLOBAL_SCHEMA, "a global report")
        parts.append(render_global_text(report, global_path))
    if report_path.exists() or report_path.is_symlink():
        parts.append(render_report_text(_read(report_path, SCHEMA, "a report"), report_path))
    if not parts:
        ranks = any(entry.name.startswith("rank-") for entry in os.scandir(root))
        hint = (
            f"; it holds rank-NNN/ directories: run `torchinstruments merge {root}` first"
            if ranks
            else ""
        )
        raise ReportReadError(
            one_line(f"{root}: expected {REPORT_NAME} or {GLOBAL_REPORT_NAME}, got neither{hint}")
        )
    return "\n".join(parts)
