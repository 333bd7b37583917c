"""⑤ report: a byte-bounded, deterministic report dict, its JSON bytes and its Markdown.

Findings are taken round-robin across categories (rank 1 of each category, then rank 2,
...), at most ``top_k_per_category`` each; the longest prefix of that order whose exact
indented UTF-8 JSON fits ``max_bytes`` is kept, and what was left out is counted per
category. The same run gives the same report but for ``generated_at`` and ``run.elapsed_s``.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import re
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import torch

from ._document import (
    bounded_text,
    clean,
    longest_fitting_prefix,
    round_robin,
    shrink_to_fit,
)
from ._jsonio import SCHEMA, dumps_report
from ._series_file import SERIES_SCHEMA, SeriesSummary
from ._series_file import build_series_summary as _build_series_summary
from .events import (
    QUIET_ROWS_PER_CATEGORY,
    Facet,
    SameTensor,
    build_events,
    dedupe,
    event_body,
    facet_row,
    modules_stopped,
    quiet_row,
)
from .find import (
    CATEGORIES,
    Candidate,
    NonFiniteBetweenSamples,
    display_module,
    format_value,
    run_rules,
)
from .find.base import MODEL, ONSET_TOLERANCE_SAMPLES, is_early, step_size
from .series import GRAD_OUTPUT, LOG_SCALE_METRICS
from .track import SeriesPoint, bounded_exp

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot

__all__ = [
    "DETAILS_SCHEMA",
    "LLM_PROMPT",
    "SCHEMA",
    "SERIES_SCHEMA",
    "build_details",
    "build_report",
    "build_series_summary",
    "dumps_report",
    "longest_fitting_prefix",
    "render_markdown",
    "sparkline",
]

DETAILS_SCHEMA = "torchinstruments.details/1"
LLM_PROMPT = """\
You are analysing passive telemetry from one PyTorch training run (torchinstruments).
The report lists events: each is one change at one module and onset, written once, with
the categories it moved (its "findings"), its echoes, its cross-section and its history.
Signals are module activations ("activation") and gradients of the loss with respect to
module outputs ("grad_output"). "findings" ranks series within each category: notable
ones refer to their event ("event": "E1"); the others are compact rows below their
noise floor, context only.

Rules for your answer:
1. Cite every claim with the event id, module, call index, signal, tensor path, metric
   and the values: onset sample and training forward, the change's "trend_forecast",
   "value" and "in_residual_spreads", and first, latest, min, max with their samples.
2. Separate measurement (what the numbers show) from mechanism (why it might happen);
   label mechanisms as hypotheses.
3. Treat "warmup_complete": false as weak evidence. "early_in_run": true means the
   series' reference was still young, so the change had to pass twice the usual
   residual spreads: weigh it by its size, and prefer a later change of similar size.
4. An event's module is where the change begins along depth. Its "cross_section" gives,
   at the onset, the module (offset 0) and its neighbours in forward order, each against
   its own trend: "before" (forecast), "after", "ratio" and "in_spreads" (the departure
   in that series' own noise units). Modules before it near 0 spreads and the module far
   from 0 place the origin there; its "echoes" moved at the same samples because of it.
   "also_named" are other modules that output the same tensor. Module "<model>" is a
   model-wide event: most of the model moved at once, a run-level cause.
5. "shape" says what happened: a "step" that held, a "spike" that returned, a
   "non_finite" value, a "model_wide" move, an "oscillation", "volatility" or a "drift".
   History points are [sample, training forward, value], every observed sample around
   each change. "coverage.modules_stopped" lists modules that stopped being called.
6. Do not infer anything about labels, optimizer updates, inputs or parameter gradients:
   they are not observed (a loss is observed only where the model's own output carries
   it, as a tensor path of <root>). Samples are sampled forwards, not optimizer steps.
7. End with the single narrowest next experiment (one change, same seed, data order and
   precision) that would confirm or refute your leading hypothesis.
"""


def _point(point: SeriesPoint | None) -> dict[str, float | int]:
    assert point is not None
    return point.as_dict()


#: Least factor of a step in the loss gradient reported as a model-wide event.
MODEL_WIDE_FACTOR = 4.0


def _model_wide_findings(observer: RunSnapshot) -> list[dict[str, Any]]:
    """``<model>`` findings: what rescaled every output gradient at once.

    Two sources: the ``torch.amp.GradScaler`` loss scale, known exactly and divided out
    of every output-gradient value (not notable: scaling is expected); and an abrupt step
    of at least ``MODEL_WIDE_FACTOR`` (4x) and 6 residual spreads in the loss gradient
    (the root output's gradient RMS), such as a changed loss reduction or accumulation
    factor (notable), confirmed by the sample after it: what such a cause does lasts,
    while one batch that the model already fits can shrink the loss gradient 10x once.
    Module findings are measured net of both.
    """
    findings: list[dict[str, Any]] = []
    scale = observer.loss_scale
    if scale.count and scale.first and scale.latest and scale.min and scale.max:
        findings.append(
            {
                **_model_wide_header(),
                "notable": False,
                "metric": "loss_scale",
                "observations": scale.count,
                "first": _point(scale.first),
                "latest": _point(scale.latest),
                "min": _point(scale.min),
                "max": _point(scale.max),
                "warmup_complete": scale.warmup_complete,
                "warmup_end_sample": scale.warmup_end_sample,
                "ranking": {
                    "basis": "abs_log_loss_scale_range",
                    "value": math.log(scale.max.value / scale.min.value),
                },
                "evidence": {"level_changes": scale.change_count},
                "interpretation": (
                    f"torch.amp.GradScaler scaled the loss by {format_value(scale.first.value)} at "
                    f"sample {scale.first.sample} and by {format_value(scale.latest.value)} at "
                    f"sample {scale.latest.sample} (between {format_value(scale.min.value)} and "
                    f"{format_value(scale.max.value)}). Every output-gradient value in this "
                    f"report is divided by the scale of its own sample."
                ),
                "next_experiment": (
                    "None needed for the scaling itself; if the scale keeps falling, look for "
                    "the non_finite findings that make the scaler back off."
                ),
            }
        )
    roots = sorted(
        (s for s in observer.series.values() if s.module == "" and s.signal == GRAD_OUTPUT),
        key=lambda s: (s.call_index, s.tensor_path),
    )
    tracker = roots[0].trackers.get("rms") if roots else None
    change = tracker.strongest_change if tracker is not None else None
    if (
        tracker is not None
        and change is not None
        and change.confirmed
        and abs(change.step) >= math.log(MODEL_WIDE_FACTOR)
        and abs(change.step_z) >= 6.0
        and tracker.first
        and tracker.latest
        and tracker.min
        and tracker.max
    ):
        factor = bounded_exp(change.step)
        findings.append(
            {
                **_model_wide_header(),
                "notable": True,
                "metric": "rms",
                "observations": tracker.count,
                "first": _point(tracker.first),
                "latest": _point(tracker.latest),
                "min": _point(tracker.min),
                "max": _point(tracker.max),
                "warmup_complete": tracker.warmup_complete,
                "warmup_end_sample": tracker.warmup_end_sample,
                "change_sample": change.start_sample,
                "change_forward": observer.sample_forwards.forward(change.start_sample),
                "change_in_residual_spreads": abs(change.step_z),
                "ranking": {"basis": "abs_log_step_factor", "value": abs(change.step)},
                "evidence": {
                    "factor": factor,
                    "step_start_sample": change.start_sample,
                    "step_alarm_sample": change.alarm_sample,
                    "step_in_residual_spreads": change.step_z,
                },
                "interpretation": (
                    f"The loss gradient (the root output's gradient RMS) and with it every "
                    f"output gradient changed by {format_value(factor)}x from sample "
                    f"{change.start_sample}. A changed loss reduction or weighting, a changed "
                    f"accumulation factor or unscaled loss scaling do this. Module findings "
                    f"are measured net of it."
                ),
                "next_experiment": (
                    f"Check the loss computation around sample {change.start_sample}: its "
                    f"reduction, weighting and any division by the accumulation count."
                ),
            }
        )
    return findings


def _model_wide_header() -> dict[str, Any]:
    return {
        "category": "gradient_scale_change",
        "rank": 0,
        "module": MODEL,
        "call_index": None,
        "signal": "grad_output",
        "tensor_path": None,
        "not_applicable": "call_index and tensor_path: a model-wide event has neither",
        "warmup_end_sample": None,
        "early_in_run": False,
        "change_in_residual_spreads": None,
        "change_sample": None,
        "change_forward": None,
        "history": [],
    }


def _module_count(observer: RunSnapshot) -> int:
    return len({s.module for s in observer.series.values()})


#: Most names listed under ``coverage.modules_not_observed``.
MAX_MODULES_NOT_OBSERVED = 16


def _modules_not_observed(observer: RunSnapshot) -> list[str]:
    """Selected modules without a series, in forward-selection order (at most
    ``MAX_MODULES_NOT_OBSERVED``): never called in a sampled training forward (for
    example a projection whose weights a parent uses through functional code, like
    ``nn.MultiheadAttention``'s ``out_proj``), or only with non-floating outputs."""
    seen = {s.module for s in observer.series.values()}
    missing = [display_module(name) for name in observer.names if name not in seen]
    return missing[:MAX_MODULES_NOT_OBSERVED]


def _modules_never_ran(observer: RunSnapshot) -> list[str]:
    """Selected modules whose forward hook never fired in a sampled forward (a child
    whose parent uses its weights functionally, a branch never taken), at most
    ``MAX_MODULES_NOT_OBSERVED``; empty before the first sample."""
    if not observer.counters.samples_observed:
        return []
    called = observer.modules_called
    names = [display_module(name) for i, name in enumerate(observer.names) if i and i not in called]
    return names[:MAX_MODULES_NOT_OBSERVED]


def _limits_hit(
    observer: RunSnapshot, omitted_bytes: int, omitted_top_k: int, replaced: Sequence[str] = ()
) -> list[str]:
    limits = []
    if replaced:
        limits.append("modules_replaced")
    if omitted_bytes:
        limits.append("max_bytes")
    if omitted_top_k:
        limits.append("top_k_per_category")
    if observer.counters.series_dropped:
        limits.append("max_series")
    if observer.counters.paths_dropped:
        limits.append("max_tensors_per_output")
    if len(observer.errors) > observer.report_config.max_error_entries:
        limits.append("max_error_entries")
    return limits


_SPECIAL_ROW_KEYS = (
    "category",
    "rank",
    "notable",
    "module",
    "call_index",
    "signal",
    "tensor_path",
    "metric",
    "ranking",
    "first",
    "latest",
)


def _special_parts(item: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A ``<model>`` finding of :func:`_model_wide_findings` as a row of ``findings`` and,
    when notable, the body of its event (without its id)."""
    row = {key: item[key] for key in _SPECIAL_ROW_KEYS}
    if not item["notable"]:
        # The loss scale: its range is the point (first, min, max with their samples).
        return {**row, **{k: item[k] for k in ("min", "max")}}, None
    row.update(
        {
            "change_sample": item["change_sample"],
            "change_forward": item["change_forward"],
            "change_in_residual_spreads": item["change_in_residual_spreads"],
            "early_in_run": False,
        }
    )
    evidence = item["evidence"]
    body = {
        "shape": "model_wide",
        "module": MODEL,
        "call_index": None,
        "signal": item["signal"],
        "tensor_path": None,
        "module_kind": None,
        "also_named": [],
        "metric": item["metric"],
        "direction": "up" if evidence["factor"] > 1 else "down",
        "onset": {"sample": item["change_sample"], "forward": item["change_forward"]},
        "warmup_complete": item["warmup_complete"],
        "early_in_run": False,
        "findings": [{"category": item["category"], "rank": item["rank"], "metric": "rms"}],
        "model_wide": {"measured_on": "loss gradient (the root output's gradient RMS)"},
        "change": {
            "metric": "rms",
            "start_sample": evidence["step_start_sample"],
            "alarm_sample": evidence["step_alarm_sample"],
            "ratio": evidence["factor"],
            "in_residual_spreads": evidence["step_in_residual_spreads"],
            "confirmed": True,
            "returned_to_trend": False,
        },
        "values": {k: item[k] for k in ("metric", "first", "latest", "min", "max")},
        "history": {"metric": "rms", "columns": ["sample", "forward", "value"], "points": []},
        "interpretation": item["interpretation"],
        "next_experiment": item["next_experiment"],
    }
    return row, body


#: Observed (module, call, signal) up to which each is named by at least one compact
#: row (a model of up to 16 modules).
SMALL_MODEL_SERIES = 32


def _quiet_choice(
    quiet: Sequence[Candidate], room: int, listed: set[tuple[str, int, str]]
) -> list[int]:
    """Indices (in rank order) of the compact rows of one category: its rank 1, then the
    best ranked whose (module, call, signal) no earlier category listed, so that the few
    rows of all categories name as many series as they can; then the next best."""
    if room <= 0 or not quiet:
        return []
    chosen = [0]
    fresh = [
        i
        for i, c in enumerate(quiet)
        if i
        and (c.series.module, c.series.call_index, c.series.signal) not in listed
        and (c.series.module, c.series.call_index, c.series.signal)
        != (quiet[0].series.module, quiet[0].series.call_index, quiet[0].series.signal)
    ]
    chosen += fresh[: room - 1]
    chosen += [i for i in range(1, len(quiet)) if i not in chosen][: room - len(chosen)]
    return sorted(chosen)


def _round_key(notable: bool, change_sample: int | None, early: bool, signal: str, size: float):
    # Within a round: notable first, then the earliest detected change, so the list reads
    # in the order things happened; at the same sample the category whose change is
    # largest in its own noise units (residual spreads) first, as the origin of a group
    # is chosen; ties keep the fixed category order.
    return (
        not notable,
        change_sample is None,
        early,
        (change_sample or 0) + (ONSET_TOLERANCE_SAMPLES if signal == GRAD_OUTPUT else 0),
        -size,
    )


def build_report(observer: RunSnapshot) -> dict[str, Any]:
    """Build the bounded report from an observer's snapshot (taken after a flush).

    Per category, the notable findings (at most ``top_k_per_category``) and then up to
    :data:`~torchinstruments.events.QUIET_ROWS_PER_CATEGORY` compact rows of findings that
    are not notable (for a model of at most ``SMALL_MODEL_SERIES`` observed module calls
    and signals, as many as name each once) are taken, round-robin across categories;
    each notable finding refers to its event (``events``), written once in full. The
    longest prefix of that order whose bytes fit is kept, with the events it refers to.

    Returns:
        A JSON-safe dict whose :func:`dumps_report` bytes are at most
        ``observer.report_config.max_bytes`` long.
    """
    config = observer.report_config
    ranked = run_rules(
        observer.series.values(),
        loss_scaled=observer.counters.loss_scaled_samples > 0,
        nonfinite_between_samples=_sentinel_hits(observer),
    )
    same = SameTensor(observer.series.values())
    kinds = dict(observer.module_kinds)
    stopped = modules_stopped(observer)
    # Entries per category: a Facet (notable), a Candidate (a quiet row) or a <model>
    # finding dict; each with its round-robin key.
    per_category: dict[str, list[tuple[object, tuple[Any, ...]]]] = {}
    notable_counts: dict[str, int] = {}
    candidate_counts: dict[str, int] = {}
    notable_dropped: dict[str, int] = {}
    listed: set[tuple[str, int, str]] = set()  # (module, call, signal) of quiet rows
    # A small model's compact rows name each of its series once (every category's rank 1
    # and the series no earlier category listed); a larger model's, a few per category.
    small_model = (
        len({(s.module, s.call_index, s.signal) for s in observer.series.values()})
        <= SMALL_MODEL_SERIES
    )
    quiet_ranks: dict[int, int] = {}
    for number, category in enumerate(CATEGORIES):
        # Notable candidates of one tensor are one (named once, the others under
        # also_named); compact rows name every series as it was observed.
        candidates = [
            *dedupe([c for c in ranked[category] if c.notable], same),
            *(c for c in ranked[category] if not c.notable),
        ]
        items: list[tuple[object, tuple[Any, ...]]] = []
        specials = _model_wide_findings(observer) if category == "gradient_scale_change" else []
        for rank, special in enumerate(specials, 1):
            key = _round_key(
                special["notable"],
                special["change_sample"],
                False,
                special["signal"],
                special["change_in_residual_spreads"] or 0.0,
            )
            items.append(({**special, "rank": rank}, (*key, number)))
        notable = [c for c in candidates if c.notable]
        quiet = [c for c in candidates if not c.notable]
        room = config.top_k_per_category - len(items)
        notable_dropped[category] = max(len(notable) - max(room, 0), 0)
        for c in notable[: max(room, 0)]:
            size = max([step_size(c), *(step_size(e) for e in c.echoes)]) if c.change else 0.0
            key = _round_key(True, c.onset, is_early(c), c.series.signal, size)
            items.append((Facet(category, len(items) + 1, c), (*key, number)))
        room = config.top_k_per_category - len(items)
        if not small_model:
            room = min(QUIET_ROWS_PER_CATEGORY, room)
        offset = len(specials) + len(notable)
        for index in _quiet_choice(quiet, max(room, 0), listed):
            c = quiet[index]
            listed.add((c.series.module, c.series.call_index, c.series.signal))
            quiet_ranks[id(c)] = offset + index + 1
            items.append((c, (*_round_key(False, None, False, c.series.signal, 0.0), number)))
        per_category[category] = items
        candidate_counts[category] = len(candidates) + len(specials)
        notable_counts[category] = len(notable) + sum(1 for x in specials if x["notable"])
    ranked_entries = round_robin(
        [per_category[category] for category in CATEGORIES], key=lambda item: item[1]
    )
    order: list[object] = [entry for entry, _ in ranked_entries]
    # Events, numbered in report order; rows of findings, each referring to its event.
    facets = [entry for entry in order if isinstance(entry, Facet)]
    events = build_events(facets)
    bodies: dict[int, dict[str, Any]] = {}
    rows: list[tuple[dict[str, Any], int | None]] = []  # (row, event number)
    number = 0
    numbers: dict[int, int] = {}
    for entry in order:
        if isinstance(entry, Facet):
            assert entry.event is not None
            event = entry.event
            if id(event) not in numbers:
                number += 1
                numbers[id(event)] = number
                event.number = number
                bodies[number] = event_body(
                    event, observer, kinds, same, config.max_echo_modules, stopped
                )
            rows.append((facet_row(entry, observer, same), numbers[id(event)]))
        elif isinstance(entry, Candidate):
            rows.append((quiet_row(entry, quiet_ranks[id(entry)], same), None))
        else:
            assert isinstance(entry, dict)
            row, body = _special_parts(entry)
            if body is None:
                rows.append((row, None))
                continue
            number += 1
            bodies[number] = {"id": f"E{number}", **body}
            row["event"] = f"E{number}"
            rows.append((row, number))
    del events
    first_non_finite = _first_non_finite(ranked["non_finite"], observer)
    replaced = [display_module(name) for name in observer.modules_replaced]
    never_ran = _modules_never_ran(observer)

    def assemble(kept: int) -> dict[str, Any]:
        findings = [row for row, _ in rows[:kept]]
        referred = sorted({n for _, n in rows[:kept] if n is not None})
        kept_events = [bodies[n] for n in referred]
        returned = {c: 0 for c in CATEGORIES}
        for finding in findings:
            returned[finding["category"]] += 1
        omitted = {
            c: {
                "by_top_k": notable_dropped[c],
                "by_bytes": len(per_category[c]) - returned[c],
                "not_notable": candidate_counts[c] - len(per_category[c]) - notable_dropped[c],
            }
            for c in CATEGORIES
        }
        omitted_bytes = sum(v["by_bytes"] for v in omitted.values())
        omitted_top_k = sum(v["by_top_k"] for v in omitted.values())
        notable_returned = sum(1 for f in findings if f["notable"])
        return clean(
            {
                "schema": SCHEMA,
                "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "run": _run_section(observer),
                "config": _config_section(observer),
                "summary": {
                    "notable_findings": sum(notable_counts.values()),
                    "notable_findings_returned": notable_returned,
                    "events": len(bodies),
                    "events_returned": len(kept_events),
                    "headline": _headline(
                        kept_events, sum(notable_counts.values()), observer, stopped
                    ),
                    "first_non_finite": first_non_finite,
                },
                "coverage": {
                    "modules_selected": len(observer.names),
                    "modules_observed": _module_count(observer),
                    "modules_not_observed": _modules_not_observed(observer),
                    "modules_never_ran": never_ran,
                    "parents_observed": {
                        display_module(child): display_module(parent)
                        for child, parent in list(observer.parents_adopted.items())[
                            :MAX_MODULES_NOT_OBSERVED
                        ]
                    },
                    "modules_replaced": replaced[:MAX_MODULES_NOT_OBSERVED],
                    "modules_stopped": stopped,
                    "tensor_paths_observed": len(
                        {(s.module, s.call_index, s.tensor_path) for s in observer.series.values()}
                    ),
                    "tensor_series": len(observer.series),
                    "series": sum(len(s.trackers) for s in observer.series.values()),
                    "histograms": len(observer.histograms),
                    "histogram_summary": _histogram_summary(observer),
                    "forwards_seen": observer.counters.forwards_seen,
                    "samples_observed": observer.counters.samples_observed,
                    "backward_samples_observed": observer.counters.backward_samples_observed,
                    "eval_forwards_skipped": observer.counters.eval_forwards_skipped,
                    "recompute_calls_ignored": observer.counters.recompute_calls_ignored,
                    "direct_call_samples": observer.counters.direct_call_samples,
                    "calls_outside_root_skipped": observer.counters.calls_outside_root_skipped,
                    "repeated_backward_gradients": observer.counters.repeated_backward_gradients,
                    "backward_gradients_summed": observer.counters.backward_gradients_summed,
                    "backward_gradients_not_summed": (
                        observer.counters.backward_gradients_not_summed
                    ),
                    "loss_scaled_samples": observer.counters.loss_scaled_samples,
                    "sentinel_checks": observer.counters.sentinel_checks,
                    "sentinel_nonfinite_forwards": observer.counters.sentinel_nonfinite_forwards,
                    "tensors_skipped": dict(sorted(observer.skipped_tensors.items())),
                    "series_dropped": observer.counters.series_dropped,
                    "series_summary_omitted": observer.counters.series_summary_omitted,
                    "paths_dropped": observer.counters.paths_dropped,
                    "candidates": candidate_counts,
                    "notable": notable_counts,
                    "findings_returned": returned,
                    "findings_omitted": omitted,
                    "errors_total": observer.counters.errors_total,
                    "limits_hit": _limits_hit(observer, omitted_bytes, omitted_top_k, replaced),
                },
                "events": kept_events,
                "findings": findings,
                "errors": _errors_section(observer),
            }
        )

    report = longest_fitting_prefix(assemble, len(rows), config.max_bytes)
    return _fit_sections(report, config.max_bytes)


#: Sections emptied, in this order, when a report without findings still exceeds
#: ``max_bytes``: (section, key, what replaces it).
_SHRINKABLE: tuple[tuple[str, str, object], ...] = (
    ("coverage", "histogram_summary", []),
    ("coverage", "modules_not_observed", []),
    ("coverage", "modules_never_ran", []),
    ("coverage", "modules_replaced", []),
    ("coverage", "modules_stopped", []),
    ("coverage", "parents_observed", {}),
    ("", "errors", []),
    ("", "config", {}),
    ("coverage", "tensors_skipped", {}),
    ("summary", "headline", None),  # None: cut to 200 characters
)


def _fit_sections(report: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """Empty the bounded-but-sizeable sections of ``report`` (see ``_SHRINKABLE``) one
    by one until its bytes fit ``max_bytes``; each emptied one is named under
    ``coverage.sections_omitted`` and ``max_bytes`` joins ``coverage.limits_hit``.
    Findings were dropped first (all of them, if it comes to this)."""
    if len(dumps_report(report)) <= max_bytes:
        return report
    coverage = report["coverage"]
    omitted: list[str] = coverage.setdefault("sections_omitted", [])
    if "max_bytes" not in coverage["limits_hit"]:
        coverage["limits_hit"].append("max_bytes")

    def emptying(section: str, key: str, empty: object) -> Callable[[dict[str, Any]], bool]:
        def step(document: dict[str, Any]) -> bool:
            holder = document[section] if section else document
            if key not in holder or not holder[key]:
                return False
            holder[key] = bounded_text(holder[key], 200) if empty is None else empty
            omitted.append(f"{section}.{key}" if section else key)
            return True

        return step

    shrink_to_fit(report, max_bytes, [emptying(*shrinkable) for shrinkable in _SHRINKABLE])
    return report


def _sentinel_hits(observer: RunSnapshot) -> tuple[NonFiniteBetweenSamples, ...]:
    """The non-finite values the sentinels saw between samples (the kept ones), in the
    order of their training forwards."""
    source = "full_sentinel" if observer.full_sentinel else "root_sentinel"
    events = sorted(observer.sentinel_events, key=lambda e: int(str(e["forward_index"])))
    return tuple(
        NonFiniteBetweenSamples(
            source=source,
            forward_index=int(str(event["forward_index"])),
            module=str(event["module"]),
            call_index=int(str(event["call_index"])),
            tensor_path=str(event["tensor_path"]),
            next_sample=int(str(event["next_sample"])),
        )
        for event in events
    )


def _first_non_finite(
    candidates: Sequence[Candidate], observer: RunSnapshot
) -> dict[str, object] | None:
    """Where non-finite values first appeared: in a sampled forward (exact sample,
    module, tensor path) or, earlier, caught by the sentinel between samples."""
    # Ranked candidates are in time order: the first notable one is the earliest sample
    # (an activation before a gradient of the same sample).
    chosen = next((c for c in candidates if c.notable), None)
    sampled: dict[str, object] | None = None
    first_sample: int | None = None
    if chosen is not None and chosen.tracker.first_nonzero is not None:
        s = chosen.series
        first_sample = chosen.tracker.first_nonzero.sample
        sampled = {
            "source": "sampled_forward",
            "sample": first_sample,
            "module": display_module(s.module),
            "call_index": s.call_index,
            "signal": s.signal,
            "tensor_path": s.tensor_path,
            "recovered": bool(chosen.tracker.latest and chosen.tracker.latest.value == 0),
        }
        forward = observer.sample_forwards.forward(first_sample)
        if forward is not None:
            sampled["forward_index"] = forward
    if not observer.sentinel_events:
        return sampled
    event = min(observer.sentinel_events, key=lambda e: int(str(e["forward_index"])))
    if first_sample is not None and int(str(event["next_sample"])) > first_sample:
        return sampled  # the sampled forward saw it first (the hit came after it)
    sentinel = {
        "source": "full_sentinel" if observer.full_sentinel else "root_sentinel",
        "forward_index": event["forward_index"],
        "module": display_module(str(event["module"])),
        "call_index": event["call_index"],
        "signal": "activation",
        "tensor_path": event["tensor_path"],
        "nonfinite_forwards_between_samples": observer.counters.sentinel_nonfinite_forwards,
    }
    if sampled is None:
        return sentinel
    return {**sampled, "earlier_between_samples": sentinel}


def _stopped_text(stopped: Sequence[dict[str, Any]]) -> str:
    if not stopped:
        return ""
    first = stopped[0]
    more = f" and {len(stopped) - 1} more" if len(stopped) > 1 else ""
    forward = first.get("last_forward")
    at = f", training forward {forward}" if forward is not None else ""
    return (
        f" {len(stopped)} module(s) stopped being called: `{first['module']}` (call "
        f"{first['call_index']}) last ran at sample {first['last_sample']}{at}{more}."
    )


def _headline(
    events: Sequence[dict[str, Any]],
    notable: int,
    observer: RunSnapshot,
    stopped: Sequence[dict[str, Any]] = (),
) -> str:
    if not observer.root_forward_seen:
        return (
            f"No training forward was observed ({observer.counters.eval_forwards_skipped} forwards "
            "skipped as evaluation: eval mode, no_grad, inference_mode or inside a "
            "torch.func transform), so there is "
            "nothing to report. Train in model.train() mode with gradients enabled."
        )
    tail = _stopped_text(stopped)
    if notable == 0:
        if observer.sentinel_events:
            event = min(observer.sentinel_events, key=lambda e: int(str(e["forward_index"])))
            return (
                f"Non-finite values were seen between samples "
                f"({observer.counters.sentinel_nonfinite_forwards} training forward(s), "
                f"the first at "
                f"forward {event['forward_index']}, in `{display_module(str(event['module']))}`) "
                "but in no sampled forward; every ranked series stays within its noise floor."
            ) + tail
        return "No finding stands out: every ranked series stays within its noise floor." + tail
    if not events:
        return f"{notable} notable finding(s); none fit within the byte limit." + tail
    top = events[0]
    count = f"{notable} notable finding(s) in {len(events)} event(s)"
    onset = top.get("onset") or {}
    when = f"sample {onset.get('sample')}" + (
        f" (training forward {onset['forward']})" if onset.get("forward") is not None else ""
    )
    categories = ", ".join(sorted({f["category"] for f in top.get("findings", [])}))
    if top["module"] == MODEL:
        share = (top.get("model_wide") or {}).get("share_of_modules")
        moved = f", {format_value(share * 100)}% of the observed modules" if share else ""
        return (
            f"{count}; the first ({top['id']}) is a model-wide event at {when} (`{MODEL}`"
            f"{moved}, {top['signal']}.{top['metric']}; {categories})." + tail
        )
    return (
        f"{count}; the first ({top['id']}) is a {top['shape'].replace('_', '-')} at "
        f"`{top['module']}` (call {top['call_index']}, {top['signal']}.{top['metric']}) at "
        f"{when} ({categories})." + tail
    )


def _run_section(observer: RunSnapshot) -> dict[str, Any]:
    from ._version import __version__

    info = observer.rank_info
    return {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "rank_source": info.source,
        "samples_seen": observer.counters.samples_observed,
        "forwards_seen": observer.counters.forwards_seen,
        "started_at": datetime.fromtimestamp(observer.started_at, UTC).isoformat(
            timespec="seconds"
        ),
        "elapsed_s": round(time.time() - observer.started_at, 3),
        "telemetry_seconds": round(observer.telemetry_seconds, 6),
        "hook_parking": observer.hook_parking,
        **(
            {
                "forked_from_pid": observer.forked_from_pid,
                "forwards_before_fork": observer.forwards_at_fork,
            }
            if observer.forked_from_pid is not None
            else {}
        ),
        "versions": {
            "torchinstruments": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


#: Most items of one list (or keys of one mapping) kept in the ``config`` section, and
#: its deepest nesting: include lists and a custom policy's ``describe()`` are the
#: user's, of any size.
MAX_CONFIG_ITEMS = 32
MAX_CONFIG_DEPTH = 4
#: Longest string kept in the ``config`` section, in characters.
MAX_CONFIG_TEXT = 256


def _bounded_config(value: object, depth: int = 0) -> Any:
    """A bounded copy of a config value: at most ``MAX_CONFIG_ITEMS`` items per list or
    mapping (then one ``"... N more"`` entry), ``MAX_CONFIG_DEPTH`` levels and
    ``MAX_CONFIG_TEXT`` characters per string."""
    if isinstance(value, str):
        return bounded_text(value, MAX_CONFIG_TEXT)
    if value is None or isinstance(value, bool | int | float):
        return value
    if depth >= MAX_CONFIG_DEPTH:
        return bounded_text(f"<{type(value).__name__} nested deeper than {depth}>", 64)
    if isinstance(value, dict):
        items = list(value.items())
        kept: dict[str, Any] = {
            bounded_text(str(k), MAX_CONFIG_TEXT): _bounded_config(v, depth + 1)
            for k, v in items[:MAX_CONFIG_ITEMS]
        }
        if len(items) > MAX_CONFIG_ITEMS:
            kept["..."] = f"{len(items) - MAX_CONFIG_ITEMS} more"
        return kept
    if isinstance(value, list | tuple):
        listed = [_bounded_config(v, depth + 1) for v in value[:MAX_CONFIG_ITEMS]]
        if len(value) > MAX_CONFIG_ITEMS:
            listed.append(f"... {len(value) - MAX_CONFIG_ITEMS} more")
        return listed
    return bounded_text(str(value), MAX_CONFIG_TEXT)


def _config_section(observer: RunSnapshot) -> dict[str, Any]:
    """The settings of the run, bounded (see :func:`_bounded_config`)."""
    return _bounded_config(
        {
            "sampling": observer.sampling,
            "report": dataclasses.asdict(observer.report_config),
            "track": dataclasses.asdict(observer.track_config),
            "capture_direct_forwards": observer.capture_direct_forwards,
            **observer.options,
        }
    )


#: Histograms summarised in ``report.json`` (those with the most mass out of range).
MAX_HISTOGRAMS_IN_REPORT = 16


def _histogram_summary(observer: RunSnapshot) -> list[dict[str, Any]]:
    """A bounded summary: the histograms with the largest out-of-range fraction."""
    entries = []
    for (index, call, signal, path, number), histogram in observer.histograms.items():
        summary = histogram.summary()
        out = (
            float(summary["underflow_fraction"])  # type: ignore[arg-type]
            + float(summary["overflow_fraction"])  # type: ignore[arg-type]
            + float(summary["nonfinite_fraction"])  # type: ignore[arg-type]
        )
        entries.append(
            (
                -out,
                observer.names[index],
                call,
                signal,
                path,
                number,
                {
                    "module": display_module(observer.names[index]),
                    "call_index": call,
                    "signal": signal,
                    "tensor_path": path,
                    "spec": number,
                    "bins": histogram.spec.bins,
                    "value_range": list(histogram.spec.value_range),
                    **summary,
                },
            )
        )
    entries.sort(key=lambda e: e[:6])
    return [entry[-1] for entry in entries[:MAX_HISTOGRAMS_IN_REPORT]]


def _errors_section(observer: RunSnapshot) -> list[dict[str, Any]]:
    entries = sorted(observer.errors, key=lambda e: (-e.count, e.stage, e.module))
    return [
        {
            "stage": e.stage,
            "module": display_module(e.module) if e.stage in ("forward", "backward") else e.module,
            "error_type": e.error_type,
            "message": e.message,
            "count": e.count,
            "first_sample": e.first_sample,
        }
        for e in entries[: observer.report_config.max_error_entries]
    ]


_SPARK_LEVELS = "▁▂▃▄▅▆▇█"


def sparkline(points: Sequence[Sequence[float]], *, log_scale: bool) -> str:
    """One-line picture of ``[sample, value]`` points: eight block heights, min to max.

    Scale metrics are drawn on a log axis (a 10x jump looks like a jump). Returns
    ``""`` for fewer than two points.

    Example:
        >>> sparkline([[0, 1.0], [1, 2.0], [2, 4.0]], log_scale=True)
        '▁▅█'
    """
    values = [float(v) for _, v in points]
    if len(values) < 2:
        return ""
    if log_scale:
        values = [math.log(max(v, 1e-30)) for v in values]
    low, high = min(values), max(values)
    if high - low <= 1e-12 * max(1.0, abs(high)):
        return _SPARK_LEVELS[0] * len(values)
    top = len(_SPARK_LEVELS) - 1
    return "".join(_SPARK_LEVELS[round((v - low) / (high - low) * top)] for v in values)


#: Characters that would end a Markdown line or hide text: C0/C1 controls (NUL, CR,
#: LF, ...) and Unicode line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape_controls(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def md_text(value: object) -> str:
    """A user-derived string as Markdown text on one line: control characters shown as
    ``\\xNN`` (so it cannot start a line, a heading or a fence), ``<`` and ``&`` as
    entities (no HTML), and a leading block marker (``#``, ``>``, ``-``, ...) escaped.

    Example:
        >>> md_text("# x\n<b>")
        '\\# x\\x0a&lt;b>'
    """
    text = _escape_controls(str(value)).replace("&", "&amp;").replace("<", "&lt;")
    if text[:1] in ("#", ">", "-", "+", "*", "=", "|", "`", "~"):
        text = "\\" + text
    return text


def md_code(value: object, *, in_table: bool = False) -> str:
    """A user-derived string (a module name) as one Markdown code span: control
    characters shown as ``\\xNN``, fenced with one backtick more than the longest run
    inside it (CommonMark), and ``|`` escaped inside a table cell.

    Example:
        >>> md_code("a`b")
        '``a`b``'
    """
    text = _escape_controls(str(value))
    runs = [len(run) for run in re.findall(r"`+", text)]
    fence = "`" * (max(runs, default=0) + 1)
    if text.startswith("`") or text.endswith("`"):
        text = f" {text} "
    span = f"{fence}{text}{fence}"
    return span.replace("|", "\\|") if in_table else span


def _not_observed_text(coverage: dict[str, Any]) -> str:
    names = coverage.get("modules_not_observed") or []
    if not names:
        return ""
    more = coverage["modules_selected"] - coverage["modules_observed"] > len(names)
    listed = ", ".join(md_code(name) for name in names) + ("..." if more else "")
    return (
        " Not observed (never called in a sampled training forward, or no floating "
        f"output): {listed}."
    )


def _blank(value: object) -> str:
    return "" if value is None else str(value)


def _stopped_markdown(coverage: dict[str, Any]) -> str:
    stopped = coverage.get("modules_stopped") or []
    if not stopped:
        return ""
    listed = ", ".join(
        f"{md_code(m['module'])} after sample {m['last_sample']}"
        + (f" (forward {m['last_forward']})" if m.get("last_forward") is not None else "")
        for m in stopped
    )
    return f" Stopped being called: {listed}."


def _placement_text(coverage: dict[str, Any]) -> str:
    """Sentences on modules that never ran, parents observed in their place and
    modules replaced after injection (their places are no longer observed)."""
    parts = []
    never = coverage.get("modules_never_ran") or []
    if never:
        parts.append(" Never ran in a sampled forward: " + ", ".join(map(md_code, never)) + ".")
    parents = coverage.get("parents_observed") or {}
    if parents:
        pairs = ", ".join(f"{md_code(c)} by {md_code(p)}" for c, p in parents.items())
        parts.append(f" Observed through their parent: {pairs}.")
    replaced = coverage.get("modules_replaced") or []
    if replaced:
        parts.append(
            " Replaced after injection, no longer observed: "
            + ", ".join(map(md_code, replaced))
            + "."
        )
    return "".join(parts)


def _number_text(value: object) -> str:
    if isinstance(value, float):
        return format_value(value)
    if isinstance(value, dict) or value is None:
        return "n/a"
    return str(value)


def _markdown_event(e: dict[str, Any]) -> list[str]:
    call = "" if e.get("call_index") is None else f" (call {e['call_index']})"
    onset = e.get("onset") or {}
    when = f"sample {onset.get('sample')}"
    if onset.get("forward") is not None:
        when += f", training forward {onset['forward']}"
    kind = f", a {md_text(e['module_kind'])}" if e.get("module_kind") else ""
    lines = [
        f"### {e['id']}: {e['shape'].replace('_', '-')} at {md_code(e['module'])}{call}{kind}, "
        f"{e['signal']}.{e['metric']}, {when}",
        "",
        md_text(e["interpretation"]),
        "",
    ]
    facets = ", ".join(
        f"{f['category']} #{f['rank']} ({f['metric']})" for f in e.get("findings", [])
    )
    lines.append(f"- Findings: {facets}.")
    if e.get("also_named"):
        names = ", ".join(md_code(n) for n in e["also_named"])
        lines.append(f"- The same tensor is also the output of: {names}.")
    if e.get("echoes"):
        names = ", ".join(md_code(x["module"]) for x in e["echoes"])
        more = f" and {e['echoes_omitted']} more" if e.get("echoes_omitted") else ""
        lines.append(f"- Echoes (moved at the same samples, not listed separately): {names}{more}.")
    history = (e.get("history") or {}).get("points") or []
    if len(history) >= 2:
        metric = e["history"]["metric"]
        picture = sparkline([[p[0], p[2]] for p in history], log_scale=metric in LOG_SCALE_METRICS)
        lines.append(
            f"- {metric}, samples {history[0][0]} to {history[-1][0]} (training forwards "
            f"{history[0][1]} to {history[-1][1]}): `{picture}`"
        )
        change = e.get("change") or {}
        start = change.get("start_sample")
        if start is not None:
            near = [p for p in history if abs(p[0] - start) <= 3]
            listed = "; ".join(f"{p[0]} (forward {p[1]}): {_number_text(p[2])}" for p in near)
            lines.append(f"- Around the onset, sample (forward): value: {listed}.")
    plot = e.get("plot")
    if plot:
        lines.append(f"- Picture: [{plot}]({plot})")
    lines.append(f"- Next experiment: {md_text(e['next_experiment'])}")
    section = e.get("cross_section")
    if section and section.get("rows"):
        lines += [
            "",
            f"Cross-section at sample {section['sample']} ({section['metric']}, forward order; "
            "offset 0 is this module):",
            "",
            "| offset | module | call | before | after | ratio | in spreads |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in section["rows"]:
            ratio = r.get("ratio", r.get("difference"))
            lines.append(
                f"| {r['offset']} | {md_code(r['module'], in_table=True)} | {r['call_index']} "
                f"| {_number_text(r['before'])} | {_number_text(r['after'])} "
                f"| {_number_text(ratio)} | {_number_text(r['in_spreads'])} |"
            )
    lines.append("")
    return lines


#: Events written out in full in ``index.md`` (all of them are in ``report.json``).
MARKDOWN_EVENTS = 12


def render_markdown(report: dict[str, Any]) -> str:
    """Render a report dict as ``index.md`` for people, with the LLM prompt."""
    run, coverage, summary = report["run"], report["coverage"], report["summary"]
    findings = report["findings"]
    lines = [
        "# torchinstruments report",
        "",
        f"**{md_text(summary['headline'])}**",
        "",
        (
            "Single process"
            if run["world_size"] == 1
            else f"Distributed rank {run['rank']} (world size {run['world_size']})"
        )
        + f"; {run['forwards_seen']} training root "
        f"forwards, {run['samples_seen']} sampled ({coverage['backward_samples_observed']} "
        f"with a backward); generated {report['generated_at']}.",
        "",
    ]
    first = summary.get("first_non_finite")
    if first:
        where = (
            f"sample {first['sample']}"
            if "sample" in first
            else f"training forward {first['forward_index']} (between samples)"
        )
        lines += [
            f"First non-finite value: {where}, {md_code(first['module'])} call "
            f"{first['call_index']}, {first['signal']} {md_text(first['tensor_path'])}"
            + (" (the run recovered)." if first.get("recovered") else "."),
            "",
        ]
    events = report.get("events") or []
    if events:
        lines += ["## Events", ""]
        for e in events[:MARKDOWN_EVENTS]:
            lines += _markdown_event(e)
        if len(events) > MARKDOWN_EVENTS:
            lines += [f"{len(events) - MARKDOWN_EVENTS} more event(s) in report.json.", ""]
    notable = [f for f in findings if f["notable"]]
    if notable:
        lines += [
            "## Notable findings by category",
            "",
            "| category | rank | event | module | call | signal.metric | change sample |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for f in notable:
            lines.append(
                f"| {f['category']} | {f['rank']} | {f.get('event', '')} "
                f"| {md_code(f['module'], in_table=True)} | {_blank(f.get('call_index'))} "
                f"| {f['signal']}.{f['metric']} | {_blank(f.get('change_sample'))} |"
            )
        lines.append("")
    others = [f for f in findings if not f["notable"]]
    if others:
        lines += [
            "## Other ranked series (below their noise floor)",
            "",
            "| category | rank | module | call | signal.metric | path | ranking | latest |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for f in others:
            ranking = f.get("ranking") or {}
            latest = f.get("latest") or {}
            lines.append(
                f"| {f['category']} | {f['rank']} | {md_code(f['module'], in_table=True)} "
                f"| {_blank(f.get('call_index'))} | {f['signal']}.{f['metric']} "
                f"| {md_code(f.get('tensor_path') or '', in_table=True)} "
                f"| {ranking.get('basis')} {_number_text(ranking.get('value'))} "
                f"| {_number_text(latest.get('value'))} @{latest.get('sample')} |"
            )
        lines.append("")
    lines += [
        "## Coverage and limits",
        "",
        f"- Modules observed: {coverage['modules_observed']} of {coverage['modules_selected']} "
        f"selected; tensor paths: {coverage['tensor_paths_observed']}; series: "
        f"{coverage['series']}.{_not_observed_text(coverage)}{_placement_text(coverage)}"
        f"{_stopped_markdown(coverage)}",
        f"- Eval or no-grad forwards kept out: {coverage['eval_forwards_skipped']}; "
        f"checkpoint recomputations ignored: {coverage['recompute_calls_ignored']}.",
        f"- Tensors skipped: {md_text(coverage['tensors_skipped'] or 'none')}.",
        f"- Findings returned: {sum(coverage['findings_returned'].values())}; limits that "
        f"removed evidence: {', '.join(coverage['limits_hit']) or 'none'}.",
        f"- Hook errors: {coverage['errors_total']}.",
        "",
    ]
    if report["errors"]:
        lines += ["## Errors caught in hooks", ""]
        for e in report["errors"]:
            lines.append(
                f"- {md_text(e['stage'])} {md_code(e['module'])}: {md_text(e['error_type'])}: "
                f"{md_text(e['message'])} ({e['count']}x)"
            )
        lines.append("")
    lines += [
        "## What is not measured",
        "",
        "Losses, labels, inputs, parameters, parameter gradients and optimizer updates are "
        "not observed; a sample is a sampled forward, not an optimizer step.",
        "",
        "## Prompt for an LLM",
        "",
        "Send `report.json` with this prompt:",
        "",
        "```text",
        LLM_PROMPT.rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _tracker_state(tracker: Any) -> dict[str, Any]:
    return {
        "count": tracker.count,
        "first": _point(tracker.first),
        "latest": _point(tracker.latest),
        "min": _point(tracker.min),
        "max": _point(tracker.max),
        "warmup_complete": tracker.warmup_complete,
        "log_scale": tracker.log_scale,
        "ema_fast": tracker.level(tracker.ema_fast),
        "ema_slow": tracker.level(tracker.ema_slow),
        "baseline": tracker.level(tracker.baseline_mean),
        "baseline_std_tracked_units": tracker.baseline_std,
        "shift_tracked_units": tracker.shift,
        "shift_in_baseline_std": tracker.shift_z,
        "momentum": tracker.momentum,
        "max_drawdown": tracker.max_drawdown,
        "volatility": tracker.volatility,
        "warmup_volatility": tracker.baseline_volatility,
        "flips": tracker.flips,
        "differences": tracker.diffs,
        "flip_rate": tracker.flip_rate,
        "cusum_positive": tracker.cusum_positive,
        "cusum_negative": tracker.cusum_negative,
        "cusum_peak": tracker.cusum_peak,
        "trend_level": tracker.level(tracker.trend_level),
        "trend_slope_per_forward": tracker.trend_slope,
        "residual_spread": tracker.spread,
        "level_changes": tracker.change_count,
        "change_points": [
            {
                "start_sample": c.start_sample,
                "alarm_sample": c.alarm_sample,
                "start_forward": c.start_forward,
                "trend_forecast": tracker.level(c.level_before),
                "level_after": tracker.level(c.level_after),
                "step_in_residual_spreads": c.step_z,
                "confirmed": c.confirmed,
                "transient": c.transient,
            }
            for c in tracker.changes
        ],
        "first_nonzero": _point(tracker.first_nonzero) if tracker.first_nonzero else None,
        "history": [[sample, value] for sample, value in tracker.history()],
    }


def build_details(observer: RunSnapshot) -> dict[str, Any]:
    """Every live series with its full tracker state, for local debugging.

    Unbounded: its size grows with the number of series (about 2 kB per series and
    metric). Not meant for an LLM; ``report.json`` is the bounded summary.
    """
    series = sorted(
        observer.series.values(),
        key=lambda s: (s.module, s.call_index, s.signal, s.tensor_path),
    )
    return clean(
        {
            "schema": DETAILS_SCHEMA,
            "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "run": _run_section(observer),
            "histograms": [
                {
                    "module": display_module(observer.names[index]),
                    "call_index": call,
                    "signal": signal,
                    "tensor_path": path,
                    "edges": histogram.spec.edges,
                    "counts": histogram.counts[: histogram.spec.bins],
                    **histogram.summary(),
                }
                for (index, call, signal, path, _), histogram in sorted(
                    observer.histograms.items(), key=lambda item: item[0]
                )
            ],
            "series": [
                {
                    "module": display_module(s.module),
                    "call_index": s.call_index,
                    "signal": s.signal,
                    "tensor_path": s.tensor_path,
                    "forward_position": s.forward_position,
                    "observations": s.observations,
                    "metrics": {
                        metric: _tracker_state(tracker)
                        for metric, tracker in sorted(s.trackers.items())
                    },
                }
                for s in series
            ],
        }
    )


def build_series_summary(observer: RunSnapshot, max_bytes: int) -> SeriesSummary:
    """``series.json`` for the run of ``observer`` (see
    :func:`torchinstruments._series_file.build_series_summary`), with the report's
    ``run`` and ``config`` sections; at most ``max_bytes`` bytes as written."""
    return _build_series_summary(
        observer, max_bytes, run=_run_section(observer), config=_config_section(observer)
    )
