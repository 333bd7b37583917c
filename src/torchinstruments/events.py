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
  oscillation) and is at one of those modules. Model-wide facets (``<model>``) join the
  model-wide event at their onset (within the window of a group of breaks of trend,
  :func:`~torchinstruments.find.base.group_window`).
- **Shape.** What the event's first facet looks like decides its texts: ``step`` (a
  change point that held), ``spike`` (one that returned to the old trend), ``bend``
  (a break of trend), ``non_finite``, ``model_wide``, ``oscillation``, ``volatility``,
  ``drift`` (notable without a change point).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .find import RULES, Candidate, display_module, format_value, model_wide_texts
from .find.base import MODEL, ONSET_TOLERANCE_SAMPLES, group_window, is_early, step_size
from .series import (
    CHANGE_CONTEXT_SAMPLES,
    GRAD_OUTPUT,
    RMS_TO_ROOT,
    TensorSeries,
    forward_positions,
)
from .track import SeriesTracker, bounded_exp

if TYPE_CHECKING:
    from ._snapshot import RunSnapshot

__all__ = [
    "CROSS_SECTION_NEIGHBOURS",
    "HISTORY_REST_POINTS",
    "QUIET_ROWS_PER_CATEGORY",
    "Event",
    "SameTensor",
    "build_events",
    "event_history",
    "modules_stopped",
    "onset_of",
    "quiet_row",
]

#: Findings that are not notable listed per category, as compact rows.
QUIET_ROWS_PER_CATEGORY = 3
#: Points of an event's history outside the windows around its change points (evenly
#: spaced over the bounded history, the first and the latest included).
HISTORY_REST_POINTS = 16
#: Neighbours listed on each side of an event's module in its cross-section.
CROSS_SECTION_NEIGHBOURS = 3
#: Departure, in residual spreads, from which a neighbour counts as having moved at the
#: onset (the cross-section's ``moved``), as ``find.base.UPSTREAM_DEPARTURE_SPREADS``.
MOVED_SPREADS = 3.0
#: A module whose last sample is at least this many samples (and this share of the
#: run's samples) before the run's last sample stopped being called.
STOPPED_MIN_SAMPLES = 4
STOPPED_MIN_SHARE = 0.1
#: Most modules named under ``coverage.modules_stopped``.
MAX_MODULES_STOPPED = 16


# ------------------------------------------------------------------ same tensor
class SameTensor:
    """Series that recorded identical values at every sample: one tensor seen by
    several modules (pass-throughs, the root's output).

    Two series are the same tensor when they have the same signal and, for their
    ``rms`` and ``max_abs`` trackers, the same count, first, latest, minimum, maximum
    and bounded history, and their ``rms`` varied (constant series are left apart:
    equal constants say nothing about identity).
    """

    def __init__(self, series: Iterable[TensorSeries]) -> None:
        positions = forward_positions(series := list(series))
        groups: dict[tuple[object, ...], list[TensorSeries]] = {}
        for s in series:
            key = _fingerprint(s)
            if key is not None:
                groups.setdefault(key, []).append(s)
        self._primary: dict[int, TensorSeries] = {}
        self._names: dict[int, list[TensorSeries]] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            members.sort(
                key=lambda s: (
                    positions.get((s.module, s.call_index, s.tensor_path), s.forward_position),
                    s.module == "",
                    s.module,
                )
            )
            # The root last: its output is what the model returns, not where it began.
            members.sort(key=lambda s: s.module == "")
            for s in members:
                self._primary[id(s)] = members[0]
            self._names[id(members[0])] = members[1:]

    def primary(self, series: TensorSeries) -> TensorSeries:
        """The series that names ``series``' tensor (itself when it is alone)."""
        return self._primary.get(id(series), series)

    def others(self, series: TensorSeries) -> list[TensorSeries]:
        """The other series of ``series``' tensor (its primary's aliases), in forward order."""
        primary = self.primary(series)
        return (
            [primary, *self._names.get(id(primary), [])]
            if primary is not series
            else list(self._names.get(id(series), []))
        )

    def also_named(self, series: TensorSeries) -> list[str]:
        """Display names of the other modules of ``series``' tensor (tensor path added
        when it differs)."""
        names = []
        for other in self.others(series):
            if other is series:
                continue
            name = display_module(other.module)
            if other.call_index:
                name += f" (call {other.call_index})"
            if other.tensor_path != series.tensor_path:
                name += f" {other.tensor_path}"
            names.append(name)
        return names


def _fingerprint(s: TensorSeries) -> tuple[object, ...] | None:
    rms = s.trackers.get("rms")
    if rms is None or rms.count < 2 or rms.min is None or rms.max is None:
        return None
    if rms.min.value == rms.max.value:
        return None
    parts: list[object] = [s.signal]
    for metric in ("rms", "max_abs"):
        t = s.trackers.get(metric)
        if t is None:
            return None
        parts.append((t.count, t.first, t.latest, t.min, t.max, tuple(t.history())))
    return tuple(parts)


def dedupe(candidates: Sequence[Candidate], same: SameTensor) -> list[Candidate]:
    """``candidates`` (ranked) without those whose tensor, metric and signal an earlier
    one already stands for; echoes of the same tensor as their origin, or as an earlier
    echo, are dropped too."""
    # The root returns another module's tensor: that module names it.
    named: dict[tuple[int, str], Candidate] = {}
    for c in candidates:
        key = (id(same.primary(c.series)), c.metric)
        if key not in named or (named[key].series.module == "" and c.series.module != ""):
            named[key] = c
    kept: list[Candidate] = []
    seen: set[tuple[int, str]] = set()
    for c in candidates:
        key = (id(same.primary(c.series)), c.metric)
        if key in seen:
            continue
        seen.add(key)
        c = named[key]
        if c.echoes:
            # One echo per tensor, named by its producer when that one is an echo too.
            own = id(same.primary(c.series))
            chosen: dict[int, Candidate] = {}
            for e in c.echoes:
                tensor = id(same.primary(e.series))
                if tensor == own:
                    continue
                if tensor not in chosen or same.primary(e.series) is e.series:
                    chosen[tensor] = e
            c.echoes = [e for e in c.echoes if chosen.get(id(same.primary(e.series))) is e]
        kept.append(c)
    return kept


# ------------------------------------------------------------------ events
@dataclass(slots=True)
class Facet:
    """One category's notable candidate, and the event it belongs to."""

    category: str
    rank: int
    candidate: Candidate
    event: Event | None = None


@dataclass(slots=True)
class Event:
    """One change at one module and onset (see the module docstring).

    Attributes:
        number: 1-based, in report order (``id`` ``E<number>``).
        facets: the category facets, the first one the event's own (its module, onset,
            history and cross-section).
        members: (module, call index) of the first facet's series and of every echo of
            every facet, for joining.
    """

    number: int
    facets: list[Facet]
    members: set[tuple[str, int]] = field(default_factory=set)

    @property
    def id(self) -> str:
        return f"E{self.number}"

    @property
    def lead(self) -> Candidate:
        return self.facets[0].candidate

    @property
    def model_wide(self) -> bool:
        return self.lead.model_wide is not None

    @property
    def shape(self) -> str:
        c = self.lead
        if c.model_wide is not None:
            return "model_wide"
        if any(f.category == "non_finite" for f in self.facets):
            return "non_finite"
        if c.change is not None and c.onset is not None:
            if c.change.kind == "trend":
                return "bend"
            return "spike" if c.change.transient else "step"
        if c.category == "oscillation":
            return "oscillation"
        if c.category == "relative_volatility":
            return "volatility"
        return "drift"


def _members(c: Candidate) -> set[tuple[str, int]]:
    return {(c.series.module, c.series.call_index)} | {
        (e.series.module, e.series.call_index) for e in c.echoes
    }


def _joins(event: Event, c: Candidate) -> bool:
    lead = event.lead
    if (c.model_wide is not None) != event.model_wide:
        return False
    if event.model_wide:
        onset = lead.onset or 0
        window = group_window(lead, ONSET_TOLERANCE_SAMPLES)
        return c.onset is not None and onset - ONSET_TOLERANCE_SAMPLES <= c.onset <= onset + window
    where = (c.series.module, c.series.call_index)
    if c.onset is None:
        return where in event.members
    if lead.onset is None or abs(c.onset - lead.onset) > ONSET_TOLERANCE_SAMPLES:
        return False
    lead_where = (lead.series.module, lead.series.call_index)
    if where == lead_where or lead_where in _members(c):
        # The event's module is this facet's, or one of its echoes: of any signal (an
        # activation step moves the output gradients at the same samples).
        return True
    same_signal = c.series.signal == lead.series.signal
    return same_signal and (where in event.members or bool(_members(c) & event.members))


def build_events(facets: Sequence[Facet]) -> list[Event]:
    """Group ``facets`` (notable, in report order) into events; set each facet's
    ``event``. Events are numbered in the order of their first facet."""
    events: list[Event] = []
    for facet in facets:
        c = facet.candidate
        event = next((e for e in events if _joins(e, c)), None)
        if event is None:
            event = Event(number=len(events) + 1, facets=[])
            events.append(event)
        event.facets.append(facet)
        event.members |= _members(c)
        facet.event = event
    return events


# ------------------------------------------------------------------ history
def event_history(
    series: TensorSeries, metric: str, tracker: SeriesTracker, observer: RunSnapshot
) -> list[list[float | int | None]]:
    """``[sample, forward, value]`` points of one series: every observed sample from
    ``CHANGE_CONTEXT_SAMPLES`` before to as many after each change point's first sample
    (``TensorSeries.change_windows``), and ``HISTORY_REST_POINTS`` points of the bounded
    history (the first and the latest among them), in sample order. ``forward`` is the
    sample's training forward (None where the schedule no longer says)."""
    history = tracker.history()
    if len(history) > HISTORY_REST_POINTS:
        step = (len(history) - 1) / (HISTORY_REST_POINTS - 1)
        history = [history[round(i * step)] for i in range(HISTORY_REST_POINTS)]
    points: dict[int, tuple[int | None, float]] = {
        sample: (observer.sample_forwards.forward(sample), value) for sample, value in history
    }
    for sample, forward, value in series.change_windows.get(metric, ()):
        points[sample] = (forward, value)
    return [[sample, forward, value] for sample, (forward, value) in sorted(points.items())]


def _echo_points(e: Candidate, observer: RunSnapshot) -> list[list[float | int | None]]:
    """``[sample, forward, value]`` of an echo's judged measure (``rms_to_root`` for an
    output gradient ranked on it) around its own change: the observed samples from
    ``CHANGE_CONTEXT_SAMPLES`` before to as many after its first sample (at most 7; for
    a break of trend, found when the report is built, the bounded history's points in
    that range)."""
    measure = e.metric if e.judged is e.tracker else RMS_TO_ROOT
    onset = e.onset
    if onset is None:
        return []
    low, high = onset - CHANGE_CONTEXT_SAMPLES, onset + CHANGE_CONTEXT_SAMPLES
    window = e.series.change_windows.get(measure, ())
    points: list[list[float | int | None]] = [
        [sample, forward, value] for sample, forward, value in window if low <= sample <= high
    ]
    if points:
        return points
    return [
        [sample, observer.sample_forwards.forward(sample), value]
        for sample, value in e.judged.history()
        if low <= sample <= high
    ]


# ------------------------------------------------------------------ cross-section
def cross_section(
    c: Candidate, observer: RunSnapshot, same: SameTensor
) -> list[dict[str, Any]] | None:
    """At the change's first sample, the candidate's module and up to
    ``CROSS_SECTION_NEIGHBOURS`` observed neighbours on each side in forward order
    (same signal, call and judged metric; one row per tensor): each value against its
    own trend forecast, as ``before`` (the forecast), ``after`` (observed), their
    ``ratio`` (log-scale metrics; a ``difference`` otherwise) and ``in_spreads`` (the
    departure in that series' own residual spreads), and ``offset`` (its place from the
    candidate's module, negative before it), with ``measured``: ``against_trend``. For
    a sample no longer among a neighbour's latest values, its row compares the kept
    points on each side of the sample (``measured``: ``between_kept_points``, with
    their ``samples``; ``in_spreads`` in its current residual spread). None without a
    change point."""
    change = c.change
    if change is None:
        return None
    metric = c.metric if c.judged is c.tracker else RMS_TO_ROOT
    sample = change.start_sample
    signal = c.series.signal
    origin = c.series
    own = same.primary(origin)
    # One row per tensor: the candidate's own series stands for its tensor.
    peers = [
        s
        for s in observer.series.values()
        if s.signal == signal
        and metric in s.trackers
        and (s is origin or (same.primary(s) is s and s is not own))
    ]
    positions = forward_positions(observer.series.values())
    peers.sort(key=lambda s: (positions.get((s.module, s.call_index, s.tensor_path), 0), s.module))
    index = next((i for i, s in enumerate(peers) if s is origin), None)
    if index is None or metric not in origin.trackers:
        return None
    rows: list[dict[str, Any]] = []
    start = max(0, index - CROSS_SECTION_NEIGHBOURS)
    for offset, s in enumerate(peers[start : index + CROSS_SECTION_NEIGHBOURS + 1], start - index):
        tracker = s.trackers[metric]
        row = _trend_row(tracker, sample)
        if row is None:
            row = _history_row(s, metric, tracker, sample)
        if row is None:
            continue
        rows.append(
            {
                "offset": offset,
                "module": display_module(s.module),
                "call_index": s.call_index,
                "tensor_path": s.tensor_path,
                **row,
            }
        )
    return rows


def _trend_row(tracker: SeriesTracker, sample: int) -> dict[str, Any] | None:
    """The value at ``sample`` against its trend forecast, while it is among the
    tracker's latest values."""
    departure = tracker.departure_at(sample)
    if departure is None:
        return None
    before = tracker.level(departure.forecast)
    after = tracker.level(departure.value)
    row: dict[str, Any] = {"measured": "against_trend", "before": before, "after": after}
    if tracker.log_scale:
        row["ratio"] = after / before if before > 0 else None
    else:
        row["difference"] = after - before
    row["in_spreads"] = departure.z
    return row


def _history_row(
    s: TensorSeries, metric: str, tracker: SeriesTracker, sample: int
) -> dict[str, Any] | None:
    """For a ``sample`` older than the tracker's latest values: the kept points on each
    side of it (the windows around change points, else the bounded history), their
    ratio or difference, and that in the tracker's current residual spread."""
    points = sorted({*tracker.history(), *((p[0], p[2]) for p in s.change_windows.get(metric, ()))})
    before = next((p for p in reversed(points) if p[0] < sample), None)
    after = next((p for p in points if p[0] >= sample), None)
    if before is None or after is None:
        return None
    row: dict[str, Any] = {
        "measured": "between_kept_points",
        "samples": [before[0], after[0]],
        "before": before[1],
        "after": after[1],
    }
    spread = tracker.spread
    if tracker.log_scale:
        if before[1] <= 0 or after[1] <= 0:
            return None
        row["ratio"] = after[1] / before[1]
        change = math.log(after[1] / before[1])
    else:
        row["difference"] = after[1] - before[1]
        change = after[1] - before[1]
    row["in_spreads"] = change / spread if spread > 0 else None
    return row


# ------------------------------------------------------------------ texts
_NORM = ("Norm",)
_WEIGHTED = ("Linear", "Conv", "Embedding", "Bilinear")
_NONLINEAR = ("ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "Mish", "Softplus", "ELU")
_PASS = ("Dropout", "Identity")


def module_kind(kind: str | None) -> str:
    """The family of a module class name: ``normalization``, ``weighted`` (linear,
    convolution, embedding), ``nonlinearity``, ``pass_through`` (dropout, identity),
    ``attention`` or ``block`` (anything else: a container or custom module)."""
    if not kind:
        return "block"
    if any(word in kind for word in _NORM):
        return "normalization"
    if any(kind.startswith(word) or word in kind for word in _WEIGHTED) or kind == "Conv1D":
        return "weighted"
    if any(word in kind for word in _NONLINEAR):
        return "nonlinearity"
    if any(word in kind for word in _PASS):
        return "pass_through"
    if "Attention" in kind:
        return "attention"
    return "block"


_SIGNAL_WORDS = {"activation": "activations", "grad_output": "output gradients"}


def _keep_fixed(text: str) -> str:
    return f"{text} Keep seed, data order and precision fixed so the runs compare."


def onset_of(sample: int | None, observer: RunSnapshot) -> dict[str, int | None]:
    """An event's ``onset``: its first sample, that sample's training forward, and
    ``after_forward``, the forward of the sample before it (None at the first sample or
    where the schedule no longer says): the change happened in the forwards after
    ``after_forward``, up to and including ``forward``."""
    forwards = observer.sample_forwards
    before = forwards.forward(sample - 1) if sample is not None and sample > 0 else None
    return {
        "sample": sample,
        "forward": forwards.forward(sample) if sample is not None else None,
        "after_forward": before,
    }


def _when(sample: int | None, forward: int | None) -> str:
    if sample is None:
        return "an unknown sample"
    return f"sample {sample}" + (f" (training forward {forward})" if forward is not None else "")


def _trend_word(c: Candidate, previous: tuple[int, int, float] | None) -> str:
    """``rising``, ``falling`` or ``flat``: the trend before the change, over the gap
    from the previous observed sample (or one forward), against the residual spread."""
    change = c.change
    assert change is not None
    gap = change.start_forward - previous[1] if previous is not None else 1
    movement = change.slope_before * max(gap, 1)
    if abs(movement) < 0.5 * change.std_before:
        return "flat"
    return "rising" if movement > 0 else "falling"


def _stopped_near(
    stopped: Sequence[dict[str, Any]], module: str, start: int
) -> dict[str, Any] | None:
    """The module that stopped being called just before ``start`` (its last sample
    within ``ONSET_TOLERANCE_SAMPLES`` before it), sharing the longest name prefix with
    ``module``; None if none did."""
    near = [
        m for m in stopped if start - ONSET_TOLERANCE_SAMPLES - 1 <= m["last_sample"] < start + 1
    ]
    if not near:
        return None

    def shared(m: dict[str, Any]) -> int:
        a, b = str(m["module"]).split("."), module.split(".")
        count = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            count += 1
        return count

    return max(near, key=shared)


def _step_texts(
    event: Event,
    observer: RunSnapshot,
    kinds: dict[str, str],
    same: SameTensor,
    stopped: Sequence[dict[str, Any]],
) -> tuple[str, str]:
    c = event.lead
    change = c.change
    assert change is not None
    t = c.judged
    s = c.series
    measure = c.metric if t is c.tracker else RMS_TO_ROOT
    module = display_module(s.module)
    where = f"{module} (call {s.call_index}, {s.tensor_path}) {s.signal}.{measure}"
    forward = observer.sample_forwards.forward(change.start_sample)
    window = s.change_windows.get(measure, [])
    previous = next((p for p in reversed(window) if p[0] < change.start_sample), None)
    trend = _trend_word(c, previous)
    before, after = t.level(change.level_before), t.level(change.level_after)
    side = "above" if change.step > 0 else "below"
    if t.log_scale and after > 0.0:
        size = f"{format_value(bounded_exp(abs(change.step)))}x {side}"
    else:
        size = f"{format_value(abs(after - before))} {side}"
    kind = "returned to its old trend afterwards (one sample's spike)"
    if event.shape == "step":
        kind = (
            "held in the samples after it"
            if change.confirmed
            else "not yet confirmed by later samples"
        )
    text = (
        f"{where} moved {size} its {trend} trend at {_when(change.start_sample, forward)}: "
        f"{format_value(after)} where the trend forecast {format_value(before)} "
        f"({format_value(abs(change.step_z))} residual spreads), and {kind}."
    )
    if previous is not None:
        verb = "rose" if previous[2] < after else "fell" if previous[2] > after else "stayed"
        text += (
            f" The value itself {verb} from {format_value(previous[2])} at sample "
            f"{previous[0]} to {format_value(after)}."
        )
    section = cross_section(c, observer, same)
    if section:
        known = [r for r in section if r["offset"] < 0 and r["in_spreads"] is not None]
        moved_before = [r for r in known if abs(r["in_spreads"]) >= MOVED_SPREADS]
        quiet_before = [r for r in known if abs(r["in_spreads"]) < MOVED_SPREADS]
        if s.signal != GRAD_OUTPUT and quiet_before and not moved_before:
            text += (
                f" The modules before it in forward order did not move "
                f"({', '.join(r['module'] for r in quiet_before[-2:])} within 3 spreads): "
                "the change begins here."
            )
    echoes = {
        (e.series.module, e.series.call_index)
        for f in event.facets
        if f.candidate.series.signal == s.signal
        for e in f.candidate.echoes
    }
    if echoes:
        text += f" {len(echoes)} module(s) after it in propagation order moved at the same samples."
    other = sorted({f.candidate.series.signal for f in event.facets} - {s.signal})
    if other:
        facets = [f.category for f in event.facets if f.candidate.series.signal != s.signal]
        text += (
            f" The {' and '.join(_SIGNAL_WORDS.get(x, x) for x in other)} moved at the same "
            "samples too "
            f"({', '.join(facets)})."
        )
    when = _when(change.start_sample, forward)
    family = module_kind(kinds.get(s.module))
    gone = _stopped_near(stopped, module, change.start_sample)
    if gone is not None:
        text += (
            f" {gone['module']} (call {gone['call_index']}) stopped being called after "
            f"sample {gone['last_sample']}, just before this change."
        )
        if event.shape == "step" and s.signal != GRAD_OUTPUT:
            experiment = (
                f"Check why {gone['module']} no longer runs from {when} (removed, "
                f"replaced or bypassed by a code path); restore it and check whether "
                f"{module}'s {measure} returns to its trend."
            )
            return text, _keep_fixed(experiment)
    if event.shape == "spike":
        experiment = (
            f"Look at the batch of {when}: a value that returns to its trend the next "
            f"sample is one batch (an outlier input, a rare token or class), not a lasting "
            f"change at {module}. Rerun that batch alone and check {module}'s input."
        )
        return text, _keep_fixed(experiment)
    if s.signal == GRAD_OUTPUT:
        experiment = (
            f"The gradient reaching {module} changed at {when} while the loss gradient did "
            f"not account for it: something after {module} in forward order changed its "
            f"backward. Restore the modules after {module} one at a time, nearest first, "
            f"and rerun to just past {when}."
        )
        return text, _keep_fixed(experiment)
    zero = any(f.category == "zero_fraction_growth" for f in event.facets)
    if (zero and change.step > 0) or measure == "zero_fraction":
        experiment = (
            f"Units at {module} stopped firing at {when}: check the scale and bias of "
            f"its input (the module before it) and the learning rate at that point; "
            f"restore them one at a time and check whether {module}'s zero_fraction "
            "returns to its trend."
        )
    elif family == "normalization":
        experiment = (
            f"Check {module}'s normalization at {when}: whether it was removed, bypassed, "
            "re-initialized or switched between train and eval; compare its weight, bias "
            "and running statistics with a run without the change."
        )
    elif family == "weighted":
        experiment = (
            f"{module} is a {kinds.get(s.module)}: compare its weight norm just before and "
            f"just after {when} (two checkpoints, or a rerun to just past it); a step in "
            "its output with its input steady means its weights (or a scale applied to "
            "them) changed there. Restore them at this module only."
        )
    elif family == "nonlinearity":
        experiment = (
            f"{module} is a {kinds.get(s.module)}, which has no weights: its output moves "
            f"with its input. Check the module before it and any change to the "
            f"nonlinearity itself at {when}."
        )
    elif family == "pass_through":
        experiment = (
            f"{module} is a {kinds.get(s.module)}: check its probability and train or "
            f"eval mode at {when}, and the module before it."
        )
    else:
        experiment = (
            f"Rerun to just past {when} with {module}'s parts restored one at a time "
            "(normalization, residual scale, weights), starting with the first whose "
            "output moved in the cross-section."
        )
    return text, _keep_fixed(experiment)


def _bend_experiment(c: Candidate, kinds: dict[str, str]) -> str:
    """Next experiment of a break of trend: a slow cause at the module, by its kind."""
    s = c.series
    module = display_module(s.module)
    change = c.change
    assert change is not None
    start = f"sample {change.start_sample} (training forward {change.start_forward})"
    family = module_kind(kinds.get(s.module))
    if s.signal == GRAD_OUTPUT:
        cause = (
            f"the modules after {module} in forward order: a gradient that bends while the "
            "loss gradient does not comes from a backward that changes a little every step"
        )
    elif family == "weighted":
        cause = (
            f"{module}'s weights: log their norm and the norm of each update from just "
            f"before {start} on; a norm that compounds points at its learning rate, its "
            "weight decay or a scale applied to it every step"
        )
    elif family == "normalization":
        cause = (
            f"{module}'s affine parameters and running statistics: log them from just "
            f"before {start} on (a momentum, an epsilon or a learning rate that changed)"
        )
    else:
        cause = (
            f"the module before {module} and {module}'s own parameters, logged from just "
            f"before {start} on"
        )
    return _keep_fixed(
        f"A course that bends instead of stepping has a slow cause, one that acts a little "
        f"every step: look at {cause}. If many modules bend from about the same sample, "
        "look at the learning rate and its schedule first."
    )


def event_texts(
    event: Event,
    observer: RunSnapshot,
    kinds: dict[str, str],
    same: SameTensor,
    stopped: Sequence[dict[str, Any]] = (),
) -> tuple[str, str]:
    """Interpretation (what was measured, in words) and next experiment of an event,
    from its shape and the kind of its module."""
    c = event.lead
    shape = event.shape
    if shape == "model_wide":
        return model_wide_texts(c, observer.sample_forwards.forward(c.onset))
    if shape == "non_finite":
        facet = next(f for f in event.facets if f.category == "non_finite")
        rule = RULES["non_finite"]
        return rule.interpretation(facet.candidate), rule.next_experiment(facet.candidate)
    if shape in ("step", "spike"):
        return _step_texts(event, observer, kinds, same, stopped)
    rule = RULES[c.category]
    if shape == "bend":
        return rule.interpretation(c), _bend_experiment(c, kinds)
    return rule.interpretation(c), rule.next_experiment(c)


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
        "early_in_run": is_early(c),
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
        "early_in_run": is_early(c),
        "findings": [
            {"category": f.category, "rank": f.rank, "metric": f.candidate.metric}
            for f in event.facets
        ],
    }
    if event.model_wide:
        body["model_wide"] = {
            "share_of_modules": c.model_wide,
            "modules": len(c.echoes) + 1,
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
        t = s.trackers.get("rms")
        if t is None or t.latest is None:
            continue
        key = (s.module, s.call_index)
        sample, count = latest.get(key, (-1, 0))
        latest[key] = (max(sample, t.latest.sample), max(count, t.count))
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
