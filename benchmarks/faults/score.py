"""Score a scenario's ``report.json`` against its ground truth.

Definitions (fault scenarios with an origin):

- The *candidate list* is the report's notable findings (``notable: true``) of the
  scenario's expected categories, in the order the report lists them (``findings`` is
  round-robin: rank 1 of every category in the report's category order, then rank 2,
  ...). That is the order a reader meets them in. Findings that are not notable are
  context, not answers, and are skipped. Model-wide findings (module ``<model>``) stay in
  the list and never match an origin.
- A finding *is on the origin* when its ``module`` equals an exact origin entry or starts
  with a prefix entry (entries ending with ``.``, e.g. ``blocks.3.``, accept any module
  of that block). Only the finding's own ``module`` counts: a module listed under
  ``evidence.echoes`` is an echo, not a hit, whichever finding it is attached to.
- ``hit@1``: the first entry of the candidate list is on the origin. ``hit@3``: one of
  the first three is. Reciprocal rank: 1 / (1-based position of the first entry on the
  origin), 0 if none is.
- ``headline@1``: the report's first notable finding of *any* category (the lead of its
  first event, which its headline names) is on the origin. Stricter than ``hit@1``: a
  notable finding of another category that the report puts first (a zero fraction
  downstream of a gradient fault, a scale change beside the first non-finite value) is a
  miss here.

Category-only scenarios (origin ``None``, e.g. a raised learning rate): the candidate
list is *every* notable finding in report order, and an entry is a hit when its category
is one of the expected ones; hit@1, hit@3 and reciprocal rank as above. Because the
report lists categories in a fixed order within each rank level (``non_finite``,
``activation_scale_drift``, ``gradient_scale_change``, ``heavy_tail_growth``,
``zero_fraction_growth``, then ``regime_change``, ``relative_volatility``,
``oscillation``), an instability category can only come first when none of the earlier
categories has a notable finding: the score asks whether instability is what the
report leads with.

Controls (no fault): the number of notable findings (``summary.notable_findings``,
which also counts notable findings left out of the returned list; target 0) and the
number of ``non_finite`` findings (``coverage.candidates.non_finite``, every one of
them notable; target 0).

Totals: mean hit@1, hit@3 and reciprocal rank (MRR) over the fault scenarios run; sums
of notable and non-finite findings over the controls run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

__all__ = ["ScenarioScore", "Totals", "format_table", "on_origin", "score", "totals"]

#: Findings named per scenario in the diagnosis of a miss.
DIAGNOSIS_FINDINGS = 3


class DescribedFault(Protocol):
    """What :func:`score` reads of a fault: its one-line description."""

    def describe(self) -> str: ...


class ScoredScenario(Protocol):
    """What :func:`score` reads of a scenario (``benchmarks.faults.scenarios.Scenario``,
    ``benchmarks.real_faults.scenarios.Scenario``)."""

    @property
    def name(self) -> str: ...
    @property
    def family(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def origin(self) -> tuple[str, ...] | None: ...
    @property
    def expected(self) -> tuple[str, ...]: ...
    @property
    def control(self) -> bool: ...
    @property
    def fault(self) -> DescribedFault | None: ...


class ScoredRun(Protocol):
    """What :func:`score` reads of a finished run (``RunResult`` of either benchmark)."""

    @property
    def fault_step(self) -> int | None: ...
    @property
    def steps(self) -> int: ...
    @property
    def loss_before(self) -> float: ...
    @property
    def loss_end(self) -> float: ...
    @property
    def nonfinite_losses(self) -> int: ...
    @property
    def skipped_updates(self) -> int: ...
    @property
    def seconds(self) -> float: ...


def on_origin(module: str, origin: tuple[str, ...]) -> bool:
    """Whether a finding's module is the origin (exact name, or prefix ending with ``.``).

    Example:
        >>> on_origin("blocks.3.fc1", ("blocks.3.",)), on_origin("blocks.30.fc1", ("blocks.3.",))
        (True, False)
        >>> exact = ("blocks.1.fc1",)
        >>> on_origin("blocks.1.fc1", exact), on_origin("blocks.1.fc1x", exact)
        (True, False)
    """
    return any(module.startswith(o) if o.endswith(".") else module == o for o in origin)


def _brief(finding: dict[str, Any]) -> dict[str, Any]:
    ranking = finding.get("ranking") or {}
    return {
        "category": finding.get("category"),
        "rank": finding.get("rank"),
        "module": finding.get("module"),
        "call_index": finding.get("call_index"),
        "signal": finding.get("signal"),
        "metric": finding.get("metric"),
        "basis": ranking.get("basis"),
        "value": ranking.get("value"),
        "echoes": [e.get("module") for e in (finding.get("evidence") or {}).get("echoes", [])],
    }


def describe_finding(brief: dict[str, Any]) -> str:
    """``category#rank module signal.metric basis=value``, for tables and diagnoses."""
    value = brief.get("value")
    shown = f"{value:.4g}" if isinstance(value, int | float) else str(value)
    return (
        f"{brief['category']}#{brief['rank']} {brief['module']} "
        f"{brief['signal']}.{brief['metric']} {brief['basis']}={shown}"
    )


@dataclass(slots=True)
class ScenarioScore:
    """The score of one scenario run.

    Attributes:
        name, family, kind: the scenario.
        origin: origin entries (None: category only, or a control).
        expected: expected categories.
        control: a clean control.
        hit1, hit3, reciprocal_rank: fault scenarios only (None for controls).
        headline: ``headline@1`` (fault scenarios only).
        hit_position: 1-based position of the first hit in the candidate list.
        candidates: length of the candidate list.
        notable: notable findings in the whole report (``summary.notable_findings``).
        non_finite: ``non_finite`` findings in the whole report.
        leading: the first candidates (diagnosis of a miss).
        top_notable: the first notable findings of any category, in report order.
        fault_step, steps, loss_before, loss_end, nonfinite_losses, skipped_updates,
        seconds: from the run.
    """

    name: str
    family: str
    kind: str
    origin: tuple[str, ...] | None
    expected: tuple[str, ...]
    control: bool
    hit1: bool | None
    hit3: bool | None
    reciprocal_rank: float | None
    hit_position: int | None
    candidates: int
    notable: int
    non_finite: int
    leading: list[dict[str, Any]] = field(default_factory=list)
    top_notable: list[dict[str, Any]] = field(default_factory=list)
    headline: bool | None = None
    fault: str = ""
    fault_step: int | None = None
    steps: int = 0
    loss_before: float = math.nan
    loss_end: float = math.nan
    nonfinite_losses: int = 0
    skipped_updates: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("loss_before", "loss_end"):
            if not math.isfinite(data[key]):
                data[key] = None
        return data


def _is_hit(finding: dict[str, Any], scenario: ScoredScenario) -> bool:
    if scenario.origin is None:
        return finding.get("category") in scenario.expected
    return on_origin(str(finding.get("module")), scenario.origin)


def score(
    scenario: ScoredScenario, report: dict[str, Any], run: ScoredRun | None = None
) -> ScenarioScore:
    """Score one report against its scenario (see the module docstring)."""
    findings: list[dict[str, Any]] = list(report.get("findings", []))
    notable = [f for f in findings if f.get("notable")]
    summary = report.get("summary") or {}
    coverage = report.get("coverage") or {}
    non_finite_total = (coverage.get("candidates") or {}).get("non_finite")
    if not isinstance(non_finite_total, int):
        non_finite_total = sum(1 for f in findings if f.get("category") == "non_finite")
    notable_total = summary.get("notable_findings")
    if not isinstance(notable_total, int):
        notable_total = len(notable)
    hit1 = hit3 = None
    reciprocal: float | None = None
    position: int | None = None
    candidates: list[dict[str, Any]] = []
    if not scenario.control:
        if scenario.origin is None:
            candidates = notable
        else:
            candidates = [f for f in notable if f.get("category") in scenario.expected]
        position = next(
            (i + 1 for i, f in enumerate(candidates) if _is_hit(f, scenario)),
            None,
        )
        hit1 = position == 1
        hit3 = position is not None and position <= 3
        reciprocal = 1.0 / position if position is not None else 0.0
    headline = None if scenario.control else bool(notable) and _is_hit(notable[0], scenario)
    result = ScenarioScore(
        name=scenario.name,
        family=scenario.family,
        kind=scenario.kind,
        origin=scenario.origin,
        expected=scenario.expected,
        control=scenario.control,
        hit1=hit1,
        hit3=hit3,
        reciprocal_rank=reciprocal,
        hit_position=position,
        candidates=len(candidates),
        notable=notable_total,
        non_finite=non_finite_total,
        leading=[_brief(f) for f in candidates[:DIAGNOSIS_FINDINGS]],
        top_notable=[_brief(f) for f in notable[:DIAGNOSIS_FINDINGS]],
        headline=headline,
        fault=scenario.fault.describe() if scenario.fault is not None else "",
    )
    if run is not None:
        result.fault_step = run.fault_step
        result.steps = run.steps
        result.loss_before = run.loss_before
        result.loss_end = run.loss_end
        result.nonfinite_losses = run.nonfinite_losses
        result.skipped_updates = run.skipped_updates
        result.seconds = run.seconds
    return result


@dataclass(frozen=True, slots=True)
class Totals:
    """Totals over a set of scenario scores (None where no scenario of that kind ran):
    means of hit@1, hit@3, reciprocal rank and headline@1 over the faults, sums over the
    controls."""

    faults: int
    hit1: float | None
    hit3: float | None
    mrr: float | None
    controls: int
    control_notable: int
    control_non_finite: int
    headline1: float | None = None

    def line(self) -> str:
        """The one totals line (``TOTAL ...``) that the smoke test looks for."""

        def show(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.3f}"

        return (
            f"TOTAL faults={self.faults} hit@1={show(self.hit1)} hit@3={show(self.hit3)} "
            f"MRR={show(self.mrr)} headline@1={show(self.headline1)} | controls={self.controls} "
            f"notable={self.control_notable} non_finite={self.control_non_finite}"
        )


def totals(scores: list[ScenarioScore]) -> Totals:
    """Mean hit@1, hit@3 and MRR over fault scenarios; sums over controls."""
    faults = [s for s in scores if not s.control]
    controls = [s for s in scores if s.control]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    return Totals(
        faults=len(faults),
        hit1=mean([1.0 if s.hit1 else 0.0 for s in faults]),
        hit3=mean([1.0 if s.hit3 else 0.0 for s in faults]),
        mrr=mean([s.reciprocal_rank or 0.0 for s in faults]),
        headline1=mean([1.0 if s.headline else 0.0 for s in faults]),
        controls=len(controls),
        control_notable=sum(s.notable for s in controls),
        control_non_finite=sum(s.non_finite for s in controls),
    )


def _origin_text(s: ScenarioScore) -> str:
    if s.control:
        return "-"
    if s.origin is None:
        return "(category only)"
    return ",".join(o + "*" if o.endswith(".") else o for o in s.origin)


def _loss(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "nan"


def format_table(scores: list[ScenarioScore]) -> str:
    """One row per scenario: ground truth, score, and what the report led with."""
    header = (
        "scenario",
        "fault",
        "step",
        "origin",
        "hit@1",
        "hit@3",
        "RR",
        "headline",
        "notable",
        "non_finite",
        "loss before>end",
        "first candidate (category#rank module signal.metric basis=value)",
    )
    rows: list[tuple[str, ...]] = []
    for s in scores:
        if s.control:
            hit1 = hit3 = rr = headline = "-"
            first = describe_finding(s.top_notable[0]) if s.top_notable else "(none notable)"
        else:
            hit1 = "1" if s.hit1 else "0"
            hit3 = "1" if s.hit3 else "0"
            rr = f"{s.reciprocal_rank:.2f}"
            headline = "1" if s.headline else "0"
            first = describe_finding(s.leading[0]) if s.leading else "(no notable candidate)"
        rows.append(
            (
                s.name,
                s.kind,
                "-" if s.fault_step is None else str(s.fault_step),
                _origin_text(s),
                hit1,
                hit3,
                rr,
                headline,
                str(s.notable),
                str(s.non_finite),
                f"{_loss(s.loss_before)}>{_loss(s.loss_end)}",
                first,
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(header)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines)


def format_diagnosis(scores: list[ScenarioScore]) -> str:
    """For each miss (fault scenario without hit@1 or headline@1, control with a
    notable finding): the report's leading notable findings, so a rule author can see
    what ranked first."""
    lines: list[str] = []
    for s in scores:
        if s.control and s.notable == 0 and s.non_finite == 0:
            continue
        if not s.control and s.hit1 and s.headline:
            continue
        lines.append(f"{s.name} ({s.fault or 'control'}; expected {', '.join(s.expected) or '-'}):")
        if not s.control:
            where = f"position {s.hit_position}" if s.hit_position else "not in the list"
            lines.append(
                f"  origin {_origin_text(s)}: {where} of {s.candidates} notable candidate(s)"
            )
            for brief in s.leading:
                echoes = f" echoes={','.join(brief['echoes'])}" if brief["echoes"] else ""
                lines.append(f"  candidate: {describe_finding(brief)}{echoes}")
        for brief in s.top_notable:
            lines.append(f"  top notable: {describe_finding(brief)}")
        if not s.top_notable:
            lines.append("  no notable finding at all")
    return "\n".join(lines)
