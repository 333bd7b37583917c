"""``global-index.md``: the merged report for people, with the prompt for an LLM."""

from __future__ import annotations

from typing import Any

GLOBAL_PROMPT = """\
You are analysing passive telemetry merged from the ranks of one distributed PyTorch
training run (torchinstruments). Each rank wrote its own report; this global report
compares them. Cite rank, module, call index, signal, tensor path, metric and values.
Treat a rank outlier as a measurement about that rank (its data shard, its device, its
inputs), not as a property of the model. Missing, unreadable or truncated ranks limit
what can be concluded: say so. End with the narrowest experiment that would confirm or
refute your leading hypothesis (for example, swap the data shards of two ranks).
"""


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
