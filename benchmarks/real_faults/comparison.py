"""The compare check: does ``compare_runs`` name the fault's origin as the first divergence?

For every fault run, the family's same-seed clean control is the baseline and the fault
run the candidate (``torchinstruments.compare_runs``, the function behind
``torchinstruments compare``). The first divergence (``summary.first_divergence``) is a
hit when its module is on the fault's origin (:func:`benchmarks.faults.score.on_origin`).
The two clean controls of a family (different seeds) are compared too: the expected
result is no notable divergence (``summary.notable_divergences == 0``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.faults.score import on_origin
from torchinstruments import compare_runs

__all__ = ["CompareResult", "compare_pair", "compare_totals_line", "format_compare_table"]


@dataclass(slots=True)
class CompareResult:
    """One comparison of a candidate run with a baseline run.

    Attributes:
        candidate, baseline: scenario names.
        control_pair: the two clean controls of a family (expected: no divergence).
        origin: the candidate's fault origin (None for a control pair).
        first_faulty_forward: the candidate's first faulty training forward.
        strength: ``full`` or ``weak`` (see docs/research-workflows.md).
        notable_divergences: ``summary.notable_divergences``.
        first_module, first_kind, first_signal, first_forward: the first divergence's
            module, kind (``value``, ``stopped``, ...), signal and training forward
            (None when there is none).
        hit: fault runs: the first divergence is on the origin; control pairs: no
            notable divergence.
        headline: the comparison's headline.
    """

    candidate: str
    baseline: str
    control_pair: bool
    origin: tuple[str, ...] | None
    first_faulty_forward: int | None
    strength: str
    notable_divergences: int
    first_module: str | None
    first_kind: str | None
    first_signal: str | None
    first_forward: int | None
    hit: bool
    headline: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict."""
        return asdict(self)


def compare_pair(
    baseline_dir: Path,
    candidate_dir: Path,
    output_dir: Path,
    *,
    baseline: str,
    candidate: str,
    origin: tuple[str, ...] | None,
    first_faulty_forward: int | None,
) -> CompareResult:
    """Run ``compare_runs(baseline_dir, candidate_dir, output_dir)`` and score it."""
    path = compare_runs(baseline_dir, candidate_dir, output_dir)
    comparison = json.loads(Path(path).read_text(encoding="utf-8"))
    summary = comparison.get("summary") or {}
    first = summary.get("first_divergence") or {}
    notable = summary.get("notable_divergences")
    notable = notable if isinstance(notable, int) else 0
    module = first.get("module")
    control_pair = origin is None
    if control_pair:
        hit = notable == 0
    else:
        hit = isinstance(module, str) and origin is not None and on_origin(module, origin)
    forward = first.get("forward")
    return CompareResult(
        candidate=candidate,
        baseline=baseline,
        control_pair=control_pair,
        origin=origin,
        first_faulty_forward=first_faulty_forward,
        strength=str(comparison.get("strength")),
        notable_divergences=notable,
        first_module=module if isinstance(module, str) else None,
        first_kind=first.get("kind"),
        first_signal=first.get("signal"),
        first_forward=forward if isinstance(forward, int) else None,
        hit=hit,
        headline=str(summary.get("headline", "")),
    )


def format_compare_table(results: list[CompareResult]) -> str:
    """One row per comparison: what diverged first, and whether that is the origin."""
    header = (
        "candidate",
        "baseline",
        "origin",
        "hit",
        "divergences",
        "first divergence (module signal kind @forward)",
        "fault@",
        "strength",
    )
    rows: list[tuple[str, ...]] = []
    for r in results:
        if r.first_module is None:
            first = "(none)"
        else:
            first = f"{r.first_module} {r.first_signal} {r.first_kind} @{r.first_forward}"
        origin = "(no divergence expected)" if r.origin is None else ",".join(r.origin)
        rows.append(
            (
                r.candidate,
                r.baseline,
                origin,
                "1" if r.hit else "0",
                str(r.notable_divergences),
                first,
                "-" if r.first_faulty_forward is None else str(r.first_faulty_forward),
                r.strength,
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(header)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    return "\n".join(lines)


def compare_totals_line(results: list[CompareResult]) -> str:
    """``COMPARE faults=N hit=H/N early=E | control_pairs=M clean=C/M``.

    ``early``: fault comparisons whose first divergence is dated before the fault's first
    faulty forward (the runs should agree until then).
    """
    faults = [r for r in results if not r.control_pair]
    pairs = [r for r in results if r.control_pair]
    early = sum(
        1
        for r in faults
        if r.first_forward is not None
        and r.first_faulty_forward is not None
        and r.first_forward < r.first_faulty_forward
    )
    return (
        f"COMPARE faults={len(faults)} hit={sum(r.hit for r in faults)}/{len(faults)} "
        f"early={early} | control_pairs={len(pairs)} "
        f"clean={sum(r.hit for r in pairs)}/{len(pairs)}"
    )
