"""⑤ events: the unit of the report. One change at one module and onset, with its echoes
and every category and metric it moved, written once in full.

The rules (:mod:`~torchinstruments.find`) rank candidates within each category. This
module turns the notable ones into events and the others into compact rows:

- **Same tensor, one series.** Modules that pass one tensor through (an identity, a
  dropout that keeps every element, a parent whose output is its last child's, the root's
  output) record the same values at every sample. Their notable series are one series:
  only the first of them in its category's ranking is listed (for activations the first
  in forward order, the producer; never the root when another module returns the same
  tensor), the others under ``also_named``. Compact rows name each series as observed,
  with ``also_named`` where other modules output the same tensor.
- **Facets.** A notable candidate of a category is a facet of the event at its module
  and onset: the first facet (in the report's round-robin order) opens the event; a
  later one joins it when its onset is within ``ONSET_TOLERANCE_SAMPLES`` and it is at
  the event's module or one of its echoes (of its signal), or the event's module is
  among the facet's own module and echoes (of any signal: an activation step moves the
  output gradients at the same samples), or when it has no onset (volatility,
  oscillation) and is at one of those modules. An output-gradient step of a module
  before the event's activation step in forward order, dated at the same sample, joins
  it too, and the activation step leads (a module's weights scaled at a sample move its
  output and, in the same backward pass, the gradient it passes back). Model-wide facets
  (``<model>``) join the model-wide event at their onset (within the window of a group
  of breaks of trend, :func:`~torchinstruments.find.base.group_window`). Once joined,
  the facet whose module comes first in propagation order among those of the first
  facet's signal and onset (within ``ONSET_TOLERANCE_SAMPLES``) becomes the first: each
  facet is its category's origin there, and the change begins at the most upstream of
  them.
- **Shape.** What the event's first facet looks like decides its texts: ``step`` (a
  change point that held), ``spike`` (one that returned to the old trend), ``bend``
  (a break of trend), ``non_finite``, ``model_wide``, ``oscillation``, ``volatility``,
  ``drift`` (notable without a change point).

This module writes an event's body and the rows of findings; grouping is in
``_event_groups.py``, the history and cross-section in ``_event_views.py``, the texts in
``_event_texts.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._event_groups import Event, Facet, SameTensor, build_events, dedupe
from ._event_texts import event_texts, module_kind
from ._event_views import (
    CROSS_SECTION_NEIGHBOURS,
    HISTORY_REST_POINTS,
    _echo_points,
    cross_section,
    event_history,
    onset_of,
)
from .find import Candidate, display_module
from .find.base import MODEL, is_early, step_size
from .series import GRAD_OUTPUT, RMS_TO_ROOT

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot

__all__ = [
    "CROSS_SECTION_NEIGHBOURS",
    "HISTORY_REST_POINTS",
    "QUIET_ROWS_PER_CATEGORY",
    "Event",
    "Facet",
    "SameTensor",
    "build_events",
    "dedupe",
    "event_body",
    "event_history",
    "event_texts",
    "facet_row",
    "module_kind",
    "modules_stopped",
    "onset_of",
    "quiet_row",
]

#: Findings that are not notable listed per category, as compact rows.
QUIET_ROWS_PER_CATEGORY = 3
#: A module whose last sample is at least this many samples (and this share of the
#: run's samples) before the run's last sample stopped being called.
STOPPED_MIN_SAMPLES = 4
STOPPED_MIN_SHARE = 0.1
#: Most modules named under ``coverage.modules_stopped``.
MAX_MODULES_STOPPED = 16


def _facet_entry(facet: Facet, lead: Candidate) -> dict[str, Any]:
    """One finding of an event: its category, rank and metric; with its module, call
    index and signal where they are not the event's (a facet at one of its echoes, or
    the output gradient of a module before it)."""
    entry: dict[str, Any] = {
        "category": facet.category,
        "rank": facet.rank,
        "metric": facet.candidate.metric,
    }
    s, own = facet.candidate.series, lead.series
    if lead.model_wide is None and (s.module, s.call_index, s.signal) != (
        own.module,
        own.call_index,
        own.signal,
    ):
        entry.update(
            {"module": display_module(s.module), "call_index": s.call_index, "signal": s.signal}
        )
    return entry


# ------------------------------------------------------------------ rows
def ranking(c: Candidate) -> dict[str, Any]:
    return {"basis": c.basis, "value": c.score}


def quiet_row(c: Candidate, rank: int, same: SameTensor) -> dict[str, Any]:
    """A finding that is not notable, as a compact row: category, rank, series,
    ranking, first and latest values."""
    s = c.series
    row: dict[str, Any] = {
        "category": c.category,
        "rank": rank,
        "notable": False,
        "module": display_module(s.module),
        "call_index": s.call_index,
        "signal": s.signal,
        "tensor_path": s.tensor_path,
        "metric": c.metric,
        "ranking": ranking(c),
    }
    first, latest = c.tracker.first, c.tracker.latest
    if first is not None and latest is not None:
        row["first"] = first.as_dict()
        row["latest"] = latest.as_dict()
    also = same.also_named(s)
    if also:
        row["also_named"] = also
    part = c.evidence.get("part_of_model_wide_event")
    if part is not None:
        row["part_of_model_wide_event"] = part
    return row


def facet_row(facet: Facet, observer: RunSnapshot, same: SameTensor) -> dict[str, Any]:
    """A notable finding: its category, rank and series, referring to its event."""
    c = facet.candidate
    assert facet.event is not None
    if c.model_wide is not None:
        module, call, path = MODEL, None, None
    else:
        s = c.series
        module, call, path = display_module(s.module), s.call_index, s.tensor_path
    row: dict[str, Any] = {
        "category": facet.category,
        "rank": facet.rank,
        "notable": True,
        "event": facet.event.id,
        "module": module,
        "call_index": call,
        "signal": c.series.signal,
        "tensor_path": path,
        "metric": c.metric,
        "change_sample": c.onset,
        "change_forward": observer.sample_forwards.forward(c.onset),
        "change_in_residual_spreads": (
            max([step_size(c), *(step_size(e) for e in c.echoes)]) if c.change is not None else None
        ),
        "young_reference": is_early(c),
        "ranking": {**ranking(c), "group_value": c.group_score},
    }
    latest = c.tracker.latest
    if latest is not None:
        row["latest"] = latest.as_dict()
    first_nonfinite = c.evidence.get("first_nonfinite_sample")
    if first_nonfinite is not None:
        row["evidence"] = {"first_nonfinite_sample": first_nonfinite}
        earlier = c.evidence.get("earlier_between_samples")
        if earlier is not None:
            row["evidence"]["earlier_between_samples"] = earlier
    return row


def event_body(
    event: Event,
    observer: RunSnapshot,
    kinds: dict[str, str],
    same: SameTensor,
    max_echoes: int,
    stopped: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """An event written once in full (see docs/report.md, "Events"); ``stopped``: the
    report's ``coverage.modules_stopped``."""
    c = event.lead
    s = c.series
    t = c.tracker
    judged = c.judged
    measure = c.metric if judged is c.tracker else RMS_TO_ROOT
    interpretation, experiment = event_texts(event, observer, kinds, same, stopped)
    body: dict[str, Any] = {
        "id": event.id,
        "shape": event.shape,
        "module": MODEL if event.model_wide else display_module(s.module),
        "call_index": None if event.model_wide else s.call_index,
        "signal": s.signal,
        "tensor_path": None if event.model_wide else s.tensor_path,
        "module_kind": None if event.model_wide else kinds.get(s.module),
        "also_named": [] if event.model_wide else same.also_named(s),
        "metric": c.metric,
        "direction": {1: "up", -1: "down"}.get(c.direction),
        "onset": onset_of(c.onset, observer),
        "warmup_complete": t.warmup_complete,
        "young_reference": is_early(c),
        "findings": [_facet_entry(f, c) for f in event.facets],
    }
    if event.model_wide:
        assert c.model_wide_modules is not None
        moved, observed = c.model_wide_modules
        body["model_wide"] = {
            "share_of_modules": c.model_wide,
            "modules": moved,
            "modules_observed": observed,
            "modules_notable": len(c.group_modules),
            "first_in_propagation_order": display_module(s.module),
            "first_call_index": s.call_index,
            "first_tensor_path": s.tensor_path,
            "values_shown_are_of": "first_in_propagation_order",
        }
    change = c.change
    if change is not None:
        before, after = judged.level(change.level_before), judged.level(change.level_after)
        step: dict[str, Any] = {
            "metric": measure,
            "kind": change.kind,
            "start_sample": change.start_sample,
            "alarm_sample": change.alarm_sample,
            "trend_forecast": before,
            "value": after,
        }
        if judged.log_scale:
            step["ratio"] = after / before if before > 0 else None
        else:
            step["difference"] = after - before
        step["in_residual_spreads"] = change.step_z
        step["confirmed"] = change.confirmed
        step["returned_to_trend"] = change.transient
        body["change"] = step
    body["values"] = {
        "metric": c.metric,
        "first": t.first.as_dict() if t.first else None,
        "latest": t.latest.as_dict() if t.latest else None,
        "min": t.min.as_dict() if t.min else None,
        "max": t.max.as_dict() if t.max else None,
    }
    section = cross_section(c, observer, same) if change is not None else None
    if section:
        body["cross_section"] = {"metric": measure, "sample": change.start_sample, "rows": section}  # type: ignore[union-attr]
    echoes: list[Candidate] = []
    seen = {id(same.primary(s))}
    for f in event.facets:
        for e in [f.candidate, *f.candidate.echoes]:
            tensor = id(same.primary(e.series))
            if tensor not in seen:
                seen.add(tensor)
                echoes.append(e)
    body["echoes"] = []
    if echoes:
        body["echoes"] = [
            {
                "module": display_module(e.series.module),
                "call_index": e.series.call_index,
                "tensor_path": e.series.tensor_path,
                "signal": e.series.signal,
                "metric": e.metric,
                "onset_sample": e.onset,
                "in_residual_spreads": step_size(e) if e.change is not None else None,
                "history": {
                    "metric": e.metric if e.judged is e.tracker else RMS_TO_ROOT,
                    "points": _echo_points(e, observer),
                },
            }
            for e in echoes[:max_echoes]
        ]
        if len(echoes) > max_echoes:
            body["echoes_omitted"] = len(echoes) - max_echoes
    body["history"] = {
        "metric": measure,
        "columns": ["sample", "forward", "value"],
        "points": event_history(c.series, measure, judged, observer),
    }
    body["interpretation"] = interpretation
    body["next_experiment"] = experiment
    return body


# ------------------------------------------------------------------ coverage
def modules_stopped(observer: RunSnapshot) -> list[dict[str, Any]]:
    """Modules that stopped being called: observed for at least a warm-up's worth of
    samples, whose last sample is at least ``STOPPED_MIN_SAMPLES`` and
    ``STOPPED_MIN_SHARE`` of the run's samples before the run's last sample (a module
    replaced, bypassed or skipped from then on). At most ``MAX_MODULES_STOPPED``,
    earliest stop first: module, call index, last sample and its training forward."""
    last_run = observer.counters.samples_observed - 1
    if last_run < 0:
        return []
    warmup = observer.track_config.warmup_samples
    latest: dict[tuple[str, int], tuple[int, int]] = {}
    for s in observer.series.values():
        if s.module == "" or s.signal == GRAD_OUTPUT:
            continue
        # Every metric's tracker: a tensor that turned non-finite still has a finite
        # nonfinite_fraction, while its rms is undefined from then on.
        seen = [(t.latest.sample, t.count) for t in s.trackers.values() if t.latest is not None]
        if not seen:
            continue
        key = (s.module, s.call_index)
        sample, count = latest.get(key, (-1, 0))
        latest[key] = (max(sample, *(p[0] for p in seen)), max(count, *(p[1] for p in seen)))
    gap = max(
        STOPPED_MIN_SAMPLES, math.ceil(STOPPED_MIN_SHARE * observer.counters.samples_observed)
    )
    stopped = [
        (sample, module, call)
        for (module, call), (sample, count) in latest.items()
        if count >= warmup and last_run - sample >= gap
    ]
    stopped.sort()
    return [
        {
            "module": display_module(module),
            "call_index": call,
            "last_sample": sample,
            "last_forward": observer.sample_forwards.forward(sample),
        }
        for sample, module, call in stopped[:MAX_MODULES_STOPPED]
    ]
