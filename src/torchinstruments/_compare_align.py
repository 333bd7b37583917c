"""Aligning two runs for ``compare``: each run's schedule (sample <-> training forward),
the common time axis, and the set-up mismatches that weaken a comparison.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._series_file import SeriesFile
from .sampling import SampleForwards, policy_from_description

#: Configuration keys of ``series.json`` that do not change what is measured.
_IGNORED_CONFIG_KEYS = frozenset({"report"})


def _mappings_differ(first: SampleForwards, second: SampleForwards) -> bool:
    """Whether two recorded sample -> forward mappings disagree on a common sample (both
    are piecewise linear: comparing at each run's first, second and last sample is
    exact)."""
    common = min(first.samples, second.samples)
    points: set[int] = set()
    for recorded in (first, second):
        for start, _, _, count in recorded.runs:
            points.update((start, start + 1, start + count - 1))
    return any(
        first.forward(sample) != second.forward(sample)
        for sample in sorted(points)
        if 0 <= sample < common
    )


class _Schedule:
    """Sample index <-> training forward index of one run: what it recorded
    (``sample_forwards``), else its sampling policy rebuilt from its description
    (:func:`~torchinstruments.sampling.policy_from_description`).

    Known for ``default`` and ``every_n``; for ``time_budget`` only the dense start is
    known; for anything else nothing is.
    """

    def __init__(self, description: object, recorded: SampleForwards | None = None) -> None:
        self.model = policy_from_description(description)
        described = description.get("policy") if isinstance(description, dict) else None
        self.policy = str(described) if self.model is not None else "unknown"
        #: What the run recorded; it wins over the schedule's model where it has the
        #: sample (forced samples after a sentinel hit shift the model's mapping).
        self.recorded = recorded

    @property
    def known(self) -> bool:
        return self.model is not None or self.recorded is not None

    def forward(self, sample: int) -> int | None:
        """The training forward index of ``sample``, or None if unknown."""
        if self.recorded is not None:
            return self.recorded.forward(sample)
        return self.model.forward_of(sample) if self.model is not None else None

    def sample(self, forward: int) -> int | None:
        """The sample taken at training forward ``forward``, or None (none, or unknown)."""
        if forward < 0:
            return None
        if self.recorded is not None:
            return self.recorded.sample(forward)
        return self.model.sample_at(forward) if self.model is not None else None

    def expected_samples(self, forwards: int) -> int | None:
        """Samples the schedule takes in ``forwards`` training forwards (None: unknown)."""
        return self.model.samples_in(forwards) if self.model is not None else None


def _sampling_description(config: dict[str, Any]) -> object:
    """The sampling description without its run-dependent fields."""
    sampling = config.get("sampling")
    if isinstance(sampling, dict):
        return {k: v for k, v in sampling.items() if k != "telemetry_seconds"}
    return sampling


@dataclass(slots=True)
class _Axis:
    """The common time axis: sample indices, or training forward indices."""

    mode: str
    baseline: _Schedule
    candidate: _Schedule
    end: int

    def key(self, side: str, sample: int) -> int | None:
        if self.mode == "sample":
            return sample
        schedule = self.baseline if side == "baseline" else self.candidate
        return schedule.forward(sample)

    def when(self, key: int) -> dict[str, Any]:
        """A time point for the output: baseline sample, training forward, candidate sample."""
        if self.mode == "sample":
            forward = self.baseline.forward(key)
            if self.baseline.policy == "time_budget" or forward is None:
                forward = None
            return {"sample": key, "forward": forward}
        return {
            "sample": self.baseline.sample(key),
            "forward": key,
            "candidate_sample": self.candidate.sample(key),
        }


def _describe_when(when: dict[str, Any]) -> str:
    parts = []
    if when.get("sample") is not None:
        parts.append(f"sample {when['sample']}")
    if when.get("candidate_sample") is not None and when["candidate_sample"] != when.get("sample"):
        parts.append(f"candidate sample {when['candidate_sample']}")
    if when.get("forward") is not None:
        text = f"training forward {when['forward']}"
        parts.append(f"({text})" if parts else text)
    return " ".join(parts) or "an unknown point"


def _mismatch(kind: str, weakens: bool, detail: str, **values: Any) -> dict[str, Any]:
    return {"kind": kind, "weakens": weakens, "detail": detail, **values}


def _short(value: object, limit: int = 800) -> object:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return value if len(text) <= limit else text[: limit - 3] + "..."


def _names(names: Iterable[str], limit: int = 10) -> str:
    ordered = sorted(names)
    shown = ", ".join(ordered[:limit])
    return shown + (f" and {len(ordered) - limit} more" if len(ordered) > limit else "")


def _align(baseline: SeriesFile, candidate: SeriesFile) -> tuple[_Axis, list[dict[str, Any]]]:
    """Choose the time axis and list what differs between the two runs' set-ups."""
    mismatches: list[dict[str, Any]] = []
    described_b = _sampling_description(baseline.config)
    described_c = _sampling_description(candidate.config)
    schedule_b = _Schedule(described_b, baseline.recorded)
    schedule_c = _Schedule(described_c, candidate.recorded)
    exact = baseline.recorded is not None and candidate.recorded is not None
    extra: dict[str, tuple[int, int, int]] = {}  # role -> (forwards, expected, seen)
    for role, run, described in (
        ("baseline", baseline, described_b),
        ("candidate", candidate, described_c),
    ):
        # The schedule's model, not the record: how many samples it alone would take.
        forwards = run.int_field("forwards_seen")
        model = _Schedule(described)
        expected = model.expected_samples(forwards) if forwards is not None else None
        seen = run.int_field("samples_seen")
        if forwards is not None and expected is not None and seen is not None and seen != expected:
            extra[role] = (forwards, expected, seen)
    time_budget = "time_budget" in (schedule_b.policy, schedule_c.policy)
    shifted = (
        baseline.recorded is not None
        and candidate.recorded is not None
        and _mappings_differ(baseline.recorded, candidate.recorded)
    )
    if described_b == described_c and not time_budget and shifted:
        # Same schedule, but forced samples (or a policy that is not deterministic)
        # shifted one run's sample indices: align by the training forwards both recorded.
        mode = "forward"
    elif described_b == described_c and not time_budget:
        mode = "sample"
        if not schedule_b.known:
            mismatches.append(
                _mismatch(
                    "sampling_unknown",
                    False,
                    "Both runs use the same custom sampling policy: sample k is taken to be "
                    "the same training forward in both runs, as it is for a deterministic "
                    "policy.",
                )
            )
    elif schedule_b.known and schedule_c.known:
        mode = "forward"
        detail = (
            "Sampling schedules differ: values are compared only at the training forwards "
            "both runs sampled (and that both kept in their bounded histories), so fewer "
            "points are compared and divergence samples are coarser."
        )
        if time_budget and not exact:
            detail = (
                "Time-budget sampling is not deterministic: only the forwards of its dense "
                "start are known, so values are compared only there."
            )
        mismatches.append(
            _mismatch(
                "sampling",
                True,
                detail,
                baseline=_short(described_b),
                candidate=_short(described_c),
            )
        )
    else:
        mode = "sample"
        mismatches.append(
            _mismatch(
                "sampling",
                True,
                "Sampling schedules differ and at least one cannot be mapped to training "
                "forwards: values are compared at equal sample indices, which need not be "
                "the same training forwards.",
                baseline=_short(described_b),
                candidate=_short(described_c),
            )
        )
    if mode == "forward" and shifted and described_b == described_c and not extra:
        mismatches.append(
            _mismatch(
                "sample_forwards_differ",
                False,
                "Both runs describe the same sampling policy but took their samples at "
                "different training forwards (a policy that is not deterministic, or "
                "samples added by direct forward calls): they are compared at the "
                "training forwards both sampled, as each run recorded them.",
            )
        )
    for role, (forwards, expected, seen) in extra.items():
        cause = (
            f"The {role} took {seen} samples in {forwards} training forwards where its "
            f"schedule takes {expected}: the non-finite sentinel (8 forced samples after a "
            f"hit) or direct forward calls added samples"
        )
        if mode == "forward" and shifted:
            detail = (
                f"{cause}. Both runs recorded each sample's training forward, so the "
                "values are compared at the training forwards both sampled."
            )
        else:
            detail = (
                f"{cause}, so after the first extra one a sample index is not the "
                "scheduled training forward."
            )
        mismatches.append(_mismatch("extra_samples", not (mode == "forward" and shifted), detail))
    if mode == "sample":
        end = min(baseline.samples_seen, candidate.samples_seen) - 1
    else:
        ends = []
        for run, schedule in ((baseline, schedule_b), (candidate, schedule_c)):
            forwards = run.int_field("forwards_seen")
            if forwards is None:
                last = schedule.forward(max(run.samples_seen - 1, 0))
                forwards = last + 1 if last is not None else 0
            ends.append(forwards - 1)
        end = min(ends)
    return _Axis(mode, schedule_b, schedule_c, end), mismatches


def _config_mismatches(baseline: SeriesFile, candidate: SeriesFile) -> list[dict[str, Any]]:
    mismatches: list[dict[str, Any]] = []
    if baseline.modules_selected != candidate.modules_selected:
        only_b = baseline.modules_selected - candidate.modules_selected
        only_c = candidate.modules_selected - baseline.modules_selected
        mismatches.append(
            _mismatch(
                "modules",
                True,
                f"Module sets differ ({len(baseline.modules_selected)} selected in the "
                f"baseline, {len(candidate.modules_selected)} in the candidate): only "
                f"modules selected in both are compared. Only in the baseline: "
                f"{_names(only_b) or 'none'}. Only in the candidate: {_names(only_c) or 'none'}.",
            )
        )
    if baseline.config.get("track") != candidate.config.get("track"):
        mismatches.append(
            _mismatch(
                "track",
                True,
                "Tracking configurations differ (warm-up length, history points, ...): the "
                "noise estimates and the sample indices kept in the histories differ.",
                baseline=_short(baseline.config.get("track")),
                candidate=_short(candidate.config.get("track")),
            )
        )
    keys = sorted(
        (set(baseline.config) | set(candidate.config))
        - _IGNORED_CONFIG_KEYS
        - {"sampling", "track"}
    )
    differing = [k for k in keys if baseline.config.get(k) != candidate.config.get(k)]
    if differing:
        mismatches.append(
            _mismatch(
                "configuration",
                True,
                f"Observation options differ: {', '.join(differing)}; the two runs may not "
                f"observe the same calls and tensors.",
                baseline=_short({k: baseline.config.get(k) for k in differing}),
                candidate=_short({k: candidate.config.get(k) for k in differing}),
            )
        )
    for role, run in (("baseline", baseline), ("candidate", candidate)):
        if run.omitted:
            mismatches.append(
                _mismatch(
                    "series_truncated",
                    True,
                    f"The {role}'s series.json left out {run.omitted} series (its byte "
                    f"bound, ReportConfig.series_summary_max_bytes): those, the last in "
                    f"forward order, are not compared and cannot be called absent.",
                )
            )
    for name in ("world_size", "rank"):
        if baseline.run.get(name) != candidate.run.get(name):
            mismatches.append(
                _mismatch(
                    name,
                    False,
                    f"The runs state different {name.replace('_', ' ')}s "
                    f"({baseline.run.get(name)} and {candidate.run.get(name)}).",
                )
            )
    if baseline.run.get("versions") != candidate.run.get("versions"):
        mismatches.append(
            _mismatch(
                "versions",
                False,
                "Library versions differ: numerics may differ slightly before the modification.",
                baseline=_short(baseline.run.get("versions")),
                candidate=_short(candidate.run.get("versions")),
            )
        )
    forwards_b, forwards_c = (
        baseline.int_field("forwards_seen"),
        candidate.int_field("forwards_seen"),
    )
    if forwards_b is not None and forwards_c is not None:
        lengths, unit = (forwards_b, forwards_c), "training forwards"
    else:
        lengths, unit = (baseline.samples_seen, candidate.samples_seen), "samples"
    if lengths[0] != lengths[1]:
        mismatches.append(
            _mismatch(
                "length",
                False,
                f"The runs have different lengths ({lengths[0]} and {lengths[1]} {unit}): "
                f"only their common span is compared.",
            )
        )
    return mismatches
