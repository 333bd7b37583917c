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

This module runs the comparison; its parts are private modules: ``_series_file`` reads
the two files, ``_compare_align`` maps samples to training forwards and lists set-up
mismatches, ``_compare_values`` holds the statistic and compares values series by
series, ``_compare_events`` finds the other divergences (stops, one-run calls,
non-finite values, the profile at an identical pair's first difference) and
``_compare_render`` bounds ``comparison.json`` and writes ``comparison.md``.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ._compare_align import (
    _align,
    _config_mismatches,
    _describe_when,
    _sampling_description,
    _short,
)
from ._compare_events import (
    MODEL,
    _event_record,
    _non_finite_event,
    _one_run_entries,
    _presence,
    _profile_at_first_difference,
    _stop_event,
)
from ._compare_render import (
    _bounded,
    _Comparison,
    first_divergence_lines,
    render_comparison_markdown,
)
from ._compare_values import (
    CATEGORIES,
    DIVERGENCE_THRESHOLD,
    PERSISTENCE_POINTS,
    TensorKey,
    _compare_values,
    _Event,
    _first_difference,
    _neighbour_text,
    _value_experiment,
    _value_interpretation,
    _ValueResult,
    noise_floor,
    sustained_departure,
)
from ._document import DEFAULT_MAX_BYTES
from ._jsonio import atomic_write, dumps_report
from ._metrics import (
    ATTENTION_LOGITS_PATH,
    COMPARISON_FRACTION_FLOOR,
    COMPARISON_LOG_FLOOR,
    IDENTICAL_FRACTION_FLOOR,
    IDENTICAL_LOG_FLOOR,
)
from ._series_file import MAX_SERIES_FILE_BYTES, SeriesFile, read_series_file
from ._validate import require_float, require_int
from .errors import ConfigError
from .find import display_module
from .series import ACTIVATION, GRAD_OUTPUT, RMS_TO_ROOT

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
#: A ``series.json`` larger than this (bytes) is unreadable.
MAX_SOURCE_BYTES = MAX_SERIES_FILE_BYTES
#: Entries listed per category, first divergences listed, one-run tensors listed per side.
TOP_PER_CATEGORY = 10
MAX_FIRST_DIVERGENCES = 20
MAX_ONE_RUN_ENTRIES = 100

_VALUE_CATEGORIES = ("activation_scale", "gradient_scale", "zero_fraction")


# ---------------------------------------------------------------------- reading


def _read_run(directory: str | os.PathLike[str], role: str) -> SeriesFile:
    """Read and reduce one run's ``series.json``; raise ``ReportReadError`` naming it."""
    if not isinstance(directory, str | os.PathLike) or str(directory) == "":
        raise ConfigError(f"compare_runs: {role}_dir must be a non-empty path, got {directory!r}")
    return read_series_file(Path(directory), role)


# ---------------------------------------------------------------------- comparing


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
        if first_difference is None and key[3].startswith(ATTENTION_LOGITS_PATH):
            # Runs that differ from the start (another seed): the scale of attention
            # logits is each run's own (heads specialise at different forwards; two
            # clean runs' differed by 5.8 noise units), so they are compared only for
            # runs that were identical before their first difference.
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
        # Output gradients of the compared modules, and the one nearest the loss (the
        # first in backward order) whose gradient is not the loss gradient itself (a
        # last layer whose output is the root's has a constant ratio to it).
        gradient_keys = [
            k
            for k in common_keys
            if k[2] == GRAD_OUTPUT and k[0] not in ("", root) and k[4] == RMS_TO_ROOT
        ]
        varying = [k for k in gradient_keys if len(set(baseline.series[k].values)) > 1]
        loss_end = (
            max(varying, key=lambda k: baseline.series[k].forward_position)[0] if varying else None
        )
        if scales:
            first_module = min(scales, key=lambda k: baseline.series[k].forward_position)[0]
            events, model_wide = _profile_at_first_difference(
                events,
                first_difference,
                len({k[0] for k in scales}),
                first_module,
                threshold,
                (len({k[0] for k in gradient_keys}), loss_end),
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
                "category. At an identical pair's first difference, the activation where the "
                "profile along depth jumps (the largest ratio of a departure to the largest "
                "before it in forward order, the threshold where none departed) leads, and "
                "when half of the compared modules depart there, the model's "
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
