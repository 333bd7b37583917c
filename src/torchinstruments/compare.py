"""Compare a baseline run with a candidate run: where inside the model do they first part?

    baseline/series.json  ─┐
                           ├─ read one at a time ─> per-series points ─> comparison.json
    candidate/series.json ─┘                                        └─> comparison.md

Every observed run writes ``series.json`` beside ``report.json``: per series (module, call
index, signal, tensor path, metric), its values at the sample indices of its bounded
history, its warm-up standard deviation and its per-sample volatility
(:func:`torchinstruments.report.build_series_summary`). :func:`compare_runs` reads the
two summaries, one at a time, and writes a bounded ``comparison.json`` and
``comparison.md``: the series present in only one run, per category the series that
differ most, and the first points of divergence, earliest first. See
:func:`compare_runs` for the statistic and its threshold.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ._document import (
    DEFAULT_MAX_BYTES,
    longest_fitting_prefix,
    number_text,
    round_number,
    round_robin,
    shrink_to_fit,
)
from ._jsonio import (
    atomic_write,
    dumps_report,
)
from ._metrics import (
    COMPARISON_FRACTION_FLOOR,
    COMPARISON_LOG_FLOOR,
    IDENTICAL_FRACTION_FLOOR,
    IDENTICAL_LOG_FLOOR,
    LOG_SCALE_METRICS,
    MAD_TO_STD,
    TINY,
)
from ._series_file import (
    MAX_SERIES_FILE_BYTES,
    SeriesFile,
    SeriesKey,
    SeriesRow,
    read_series_file,
)
from ._validate import require_float, require_int
from .errors import ConfigError
from .find import display_module
from .sampling import SampleForwards, policy_from_description
from .series import ACTIVATION, GRAD_OUTPUT

__all__ = [
    "COMPARISON_INDEX_NAME",
    "COMPARISON_NAME",
    "COMPARISON_SCHEMA",
    "DEFAULT_MAX_BYTES",
    "DIVERGENCE_THRESHOLD",
    "PERSISTENCE_POINTS",
    "compare_runs",
    "first_divergence_lines",
    "noise_floor",
    "render_comparison_markdown",
    "sustained_departure",
]

COMPARISON_SCHEMA = "torchinstruments.comparison/1"
COMPARISON_NAME = "comparison.json"
COMPARISON_INDEX_NAME = "comparison.md"
#: Departure, in noise units, beyond which a series has notably diverged.
DIVERGENCE_THRESHOLD = 5.0
#: Consecutive compared points (same sign) a departure must last to count.
PERSISTENCE_POINTS = 2
#: A ``series.json`` larger than this (bytes) is unreadable.
MAX_SOURCE_BYTES = MAX_SERIES_FILE_BYTES
#: Compared points at which every common series must agree exactly for the runs to be
#: taken as identical before their first difference (a same-seed pair).
MIN_IDENTICAL_POINTS = 3
#: Share of the compared modules whose activations depart at the runs' first difference
#: that makes the first divergence model-wide (``<model>``): every weight moved at once
#: (a learning rate, an optimizer setting), not a module.
MODEL_WIDE_DIVERGENCE_SHARE = 0.5
#: At the first difference of an identical pair, the origin is the first activation in
#: forward order whose departure is at least this share of the largest there: between two
#: samples the optimizer carries a fault's gradient upstream, so modules before it move a
#: little, the module itself most.
DIVERGENCE_ORIGIN_SHARE = 0.25
#: At the first difference of an identical pair, the output gradients lead when their
#: largest departure of a scale metric is at least this many times the activations': a fault of
#: the backward pass (a gradient scaled or cut) moves activations only through the few
#: optimizer steps since the last sample (23x in a GPT-2 whose gradient was scaled by
#: 0.05), while a fault of the forward pass, or of the optimizer (a learning rate x30),
#: moves both about alike (at most 2.2x over the forward and optimizer faults of the
#: real-model benchmark). This test comes before the model-wide one.
GRADIENT_LEADS_FACTOR = 5.0
#: Module name of a model-wide first divergence.
MODEL = "<model>"
#: Entries listed per category, first divergences listed, one-run tensors listed per side.
TOP_PER_CATEGORY = 10
MAX_FIRST_DIVERGENCES = 20
MAX_ONE_RUN_ENTRIES = 100
#: ``[sample, baseline, candidate]`` points carried by each category entry.
POINTS_PER_ENTRY = 12

#: Category -> the (signal, metric) series it compares. Scale categories compare
#: activation ``rms`` and output-gradient ``rms_to_root`` (net of the loss gradient, as
#: the report ranks them); ``non_finite`` compares the first non-finite sample.
CATEGORIES: dict[str, tuple[tuple[str, str], ...]] = {
    "non_finite": ((ACTIVATION, "nonfinite_fraction"), (GRAD_OUTPUT, "nonfinite_fraction")),
    "activation_scale": ((ACTIVATION, "rms"),),
    "gradient_scale": ((GRAD_OUTPUT, "rms_to_root"),),
    "zero_fraction": ((ACTIVATION, "zero_fraction"), (GRAD_OUTPUT, "zero_fraction")),
}
_VALUE_CATEGORIES = ("activation_scale", "gradient_scale", "zero_fraction")
#: Configuration keys of ``series.json`` that do not change what is measured.
_IGNORED_CONFIG_KEYS = frozenset({"report"})

TensorKey = tuple[str, int, str, str]

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


# ---------------------------------------------------------------------- statistics
def noise_floor(metric: str, *, log_scale: bool) -> float:
    """Smallest run-to-run noise assumed for ``metric``, in compared units.

    Args:
        metric: the metric name (``rms``, ``rms_to_root``, ``zero_fraction``, ...).
        log_scale: whether the metric is compared in natural log (scale metrics).

    Returns:
        0.1 (natural log, about 10%) for scale metrics; 0.02 for fractions and anything
        else. One run cannot show how much a different initialisation or data order moves
        a series' level (in the example, healthy runs with different seeds differ by up to
        about 35% in activation RMS while each run's own per-sample noise is 1-3%); the
        floor stands for that part of the run-to-run noise.

    Example:
        >>> noise_floor("rms", log_scale=True), noise_floor("zero_fraction", log_scale=False)
        (0.1, 0.02)
    """
    del metric
    return COMPARISON_LOG_FLOOR if log_scale else COMPARISON_FRACTION_FLOOR


def sustained_departure(
    departures: Sequence[float], *, persistence: int = PERSISTENCE_POINTS
) -> float:
    """The largest departure held, with one sign, over ``persistence`` consecutive points.

    Args:
        departures: signed departures (candidate minus baseline, in noise units) at the
            compared points, in time order.
        persistence: consecutive points the departure must last (at least 1).

    Returns:
        ``max`` over windows of ``persistence`` consecutive points whose departures share
        a sign of the smallest absolute departure in the window; 0.0 when there is no
        such window. A one-point spike does not count; a step that stays does.

    Example:
        >>> sustained_departure([0.0, 9.0, 0.0, 6.0, 7.0, -8.0])
        6.0
    """
    best = 0.0
    for start in range(len(departures) - persistence + 1):
        window = departures[start : start + persistence]
        if all(d > 0 for d in window) or all(d < 0 for d in window):
            best = max(best, min(abs(d) for d in window))
    return best


def _first_departure(departures: Sequence[float], threshold: float, persistence: int) -> int | None:
    """Index of the first point that starts ``persistence`` same-sign departures beyond
    ``threshold``."""
    for start in range(len(departures) - persistence + 1):
        window = departures[start : start + persistence]
        if all(d >= threshold for d in window) or all(d <= -threshold for d in window):
            return start
    return None


# ---------------------------------------------------------------------- schedules
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


def _read_run(directory: str | os.PathLike[str], role: str) -> SeriesFile:
    """Read and reduce one run's ``series.json``; raise ``ReportReadError`` naming it."""
    if not isinstance(directory, str | os.PathLike) or str(directory) == "":
        raise ConfigError(f"compare_runs: {role}_dir must be a non-empty path, got {directory!r}")
    return read_series_file(Path(directory), role)


# ---------------------------------------------------------------------- alignment
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


# ---------------------------------------------------------------------- comparing
@dataclass(slots=True)
class _Noise:
    sigma: float
    basis: str
    parts: dict[str, float]


def _detrended_spread(times: Sequence[int], values: Sequence[float]) -> float:
    """Robust per-point noise of a trending series: the median absolute deviation of each
    point from the straight line through its two neighbours (at their own times), scaled
    to a standard deviation (``MAD_TO_STD``) and divided by sqrt(1.5), the deviation's
    standard deviation in units of the points' own for independent noise at even
    spacing. A smooth trend of any slope leaves it small, where differences between
    consecutive points would grow with the slope."""
    deviations: list[float] = []
    for i in range(1, len(values) - 1):
        t0, t1, t2 = times[i - 1], times[i], times[i + 1]
        if t2 == t0:
            continue
        line = values[i - 1] + (values[i + 1] - values[i - 1]) * (t1 - t0) / (t2 - t0)
        deviations.append(abs(values[i] - line))
    if not deviations:
        return 0.0
    return MAD_TO_STD * statistics.median(deviations) / math.sqrt(1.5)


def _noise(
    series: SeriesRow,
    metric: str,
    times: Sequence[int],
    values: Sequence[float],
    *,
    identical_before: bool = False,
) -> _Noise:
    """The run-to-run noise of one baseline series, in compared units: the largest of a
    floor, the series' own trend-residual spread, its residual volatility and the
    detrended spread of the compared points (``times`` in the comparison's axis, values
    in compared units). All but the floor follow a trend, so that a series that drifts
    steeply in early training does not hide a later step behind an inflated spread
    (files without a residual spread fall back on the warm-up standard deviation).
    ``identical_before``: the runs agreed exactly before (a same-seed pair up to their
    first difference): their difference had no noise at all until then, so the series'
    own variability over time (its trend residuals, volatility and point spread) says
    nothing about it; only a tenth of the floor applies."""
    floor = noise_floor(metric, log_scale=series.log_scale)
    if identical_before:
        floor = IDENTICAL_LOG_FLOOR if series.log_scale else IDENTICAL_FRACTION_FLOOR
        return _Noise(floor, "floor", {"floor": floor})
    parts = {
        "floor": floor,
        "residual_spread": (
            series.residual_spread
            if series.residual_spread is not None
            else series.baseline_std or 0.0
        ),
        "volatility": series.volatility or 0.0,
        "point_spread": _detrended_spread(times, values),
    }
    basis = max(parts, key=lambda k: parts[k])
    return _Noise(parts[basis], basis, parts)


@dataclass(slots=True)
class _Event:
    """A divergence: one series (or tensor) departs, stops, appears or goes non-finite."""

    key: int
    kind: str
    side: str | None
    module: str
    call_index: int
    signal: str
    tensor_path: str
    metric: str | None
    position: int
    fields: dict[str, Any]

    def order(self) -> tuple[Any, ...]:
        gradient = self.signal == GRAD_OUTPUT
        return (
            self.key,
            1 if gradient else 0,
            -self.position if gradient else self.position,
            self.module,
            self.call_index,
            self.tensor_path,
            self.metric or "",
        )


@dataclass(slots=True)
class _ValueResult:
    key: SeriesKey
    position: int
    score: float
    notable: bool
    entry: dict[str, Any]
    first_key: int | None


def _series_name(key: SeriesKey | TensorKey) -> str:
    module, call, signal, path = key[:4]
    metric = f".{key[4]}" if len(key) > 4 else ""
    return f"`{module}` call {call} {signal}{metric} ({path})"


def _difference_text(series: SeriesRow, baseline: float, candidate: float) -> str:
    if series.log_scale:
        ratio = max(candidate, TINY) / max(baseline, TINY)
        return f"{number_text(baseline)} -> {number_text(candidate)} ({number_text(ratio)}x)"
    return f"{number_text(baseline)} -> {number_text(candidate)} ({candidate - baseline:+.4g})"


def _downsample(rows: list[list[Any]], limit: int) -> list[list[Any]]:
    if len(rows) <= limit:
        return rows
    step = (len(rows) - 1) / (limit - 1)
    return [rows[round(i * step)] for i in range(limit)]


def _points(series: SeriesRow, axis: _Axis, side: str) -> dict[int, float]:
    """A series' kept points by axis key, through the compared end."""
    points = {}
    for sample, value in zip(series.samples, series.values, strict=True):
        k = axis.key(side, sample)
        if k is not None and k <= axis.end:
            points[k] = value
    return points


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _first_difference(
    baseline: SeriesFile, candidate: SeriesFile, keys: Sequence[SeriesKey], axis: _Axis
) -> int | None:
    """The first axis key at which any common series differs between the runs, when
    every common series agreed exactly at the ``MIN_IDENTICAL_POINTS`` or more compared
    points before it (a same-seed pair whose runs were identical until then); else None
    (the runs differ from the start, or never)."""
    first: int | None = None
    agreeing: set[int] = set()
    for key in keys:
        points_b = _points(baseline.series[key], axis, "baseline")
        points_c = _points(candidate.series[key], axis, "candidate")
        for k in sorted(points_b.keys() & points_c.keys()):
            if first is not None and k >= first:
                break
            if not _same(points_b[k], points_c[k]):
                first = k
                break
            agreeing.add(k)
    if first is None:
        return None
    if sum(1 for k in agreeing if k < first) < MIN_IDENTICAL_POINTS:
        return None
    return first


def _compare_values(
    key: SeriesKey,
    base: SeriesRow,
    cand: SeriesRow,
    axis: _Axis,
    threshold: float,
    warmup: tuple[int | None, int | None],
    first_difference: int | None = None,
) -> _ValueResult | None:
    points_b = _points(base, axis, "baseline")
    points_c = _points(cand, axis, "candidate")
    common = sorted(points_b.keys() & points_c.keys())
    if not common:
        return None
    compared_b = [base.compared(points_b[k]) for k in common]
    noise = _noise(base, key[4], common, compared_b)
    sigmas = [noise.sigma] * len(common)
    identical: _Noise | None = None
    if first_difference is not None:
        # The runs were identical before their first difference: there, and for the
        # persistence window after it, the departure is judged without the run-to-run
        # floor (later points, where a same-seed pair drifts apart, keep it).
        identical = _noise(base, key[4], common, compared_b, identical_before=True)
        at = [i for i, k in enumerate(common) if k >= first_difference][:PERSISTENCE_POINTS]
        for i in at:
            sigmas[i] = identical.sigma
    departures = [
        (base.compared(points_c[k]) - compared_b[i]) / sigmas[i] for i, k in enumerate(common)
    ]
    score = sustained_departure(departures)
    first = _first_departure(departures, threshold, PERSISTENCE_POINTS)
    largest = max(range(len(common)), key=lambda i: abs(departures[i]))
    notable = first is not None
    warm_b, warm_c = warmup
    entry: dict[str, Any] = {
        "module": key[0],
        "call_index": key[1],
        "signal": key[2],
        "tensor_path": key[3],
        "metric": key[4],
        "forward_position": base.forward_position,
        "notable": notable,
        "sustained_departure": round_number(score),
        "points_compared": len(common),
    }
    if first is not None:
        k = common[first]
        beyond = sum(1 for d in departures[first:] if abs(d) >= threshold)
        entry["first_divergence"] = {
            **axis.when(k),
            "last_agreeing": axis.when(common[first - 1]) if first > 0 else None,
            "baseline": round_number(points_b[k]),
            "candidate": round_number(points_c[k]),
            "departure": round_number(departures[first]),
            "noise": {
                "sigma": round_number(sigmas[first]),
                "basis": "floor at first difference"
                if identical is not None and sigmas[first] == identical.sigma
                else noise.basis,
            },
            "points_beyond_threshold_after": beyond,
            "points_after": len(common) - first,
        }
    k = common[largest]
    entry["largest"] = {
        **axis.when(k),
        "baseline": round_number(points_b[k]),
        "candidate": round_number(points_c[k]),
        "departure": round_number(departures[largest]),
    }
    noise_entry: dict[str, Any] = {
        "sigma": round_number(noise.sigma),
        "basis": noise.basis,
        "units": "natural log" if base.log_scale else "absolute",
        **{name: round_number(value) for name, value in noise.parts.items()},
    }
    entry["noise"] = noise_entry
    if identical is not None:
        noise_entry["at_first_difference"] = {
            "sigma": round_number(identical.sigma),
            "basis": identical.basis,
            "points": PERSISTENCE_POINTS,
        }
    entry["end"] = {
        "baseline_ema_fast": round_number(base.ema_fast),
        "candidate_ema_fast": round_number(cand.ema_fast),
    }
    entry["warmup_complete"] = {
        "baseline": None if warm_b is None else base.count >= warm_b,
        "candidate": None if warm_c is None else cand.count >= warm_c,
    }
    rows = [[k, round_number(points_b[k]), round_number(points_c[k])] for k in common]
    entry["points_axis"] = "sample" if axis.mode == "sample" else "forward"
    entry["points"] = _downsample(rows, POINTS_PER_ENTRY)
    return _ValueResult(
        key,
        base.forward_position,
        score,
        notable,
        entry,
        common[first] if first is not None else None,
    )


def _value_interpretation(entry: dict[str, Any], base: SeriesRow, threshold: float) -> str:
    name = _series_name(
        (
            entry["module"],
            entry["call_index"],
            entry["signal"],
            entry["tensor_path"],
            entry["metric"],
        )
    )
    noise = entry["noise"]
    first = entry.get("first_divergence")
    largest = entry["largest"]
    units = "ln" if base.log_scale else "absolute"
    noise_text = f"noise {number_text(noise['sigma'])} {units}, from {noise['basis']}"
    if first is None:
        return (
            f"{name} stays within {threshold:g} noise units of the baseline for "
            f"{PERSISTENCE_POINTS} consecutive compared points; its largest single departure "
            f"is {number_text(largest['departure'])} units at {_describe_when(largest)} "
            f"({_difference_text(base, largest['baseline'] or 0.0, largest['candidate'] or 0.0)}; "
            f"{noise_text})."
        )
    at_first = first.get("noise")
    if isinstance(at_first, dict):
        noise_text = f"noise {number_text(at_first['sigma'])} {units}, from {at_first['basis']}"
    agreeing = first.get("last_agreeing")
    after = f", after agreeing at {_describe_when(agreeing)}" if agreeing else ""
    return (
        f"{name}: the candidate departs from the baseline from {_describe_when(first)}{after}: "
        f"{_difference_text(base, first['baseline'] or 0.0, first['candidate'] or 0.0)}, "
        f"{number_text(first['departure'])} noise units ({noise_text}); "
        f"{first['points_beyond_threshold_after']} of the {first['points_after']} compared "
        f"points from there stay beyond {threshold:g} units."
    )


def _neighbour_text(
    event: _Event, neighbours: dict[tuple[str, int], TensorKey], earliest: dict[TensorKey, int]
) -> tuple[str, str | None]:
    """What the call before (activations) or after (gradients) in forward order did.

    Returns:
        A sentence, and the neighbour's name when it departed at or before ``event``
        (then ``event`` is likely its echo), else None.
    """
    gradient = event.signal == GRAD_OUTPUT
    neighbour = neighbours.get((event.signal, event.position + (1 if gradient else -1)))
    relation = (
        "the call after it in forward order (before it in the backward pass)"
        if gradient
        else "the call before it in forward order"
    )
    if neighbour is None:
        edge = "last" if gradient else "first"
        return f"It is the {edge} observed call in forward order.", None
    when = earliest.get(neighbour)
    name = f"`{neighbour[0]}` call {neighbour[1]}"
    if when is None or when > event.key:
        return (
            f"{name}, {relation}, still agrees there: the change enters at `{event.module}`.",
            None,
        )
    timing = "departs at the same point" if when == event.key else "departed earlier"
    return f"{name}, {relation}, {timing}: `{event.module}` may be its echo.", name


def _value_experiment(event: _Event, when: str, neighbour: tuple[str, str | None]) -> str:
    sentence, origin = neighbour
    if origin is not None:
        return (
            f"{sentence} Follow {origin}'s divergence first; if `{event.module}` call "
            f"{event.call_index} still departs from the baseline after {when} once {origin} "
            f"agrees, undo the modification only at `{event.module}` (same seed, data order "
            f"and precision) and compare again."
        )
    direction = (
        "downstream (later in forward order)"
        if event.signal == ACTIVATION
        else "upstream (earlier in forward order)"
    )
    return (
        f"{sentence} Rerun the candidate with the same seed, data order and precision, "
        f"undoing the modification only at `{event.module}` (its code, weights or the input "
        f"it receives); if `{event.module}` call {event.call_index} then stays within noise "
        f"of the baseline past {when}, the change there is the cause and later departures "
        f"{direction} are its echoes. Observe both runs with inject_observer(..., "
        f"sampling=1) around {when} to pin the exact training forward."
    )


def _presence(series: Iterable[tuple[SeriesKey, SeriesRow]]) -> dict[TensorKey, dict[str, Any]]:
    """Per tensor (module, call, signal, path): observed span, count, metrics, position."""
    out: dict[TensorKey, dict[str, Any]] = {}
    for key, s in series:
        if not s.samples:
            continue
        tensor = key[:4]
        entry = out.get(tensor)
        if entry is None:
            out[tensor] = {
                "first": s.samples[0],
                "last": s.samples[-1],
                "count": s.count,
                "metrics": [key[4]],
                "position": s.forward_position,
            }
        else:
            entry["first"] = min(entry["first"], s.samples[0])
            entry["last"] = max(entry["last"], s.samples[-1])
            entry["count"] = max(entry["count"], s.count)
            entry["metrics"].append(key[4])
    return out


def _dense(span: dict[str, Any]) -> bool:
    return span["count"] == span["last"] - span["first"] + 1


def _stop_event(
    tensor: TensorKey,
    stopped: dict[str, Any],
    going: dict[str, Any],
    side: str,
    axis: _Axis,
    position: int,
) -> _Event | None:
    """The candidate (``side``) stopped observing ``tensor`` while the other run went on."""
    other = "baseline" if side == "candidate" else "candidate"
    key = axis.key(side, stopped["last"] + 1)
    going_last = axis.key(other, going["last"])
    if key is None or going_last is None or key > axis.end or going_last < key:
        return None
    if not (_dense(stopped) and _dense(going)):
        return None  # a call that comes and goes (a routed expert, a branch) proves nothing
    last = axis.when(axis.key(side, stopped["last"]) or 0)
    module, call, signal, path = tensor
    when = axis.when(key)
    interpretation = (
        f"{_series_name(tensor)} is observed in the {other} through "
        f"{_describe_when(axis.when(going_last))} but in the {side} only through "
        f"{_describe_when(last)}: from {_describe_when(when)} the {side} no longer calls it "
        f"(or it no longer returns a floating tensor there)."
    )
    experiment = (
        f"Find what skips `{module}` in the {side} from {_describe_when(when)} (a flag, a "
        f"branch, a replaced forward or module); restore only that call in the {side}, with "
        f"the same seed, data order and precision, and compare again: if the runs then "
        f"agree past that point, the skipped call is the cause."
    )
    return _Event(
        key,
        "stopped",
        side,
        module,
        call,
        signal,
        path,
        None,
        position,
        {
            **when,
            "last_observed": last,
            "interpretation": interpretation,
            "next_experiment": experiment,
        },
    )


def _one_run_entries(
    only: dict[TensorKey, dict[str, Any]],
    side: str,
    other: SeriesFile,
    axis: _Axis,
) -> tuple[list[dict[str, Any]], list[_Event]]:
    entries: list[dict[str, Any]] = []
    events: list[_Event] = []
    for tensor, span in sorted(only.items(), key=lambda item: (item[1]["position"], item[0])):
        module, call, signal, path = tensor
        explained = None
        if module not in other.modules_selected:
            explained = "module not selected in the other run"
        elif other.omitted:
            explained = "the other run's series.json was truncated"
        first_key = axis.key(side, span["first"])
        first_when = axis.when(first_key) if first_key is not None else None
        entry = {
            "module": module,
            "call_index": call,
            "signal": signal,
            "tensor_path": path,
            "forward_position": span["position"],
            "metrics": sorted(span["metrics"]),
            "first_sample": span["first"],
            "last_sample": span["last"],
            "count": span["count"],
            "explained_by": explained,
        }
        entries.append(entry)
        if explained is None and first_key is not None and first_key <= axis.end:
            missing = "candidate" if side == "baseline" else "baseline"
            interpretation = (
                f"{_series_name(tensor)} is observed only in the {side}, from "
                f"{_describe_when(first_when or {})}: the {missing} never observes it (a "
                f"call {'removed from' if side == 'baseline' else 'added to'} the candidate, "
                f"or a call that stopped returning a floating tensor)."
            )
            experiment = (
                f"{'Restore' if side == 'baseline' else 'Bypass'} only that call of "
                f"`{module}` in the candidate, with the same seed, data order and precision, "
                f"and compare again: if the runs then agree, that call is the cause."
            )
            events.append(
                _Event(
                    first_key,
                    f"only_in_{side}",
                    side,
                    module,
                    call,
                    signal,
                    path,
                    None,
                    span["position"],
                    {
                        **(first_when or {}),
                        "interpretation": interpretation,
                        "next_experiment": experiment,
                    },
                )
            )
    return entries, events


def _non_finite_event(
    key: SeriesKey, base: SeriesRow, cand: SeriesRow, axis: _Axis
) -> _Event | None:
    first_b = base.first_nonzero_sample
    first_c = cand.first_nonzero_sample
    key_b = axis.key("baseline", first_b) if first_b is not None else None
    key_c = axis.key("candidate", first_c) if first_c is not None else None
    if key_b is not None and key_b > axis.end:
        key_b = None
    if key_c is not None and key_c > axis.end:
        key_c = None
    if key_c is not None and (key_b is None or key_c < key_b):
        side, at, other_key = "candidate", key_c, key_b
    elif key_b is not None and (key_c is None or key_b < key_c):
        side, at, other_key = "baseline", key_b, key_c
    else:
        return None
    other = "baseline" if side == "candidate" else "candidate"
    when = axis.when(at)
    other_text = (
        f"the {other}'s first is at {_describe_when(axis.when(other_key))}"
        if other_key is not None
        else f"the {other} has none through {_describe_when(axis.when(axis.end))}"
    )
    module, call, signal, path, metric = key
    return _Event(
        at,
        "non_finite",
        side,
        module,
        call,
        signal,
        path,
        metric,
        base.forward_position,
        {
            **when,
            "interpretation": (
                f"{_series_name(key[:4])} has its first non-finite value in the {side} at "
                f"{_describe_when(when)}; {other_text}."
            ),
            "next_experiment": (
                f"Rerun the {side} with inject_observer(..., sampling=1, full_sentinel=True) "
                f"to name the exact training forward and the first module in forward order "
                f"that produces a non-finite value, then upcast or clamp only there and "
                f"compare again."
            ),
        },
    )


def _profile_at_first_difference(
    events: list[_Event], first_difference: int, modules_compared: int, first_module: str
) -> tuple[list[_Event], dict[str, Any] | None]:
    """Order the activation departures at an identical pair's first difference by where
    their profile along depth begins (``DIVERGENCE_ORIGIN_SHARE``), and say whether the
    whole model moved at once there: ``MODEL_WIDE_DIVERGENCE_SHARE`` of the
    ``modules_compared`` depart, the model's first module (``first_module``, in forward
    order) among them. A fault at one module reaches the modules before it only through
    the weights the optimizer changed since the last sample, a run-level change moves
    the first module as much as any. Returns the events in their new order and the
    model-wide record, or None. When the output gradients depart far more than the
    activations there (``GRADIENT_LEADS_FACTOR``), the first gradient in backward order
    whose departure reaches ``DIVERGENCE_ORIGIN_SHARE`` of their largest leads instead."""
    at = [
        e
        for e in events
        if e.key == first_difference and e.kind == "value" and e.signal == ACTIVATION
    ]
    gradients = sorted(
        (
            e
            for e in events
            if e.key == first_difference and e.kind == "value" and e.signal == GRAD_OUTPUT
        ),
        key=_Event.order,
    )
    if not at and not gradients:
        return events, None
    at.sort(key=_Event.order)
    largest = max((abs(e.fields["departure"] or 0.0) for e in at), default=0.0)
    # Gradients against activations: scale metrics only (log units with one floor), as
    # fractions are counted in units of another size.
    largest_gradient, largest_scale = (
        max(
            (abs(e.fields["departure"] or 0.0) for e in group if e.metric in LOG_SCALE_METRICS),
            default=0.0,
        )
        for group in (gradients, at)
    )
    root = display_module("")
    departing = {e.module for e in at if e.module not in ("", root)}  # not a compared module
    share = len(departing) / max(modules_compared, 1)
    model_wide = first_module in departing and share >= MODEL_WIDE_DIVERGENCE_SHARE
    ordered = list(events)
    if largest_gradient > 0.0 and largest_gradient >= GRADIENT_LEADS_FACTOR * largest_scale:
        # A fault of the backward pass: the gradients lead, from the first in backward
        # order whose departure reaches the share of their largest (activations that all
        # moved, through the optimizer steps since the last sample, are its echoes).
        origin = next(
            e
            for e in gradients
            if e.metric in LOG_SCALE_METRICS
            and abs(e.fields["departure"] or 0.0) >= DIVERGENCE_ORIGIN_SHARE * largest_gradient
        )
        anchor = at[0] if at else gradients[0]
        if origin is not anchor:
            ordered.remove(origin)
            ordered.insert(ordered.index(anchor), origin)
        return ordered, None
    if not at:
        return events, None
    origin = next(
        e for e in at if abs(e.fields["departure"] or 0.0) >= DIVERGENCE_ORIGIN_SHARE * largest
    )
    # The origin moves ahead of the activation departures before it at that point only;
    # a module that stopped being called or turned non-finite there keeps its place.
    if origin is not at[0]:
        ordered.remove(origin)
        ordered.insert(ordered.index(at[0]), origin)
    if not model_wide:
        return ordered, None
    origin = at[0]
    when = {
        k: origin.fields[k] for k in ("sample", "forward", "candidate_sample") if k in origin.fields
    }
    described = _describe_when(when)
    record = {
        "kind": "model_wide",
        "side": "candidate",
        "module": MODEL,
        "call_index": None,
        "signal": ACTIVATION,
        "tensor_path": None,
        "metric": origin.metric,
        "forward_position": origin.position,
        **when,
        "share_of_modules": share,
        "modules_departing": len(departing),
        "modules_compared": modules_compared,
        "first_in_forward_order": {
            "module": origin.module,
            "call_index": origin.call_index,
            "tensor_path": origin.tensor_path,
            "metric": origin.metric,
            "departure": origin.fields["departure"],
        },
        "last_agreeing": origin.fields.get("last_agreeing"),
        "interpretation": (
            f"The runs were identical before {described}; there "
            f"{len(departing)} of {modules_compared} compared modules' activations depart "
            f"at once ({share:.0%}), the model's first module ({origin.module}) among them: "
            f"every weight moved differently, the mark of a run-level "
            f"change (learning rate or schedule, optimizer settings or state, data, loss "
            f"scale), not of one module."
        ),
        "next_experiment": (
            "Diff the two runs' optimizer settings and state, learning-rate schedule, data "
            f"pipeline and loss scaling at the step before {described}; rerun the "
            "candidate with each restored in turn."
        ),
    }
    return ordered, record


def _event_record(event: _Event) -> dict[str, Any]:
    return {
        "kind": event.kind,
        "side": event.side,
        "module": event.module,
        "call_index": event.call_index,
        "signal": event.signal,
        "tensor_path": event.tensor_path,
        "metric": event.metric,
        "forward_position": event.position,
        **event.fields,
    }


@dataclass(slots=True)
class _Comparison:
    """Everything before the byte bound."""

    header: dict[str, Any]
    sections: dict[str, list[dict[str, Any]]]
    totals: dict[str, int]
    category_counts: dict[str, dict[str, int]]
    coverage: dict[str, Any]
    threshold: float


def _compare(baseline: SeriesFile, candidate: SeriesFile, threshold: float) -> _Comparison:
    axis, mismatches = _align(baseline, candidate)
    mismatches += _config_mismatches(baseline, candidate)
    notes = []
    if baseline.directory.resolve() == candidate.directory.resolve():
        notes.append("Baseline and candidate are the same directory.")
    weak = any(m["weakens"] for m in mismatches)
    both_selected = baseline.modules_selected & candidate.modules_selected
    warmup = (baseline.warmup_samples, candidate.warmup_samples)

    common_keys = [k for k in baseline.series if k in candidate.series and k[0] in both_selected]
    # Positions: the baseline's forward call order (activations), by tensor.
    neighbours: dict[tuple[str, int], TensorKey] = {}
    for key, s in baseline.series.items():
        neighbours.setdefault((key[2], s.forward_position), key[:4])

    events: list[_Event] = []
    results: dict[str, list[_ValueResult]] = {c: [] for c in _VALUE_CATEGORIES}
    compared = {c: 0 for c in CATEGORIES}
    wanted = {pair: category for category, pairs in CATEGORIES.items() for pair in pairs}
    first_difference = _first_difference(baseline, candidate, common_keys, axis)
    for key in common_keys:
        category = wanted.get((key[2], key[4]))
        if category is None:
            continue
        base, cand = baseline.series[key], candidate.series[key]
        compared[category] += 1
        if category == "non_finite":
            event = _non_finite_event(key, base, cand, axis)
            if event is not None:
                events.append(event)
            continue
        result = _compare_values(key, base, cand, axis, threshold, warmup, first_difference)
        if result is None:
            compared[category] -= 1
            continue
        results[category].append(result)

    # Presence: tensors that one run stops observing, or observes alone.
    span_b = _presence(baseline.series.items())
    span_c = _presence(candidate.series.items())
    for tensor in span_b.keys() & span_c.keys():
        if tensor[0] not in both_selected:
            continue
        b, c = span_b[tensor], span_c[tensor]
        position = b["position"]
        for stopped, going, side in ((c, b, "candidate"), (b, c, "baseline")):
            if stopped["last"] < going["last"]:
                event = _stop_event(tensor, stopped, going, side, axis, position)
                if event is not None:
                    events.append(event)
    only_b = {t: s for t, s in span_b.items() if t not in span_c}
    only_c = {t: s for t, s in span_c.items() if t not in span_b}
    entries_b, events_b = _one_run_entries(only_b, "baseline", candidate, axis)
    entries_c, events_c = _one_run_entries(only_c, "candidate", baseline, axis)
    events += events_b + events_c

    # Value divergences, once every tensor's earliest departure is known.
    earliest: dict[TensorKey, int] = {}
    for event in events:
        tensor = (event.module, event.call_index, event.signal, event.tensor_path)
        earliest[tensor] = min(earliest.get(tensor, event.key), event.key)
    for category in _VALUE_CATEGORIES:
        for result in results[category]:
            if result.first_key is not None:
                tensor = result.key[:4]
                earliest[tensor] = min(earliest.get(tensor, result.first_key), result.first_key)
    for category in _VALUE_CATEGORIES:
        for result in results[category]:
            base = baseline.series[result.key]
            result.entry["interpretation"] = _value_interpretation(result.entry, base, threshold)
            if result.first_key is None:
                continue
            event = _Event(
                result.first_key,
                "value",
                "candidate",
                *result.key,
                result.position,
                {},
            )
            when = _describe_when(axis.when(result.first_key))
            experiment = _value_experiment(
                event, when, _neighbour_text(event, neighbours, earliest)
            )
            result.entry["next_experiment"] = experiment
            first = result.entry["first_divergence"]
            event.fields = {
                **{k: first[k] for k in ("sample", "forward", "candidate_sample") if k in first},
                "category": category,
                "last_agreeing": first["last_agreeing"],
                "baseline": first["baseline"],
                "candidate": first["candidate"],
                "departure": first["departure"],
                "interpretation": result.entry["interpretation"],
                "next_experiment": experiment,
            }
            events.append(event)
    events.sort(key=_Event.order)
    model_wide = None
    if first_difference is not None:
        root = display_module("")
        scales = [
            k
            for k in common_keys
            if k[2] == ACTIVATION and k[0] not in ("", root) and k[4] == "rms"
        ]
        if scales:
            first_module = min(scales, key=lambda k: baseline.series[k].forward_position)[0]
            events, model_wide = _profile_at_first_difference(
                events, first_difference, len({k[0] for k in scales}), first_module
            )

    sections: dict[str, list[dict[str, Any]]] = {}
    totals: dict[str, int] = {}
    category_counts: dict[str, dict[str, int]] = {}
    first_records = [_event_record(e) for e in events]
    if model_wide is not None:
        first_records.insert(0, model_wide)
    sections["first_divergences"] = first_records[:MAX_FIRST_DIVERGENCES]
    totals["first_divergences"] = len(first_records)
    non_finite = [e for e in events if e.kind == "non_finite"]
    sections["non_finite"] = [_event_record(e) for e in non_finite[:TOP_PER_CATEGORY]]
    totals["non_finite"] = len(non_finite)
    category_counts["non_finite"] = {
        "series_compared": compared["non_finite"],
        "notable": len(non_finite),
    }
    for category in _VALUE_CATEGORIES:
        ranked = sorted(
            (r for r in results[category] if r.score > 0),
            key=lambda r: (-r.score, r.key[2] == GRAD_OUTPUT, r.position, r.key),
        )
        sections[category] = [r.entry for r in ranked[:TOP_PER_CATEGORY]]
        totals[category] = len(ranked)
        category_counts[category] = {
            "series_compared": compared[category],
            "notable": sum(1 for r in results[category] if r.notable),
        }
    sections["only_in_baseline"] = entries_b[:MAX_ONE_RUN_ENTRIES]
    totals["only_in_baseline"] = len(entries_b)
    sections["only_in_candidate"] = entries_c[:MAX_ONE_RUN_ENTRIES]
    totals["only_in_candidate"] = len(entries_c)

    notable = len(events)
    first_event = first_records[0] if first_records else None
    headline = _headline(first_event, notable, weak, mismatches, threshold, sum(compared.values()))
    header = {
        "schema": COMPARISON_SCHEMA,
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "strength": "weak" if weak else "full",
        "mismatches": mismatches,
        "notes": notes,
        "summary": {
            "headline": headline,
            "notable_divergences": notable,
            "first_divergence": first_event,
        },
        "baseline": _run_entry(baseline),
        "candidate": _run_entry(candidate),
        "alignment": {
            "axis": axis.mode,
            "compared_through": axis.when(axis.end) if axis.end >= 0 else None,
            "series_baseline": len(baseline.series),
            "series_candidate": len(candidate.series),
            "series_common": len(common_keys),
        },
        "rule": {
            "statistic": (
                "Per series and compared point (a sample index both runs kept in their "
                "bounded histories; the same training forward when the schedules match): "
                "departure = (candidate - baseline) / noise, in natural log for scale "
                "metrics. noise = the largest of the baseline's trend-residual spread, its "
                "residual volatility, the detrended spread of its compared points and a "
                "floor. When every common series agreed exactly at three or more compared "
                "points before the runs' first difference (a same-seed pair), the noise "
                "there and at the next point is a tenth of the usual floor alone: such runs "
                "have no run-to-run noise until then. A series diverges notably at the first point "
                "that starts a run of persistence_points consecutive departures beyond the "
                "threshold with one sign; sustained_departure ranks series within a "
                "category. At an identical pair's first difference, the activation whose "
                "departure is the first along depth to reach a quarter of the largest there "
                "leads, and when half of the compared modules depart there, the model's "
                "first among them, the first divergence is model-wide (<model>)."
            ),
            "threshold": threshold,
            "persistence_points": PERSISTENCE_POINTS,
            "noise_floors": {
                "log_scale": COMPARISON_LOG_FLOOR,
                "fractions": COMPARISON_FRACTION_FLOOR,
            },
            "noise_floors_after_identical_prefix": {
                "log_scale": IDENTICAL_LOG_FLOOR,
                "fractions": IDENTICAL_FRACTION_FLOOR,
            },
            "order": (
                "earliest point first; then activations in forward call order, then output "
                "gradients in reverse forward call order (backward order)"
            ),
        },
    }
    return _Comparison(
        header=header,
        sections=sections,
        totals=totals,
        category_counts=category_counts,
        coverage={"series_compared": dict(compared)},
        threshold=threshold,
    )


def _run_entry(run: SeriesFile) -> dict[str, Any]:
    return {
        "path": str(run.path),
        "samples_seen": run.samples_seen,
        "forwards_seen": run.int_field("forwards_seen"),
        "series": len(run.series),
        "series_omitted_by_source": run.omitted,
        "sampling": _short(_sampling_description(run.config)),
    }


def _headline(
    first: dict[str, Any] | None,
    notable: int,
    weak: bool,
    mismatches: list[dict[str, Any]],
    threshold: float,
    compared: int,
) -> str:
    prefix = ""
    if weak:
        kinds = sorted({m["kind"] for m in mismatches if m["weakens"]})
        prefix = f"Weak comparison (mismatched: {', '.join(kinds)}): "
    if compared == 0 and first is None:
        return prefix + "Nothing to compare: the runs share no compared series."
    if first is None:
        return prefix + (
            f"No notable divergence: every compared series stays within {threshold:g} noise "
            f"units of the baseline (or departs for fewer than {PERSISTENCE_POINTS} "
            f"consecutive compared points)."
        )
    what = {
        "value": f"{first['signal']}.{first['metric']} departs",
        "stopped": f"{first['signal']} is no longer observed in the {first['side']}",
        "only_in_baseline": f"{first['signal']} is observed only in the baseline",
        "only_in_candidate": f"{first['signal']} is observed only in the candidate",
        "non_finite": f"{first['signal']} turns non-finite in the {first['side']}",
        "model_wide": (
            f"{first['signal']} departs at {first.get('modules_departing')} of "
            f"{first.get('modules_compared')} modules at once"
        ),
    }[first["kind"]]
    if first["kind"] == "model_wide":
        return prefix + (
            f"First divergence at {_describe_when(first)}: the whole model (`{MODEL}`), "
            f"{what} ({notable} divergence(s) in all)."
        )
    return prefix + (
        f"First divergence at {_describe_when(first)}: `{first['module']}` call "
        f"{first['call_index']} {what} ({notable} divergence(s) in all)."
    )


# ---------------------------------------------------------------------- bounding
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


# ---------------------------------------------------------------------- markdown
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


# ---------------------------------------------------------------------- entry point
def compare_runs(
    baseline_dir: str | os.PathLike[str],
    candidate_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    threshold: float = DIVERGENCE_THRESHOLD,
) -> Path:
    """Compare a candidate run with a baseline run and say where they first part.

    Reads ``series.json`` of the baseline, then of the candidate (one parsed file in
    memory at a time), and writes ``comparison.json`` (at most ``max_bytes`` bytes as
    written: lists are cut round-robin and what was cut is counted under
    ``coverage.omitted``) and ``comparison.md`` into ``output_dir``, atomically.

    **The statistic.** Series are matched by (module, call index, signal, tensor path,
    metric) and compared at the points both runs kept in their bounded histories: the same
    sample index, which the deterministic schedule makes the same training forward (when
    the schedules differ, at the training forwards both sampled). At each point::

        departure = (candidate - baseline) / noise      # ln values for scale metrics

    where ``noise`` is the baseline's own variability: the largest of its warm-up standard
    deviation, its per-sample volatility (RMS change, end of run), 1.4826 x the median
    absolute change between consecutive history points, and a floor (0.1 in natural log,
    about 10%, for scale metrics; 0.02 for fractions; see :func:`noise_floor`). Two runs
    that see different batches differ at one sample by about the per-sample change within
    one run; the floor covers the level offsets that a different initialisation or data
    order causes and that one run cannot show.

    A series **diverges notably** at the first point that starts ``PERSISTENCE_POINTS``
    (2) consecutive departures beyond ``threshold`` (default 5) with one sign, so a
    one-sample spike does not count. Within a category a series is ranked by its
    sustained departure (:func:`sustained_departure`). Categories: ``activation_scale``
    (activation ``rms``), ``gradient_scale`` (output-gradient ``rms_to_root``, net of the
    loss gradient), ``zero_fraction`` (both signals) and ``non_finite`` (the first sample
    with a non-finite value, exact, in one run but not, or later, in the other).

    **First divergences.** Notable value divergences, first non-finite samples, calls that
    one run stops observing while the other goes on (exact: the sample after the last
    observation, when both runs observed it at every sample until then), and calls
    observed in one run only, ordered by the point (earliest first), then activations in
    forward call order, then output gradients in reverse call order. Each names a narrow
    experiment. A value divergence is located to the first compared history point beyond
    the threshold: with a bounded history it lies after ``last_agreeing``.

    **Mismatch guards.** Different sampling schedules, module sets, tracking or
    observation options, non-deterministic sampling, samples added by the non-finite
    sentinel and truncated ``series.json`` files are listed under ``mismatches`` and make
    ``strength`` ``"weak"``; the headline says so. Only modules selected in both runs are
    compared, and with different schedules only common training forwards. A run compared
    with itself reports no divergence and no weakening mismatch.

    Args:
        baseline_dir: the ``output_dir`` of the baseline run (holds ``series.json``).
        candidate_dir: the ``output_dir`` of the candidate run.
        output_dir: where to write. Default: ``candidate_dir``.
        max_bytes: bound on ``comparison.json`` in bytes, at least 4,096. Default 256,000.
        threshold: departure, in noise units, of a notable divergence. Default 5.0.

    Returns:
        The path of ``comparison.json``.

    Raises:
        ReportReadError: a directory or its ``series.json`` is missing, unreadable, not
            JSON or not a series summary (the message names the path).
        ConfigError: an argument is out of range.
        OSError: the output files cannot be written.

    Example:
        >>> path = compare_runs("runs/baseline", "runs/candidate", "runs/compare")  # doctest: +SKIP
        >>> path.name  # doctest: +SKIP
        'comparison.json'
    """
    require_int("compare_runs", "max_bytes", max_bytes, minimum=4_096)
    limit = require_float(
        "compare_runs", "threshold", threshold, minimum=0.0, exclusive_minimum=True
    )
    if output_dir is not None and (
        not isinstance(output_dir, str | os.PathLike) or str(output_dir) == ""
    ):
        raise ConfigError(f"compare_runs: output_dir must be a non-empty path, got {output_dir!r}")
    baseline = _read_run(baseline_dir, "baseline")
    candidate = _read_run(candidate_dir, "candidate")
    comparison = _bounded(_compare(baseline, candidate, limit), max_bytes)
    target = Path(output_dir) if output_dir is not None else candidate.directory
    path = target / COMPARISON_NAME
    atomic_write(path, dumps_report(comparison))
    atomic_write(target / COMPARISON_INDEX_NAME, render_comparison_markdown(comparison).encode())
    return path


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
