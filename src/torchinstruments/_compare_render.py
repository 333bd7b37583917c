"""Writing a comparison: the byte bound on ``comparison.json`` (round-robin of its
sections, then shrink steps) and ``comparison.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._compare_align import _describe_when
from ._compare_values import CATEGORIES
from ._document import longest_fitting_prefix, round_robin, shrink_to_fit

COMPARISON_PROMPT = """\
You are comparing passive telemetry of two PyTorch training runs (torchinstruments): a
baseline and a candidate that differs from it by one modification, with the same seed,
data order and precision. The comparison lists where the candidate first departs from the
baseline, earliest sample first, then forward call order for activations and reverse
call order for output gradients. Cite module, call index, signal, tensor path, metric,
samples and values. A departure is measured in units of the baseline's own noise; later
departures downstream (activations) or upstream (gradients) of the first one are likely
its echoes. If the comparison is marked weak, say which mismatch limits each claim. End
with the single narrowest experiment that would confirm the first divergence's cause.
"""


@dataclass(slots=True)
class _Comparison:
    """Everything before the byte bound."""

    header: dict[str, Any]
    sections: dict[str, list[dict[str, Any]]]
    totals: dict[str, int]
    category_counts: dict[str, dict[str, int]]
    coverage: dict[str, Any]
    threshold: float


def _assemble(comparison: _Comparison, kept: dict[str, int]) -> dict[str, Any]:
    sections = comparison.sections
    omitted = {
        name: {
            "by_limit": comparison.totals[name] - len(items),
            "by_bytes": len(items) - kept[name],
        }
        for name, items in sections.items()
    }
    limits = []
    if any(v["by_bytes"] for v in omitted.values()):
        limits.append("max_bytes")
    if any(v["by_limit"] for v in omitted.values()):
        limits.append("entries_per_section")
    categories = {
        category: {
            **comparison.category_counts[category],
            "entries": sections[category][: kept[category]],
        }
        for category in CATEGORIES
    }
    return {
        **comparison.header,
        "first_divergences": sections["first_divergences"][: kept["first_divergences"]],
        "categories": categories,
        "only_in_baseline": sections["only_in_baseline"][: kept["only_in_baseline"]],
        "only_in_candidate": sections["only_in_candidate"][: kept["only_in_candidate"]],
        "coverage": {
            **comparison.coverage,
            "omitted": omitted,
            "limits_hit": limits,
        },
    }


def _bounded(comparison: _Comparison, max_bytes: int) -> dict[str, Any]:
    """The longest round-robin prefix of the sections' entries that fits ``max_bytes``."""
    sections = comparison.sections
    order = round_robin([[name] * len(items) for name, items in sections.items()])

    def build(count: int) -> dict[str, Any]:
        kept = dict.fromkeys(sections, 0)
        for name in order[:count]:
            kept[name] += 1
        return _assemble(comparison, kept)

    best = longest_fitting_prefix(build, len(order), max_bytes)
    # Not even the header fits: shorten it, least useful part first.
    if shrink_to_fit(best, max_bytes, _SHRINK_STEPS):
        best["coverage"]["limits_hit"] = sorted({*best["coverage"]["limits_hit"], "max_bytes"})
    return best


def _shrink_mismatches(comparison: dict[str, Any]) -> bool:
    comparison["mismatches"] = [
        {"kind": m["kind"], "weakens": m["weakens"]} for m in comparison["mismatches"]
    ]
    return True


def _shrink_runs(comparison: dict[str, Any]) -> bool:
    for side in ("baseline", "candidate"):
        sampling = comparison[side].get("sampling")
        if isinstance(sampling, dict):
            comparison[side]["sampling"] = {"policy": sampling.get("policy")}
        elif isinstance(sampling, str):
            comparison[side]["sampling"] = sampling[:80]
    return True


def _shrink_rule(comparison: dict[str, Any]) -> bool:
    comparison["rule"]["statistic"] = "see torchinstruments.compare_runs"
    comparison["rule"]["order"] = "time, then forward order (activations), backward (gradients)"
    return True


def _shrink_first(comparison: dict[str, Any]) -> bool:
    first = comparison["summary"]["first_divergence"]
    if first is not None:
        comparison["summary"]["first_divergence"] = {
            k: v for k, v in first.items() if k not in ("interpretation", "last_agreeing")
        }
    return True


def _shrink_text(comparison: dict[str, Any]) -> bool:
    first = comparison["summary"]["first_divergence"]
    if first is not None:
        first["next_experiment"] = str(first.get("next_experiment", ""))[:200]
    comparison["notes"] = [note[:200] for note in comparison["notes"]]
    for side in ("baseline", "candidate"):
        path = comparison[side]["path"]
        if len(path) > 200:
            comparison[side]["path"] = "..." + path[-197:]
    return True


_SHRINK_STEPS = (_shrink_mismatches, _shrink_runs, _shrink_rule, _shrink_first, _shrink_text)


def _event_line(number: int, event: dict[str, Any]) -> list[str]:
    metric = f".{event['metric']}" if event.get("metric") else ""
    lines = [
        f"{number}. **{_describe_when(event)}**, `{event['module']}` call "
        f"{event['call_index']}, {event['signal']}{metric} ({event['tensor_path']}), "
        f"{event['kind'].replace('_', ' ')}: {event['interpretation']}",
    ]
    if event.get("next_experiment"):
        lines.append(f"   - Next experiment: {event['next_experiment']}")
    return lines


def render_comparison_markdown(comparison: dict[str, Any]) -> str:
    """Render a comparison dict as ``comparison.md`` for people.

    Args:
        comparison: a dict as written to ``comparison.json``.

    Returns:
        Markdown: the headline, mismatches, the first divergences with their narrow
        experiments, the largest differences per category, one-run series, the rule, and a
        prompt for an LLM.
    """
    summary, base, cand = comparison["summary"], comparison["baseline"], comparison["candidate"]
    lines = [
        "# torchinstruments comparison",
        "",
        f"**{summary['headline']}**",
        "",
        f"Baseline `{base['path']}` ({base['samples_seen']} samples, {base['forwards_seen']} "
        f"training forwards); candidate `{cand['path']}` ({cand['samples_seen']} samples, "
        f"{cand['forwards_seen']} training forwards); generated {comparison['generated_at']}.",
        "",
    ]
    mismatches = comparison["mismatches"]
    if mismatches:
        title = (
            "## Mismatches: a weak comparison"
            if comparison["strength"] == "weak"
            else "## Notes on the runs"
        )
        lines += [title, ""]
        for m in mismatches:
            tag = " (limits the claims below)" if m["weakens"] else ""
            lines.append(f"- **{m['kind']}**{tag}: {m.get('detail', '')}")
        lines.append("")
    for note in comparison.get("notes", []):
        lines += [f"Note: {note}", ""]
    lines += ["## First divergences", ""]
    if comparison["first_divergences"]:
        lines.append(
            "Earliest first; at one point, activations in forward call order, then output "
            "gradients in backward order. Later entries are often echoes of the first."
        )
        lines.append("")
        for number, event in enumerate(comparison["first_divergences"], start=1):
            lines += _event_line(number, event)
    else:
        lines.append("None.")
    lines.append("")
    lines += ["## Largest differences per category", ""]
    for category, section in comparison["categories"].items():
        lines += [
            f"### {category.replace('_', ' ').capitalize()}",
            "",
            f"{section['series_compared']} series compared, {section['notable']} notable.",
            "",
        ]
        entries = section["entries"]
        if not entries:
            continue
        if category == "non_finite":
            for number, event in enumerate(entries, start=1):
                lines += _event_line(number, event)
            lines.append("")
            continue
        lines += [
            "| # | series | notable | sustained departure | first divergence "
            "| largest (baseline -> candidate) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for number, e in enumerate(entries, start=1):
            first = e.get("first_divergence")
            largest = e["largest"]
            lines.append(
                f"| {number} | `{e['module']}` call {e['call_index']} {e['signal']}.{e['metric']} "
                f"| {'yes' if e['notable'] else 'no'} | {e['sustained_departure']} "
                f"| {_describe_when(first) if first else '-'} "
                f"| {largest['baseline']} -> {largest['candidate']} at "
                f"{_describe_when(largest)} |"
            )
        lines.append("")
    for side in ("baseline", "candidate"):
        entries = comparison[f"only_in_{side}"]
        if not entries:
            continue
        lines += [f"## Observed only in the {side}", ""]
        for e in entries[:40]:
            why = f" ({e['explained_by']})" if e.get("explained_by") else ""
            lines.append(
                f"- `{e['module']}` call {e['call_index']} {e['signal']} ({e['tensor_path']}): "
                f"samples {e['first_sample']} to {e['last_sample']}{why}"
            )
        lines.append("")
    rule = comparison["rule"]
    coverage = comparison["coverage"]
    left_out = {k: v["by_bytes"] for k, v in coverage["omitted"].items() if v["by_bytes"]}
    lines += [
        "## Rule",
        "",
        f"- {rule['statistic']}",
        f"- Threshold {rule['threshold']} noise units for {rule['persistence_points']} "
        f"consecutive compared points; noise floors {rule['noise_floors']}.",
        f"- Order: {rule['order']}.",
        "",
        "## Coverage and limits",
        "",
        f"- Series compared per category: {coverage['series_compared']}; compared through "
        f"{_describe_when(comparison['alignment']['compared_through'] or {})} on the "
        f"{comparison['alignment']['axis']} axis.",
        f"- Left out to fit the byte bound: {left_out or 'nothing'}; limits hit: "
        f"{', '.join(coverage['limits_hit']) or 'none'}.",
        "",
        "## Prompt for an LLM",
        "",
        "Send `comparison.json` (and both runs' `report.json`) with this prompt:",
        "",
        "```text",
        COMPARISON_PROMPT.rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def first_divergence_lines(comparison: dict[str, Any], count: int = 3) -> list[str]:
    """One line per first divergence (at most ``count``), for the command line."""
    lines = []
    for number, event in enumerate(comparison.get("first_divergences", [])[:count], start=1):
        metric = f".{event['metric']}" if event.get("metric") else ""
        lines.append(
            f"  {number}. {_describe_when(event)}: `{event['module']}` call "
            f"{event['call_index']} {event['signal']}{metric} ({event['kind']})"
        )
    return lines
